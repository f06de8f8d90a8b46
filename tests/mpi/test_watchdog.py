"""A rank that never reaches a collective ends the job quickly, named, with a non-zero exit."""
import time

import pytest

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("slow", [2, 0])   # 0: the stuck rank is the one that usually reports
def test_stall_is_reported_and_aborts(run_ranks, slow):
    t0 = time.monotonic()
    run = run_ranks(3, "stall.py", str(slow), "2", timeout=90)
    elapsed = time.monotonic() - t0
    assert run.returncode != 0
    assert "finished" not in run.stdout
    err = run.stderr
    assert err.count("psrt: watchdog: no progress for 2 s") == 1, err[-3000:]
    assert f"rank {slow} (" in err and "has not reached call #2" in err, err[-3000:]
    waiting = [r for r in range(3) if r != slow]
    for r in waiting:
        assert f"rank {r} (" in err and "waiting in allreduce call #2" in err
    assert elapsed < 60, elapsed    # the sleeping rank would hold the job for 60 s
