"""A rank that leaves early with exit code 0 (sys.exit in the middle of a loop, a loop that
ends without finish()) ends the job within PSRT_TIMEOUT, with one line naming it and a
non-zero exit, from every entry point: psrt.data_parallel (ring, ps), a bare Communicator,
torch.distributed on the psrt backend (tests/mpi/ranks/leave_early.py).  Before psrt.init
watched every Communicator, rank 1 sat in MPI_Finalize and rank 0 in its all-reduce until
killed."""
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import MPI_SCRIPTS, ROOT, mpirun_argv

pytestmark = pytest.mark.mpi

MODES = ("ring", "ps", "nofinish", "comm", "c10d")
TIMEOUT_S = 10           # PSRT_TIMEOUT of the runs
LIMIT_S = 90             # the launch's own, which a hang would reach


@pytest.fixture(scope="module")
def runs():
    """Every mode launched at once (2 ranks each): (returncode, stdout, stderr, seconds)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_", "PMIX_", "PSRT_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PSRT_TIMEOUT=str(TIMEOUT_S))
    started = time.monotonic()
    procs = {mode: subprocess.Popen(mpirun_argv(2) + [sys.executable, str(MPI_SCRIPTS / "leave_early.py"), mode],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
             for mode in MODES}

    def wait(mode):       # each in a thread of its own: its own end time, read as it comes
        proc = procs[mode]
        try:
            stdout, stderr = proc.communicate(timeout=LIMIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            stdout, stderr = proc.communicate()
        return mode, (proc.returncode, stdout, stderr, time.monotonic() - started)
    with ThreadPoolExecutor(len(MODES)) as pool:
        out = dict(pool.map(wait, MODES))
    return out


@pytest.mark.parametrize("mode", MODES)
def test_a_rank_that_leaves_early_is_named_and_the_job_ends(runs, mode):
    code, stdout, stderr, seconds = runs[mode]
    shown = f"exit {code} after {seconds:.0f} s\nstdout:\n{stdout[-2000:]}\nstderr:\n{stderr[-3000:]}"
    assert "rank 1 leaves" in stdout, shown
    assert code != 0 and '"finished"' not in stdout, shown
    assert seconds < LIMIT_S - 30, shown
    assert "Traceback" not in stderr, shown
    lines = [line for line in stderr.splitlines() if "psrt" in line]
    assert len(lines) == 1, shown
    assert lines[0].startswith("[rank 0] psrt: error: "), shown
    said = lines[0].split("psrt: error: ", 1)[1]
    # the rank that left, named as such: not a wait that ran out of time (PSRT_TIMEOUT)
    assert re.search(r"\brank(\(s\))? \[?1\b", said) and " left" in said, shown
