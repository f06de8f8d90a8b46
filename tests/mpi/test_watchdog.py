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


def test_a_rank_that_leaves_is_named_and_a_waiting_rank_does_not_spin():
    """torch.distributed on psrt, default settings.  skip: rank 1 goes on to
    destroy_process_group while rank 0 waits in an all_reduce rank 1 never makes; rank 0 ends
    the job within 5 s with one line naming the call and the rank that left.  late: rank 1
    comes to the all_reduce 10 s after rank 0, which spends under 2 s of CPU waiting."""
    import os
    import subprocess
    import sys
    from conftest import MPI_SCRIPTS, ROOT, RankRun, mpirun_argv
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_", "PMIX_", "PSRT_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs = {mode: subprocess.Popen(mpirun_argv(2) + [sys.executable, str(MPI_SCRIPTS / "skipped_call.py"), mode],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                    stdin=subprocess.DEVNULL)
             for mode in ("skip", "late")}
    ended, runs = {}, {}
    for mode, proc in procs.items():
        out, err = proc.communicate(timeout=150)
        ended[mode] = time.time()
        runs[mode] = RankRun(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    skip = runs["skip"]
    assert skip.returncode != 0 and "finished" not in skip.stdout, skip.stderr[-3000:]
    since = [r["waiting_since"] for r in skip.records() if "waiting_since" in r]
    assert len(since) == 1 and ended["skip"] - since[0] < 5, (ended["skip"] - since[0], skip.stderr[-3000:])
    lines = [line for line in skip.stderr.splitlines() if "psrt" in line]
    assert len(lines) == 1, skip.stderr[-3000:]
    assert lines[0].startswith("[rank 0] psrt: error: rank 0 waits in allreduce call #2"), lines
    assert "rank 1 (" in lines[0] and "shut down after its allreduce call #1" in lines[0], lines
    late = runs["late"].check().records()
    assert len(late) == 1 and late[0]["sum"] == [2.0] * 4, late
    assert late[0]["wall_s"] > 9 and late[0]["cpu_s"] < 2, late
