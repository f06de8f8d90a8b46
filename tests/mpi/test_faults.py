"""A rank that fails ends the whole job quickly, non-zero, says so once, and leaves nothing behind.

Faults injected (tests/mpi/ranks/fault_rank.py, tests/mpi/ranks/fault_train.py): an ordinary exception in
user code while the other ranks wait in an allreduce, SIGKILL of one rank, and a worker of a
parameter-server training job (`python -m psrt.train --dp ps --servers 1`, `--dp ps-async`)
that dies mid-training.  Time to detect is measured from the moment the rank fails (it prints
the time just before) to the end of mpirun.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import MPI_SCRIPTS, ROOT, RankRun, mpirun_argv

pytestmark = pytest.mark.mpi

DETECT_S = 20          # generous: the machine these run on may be heavily shared
TRAIN = ["--steps", "8", "--quiet", "--data", "synthetic", "--width", "16", "--batch-size", "16"]


def launch(np_: int, script: str, *args: str, limit: float = 120):
    """Run `script` on np_ ranks in its own session; kill the whole session if it outlives
    `limit`.  Returns (RankRun, seconds from the fault to the end, tag, timed_out)."""
    tag = f"psrt-fault-{uuid.uuid4().hex[:10]}"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_COMM_", "OMPI_MCA_orte_", "OMPI_MCA_ess", "PMIX_", "PMI_", "PSRT_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    argv = list(args)
    cut = argv.index("--") if "--" in argv else len(argv)
    argv.insert(cut, tag)                  # a unique word to find leftovers with ps
    proc = subprocess.Popen(mpirun_argv(np_) + [sys.executable, str(MPI_SCRIPTS / script)] + argv,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    ended = time.time()
    run = RankRun(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    faults = [r["fault_at"] for r in run.records() if "fault_at" in r]
    assert len(faults) == 1, f"the fault was not injected once:\n{out[-2000:]}\n{err[-3000:]}"
    print(f"{script} {' '.join(args)}: job ended {ended - faults[0]:.1f} s after the fault")
    return run, ended - faults[0], tag, timed_out


def leftovers(tag: str) -> list[str]:
    """Processes still running with our tag (ranks that outlived their job)."""
    time.sleep(0.5)
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    mine = [line for line in ps.splitlines() if tag in line]
    for line in mine:                      # never leave them for the next test either
        try:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    return mine


def program_lines(stderr: str, needle: str) -> list[str]:
    return [line for line in stderr.splitlines() if needle in line]


def test_exception_on_one_rank_ends_the_job_with_one_line():
    """psrt.faults: an uncaught exception -> one line naming rank and error, MPI_Abort."""
    run, detect, tag, timed_out = launch(3, "fault_rank.py", "raise", "1", "1", limit=90)
    assert not timed_out and run.returncode != 0, run.stderr[-3000:]
    assert "finished" not in run.stdout
    lines = program_lines(run.stderr, "injected failure")
    assert len(lines) == 1, run.stderr[-3000:]
    assert lines[0].startswith("[rank 1] fault_rank: error: RuntimeError: injected failure in user code")
    assert "Traceback" not in run.stderr
    assert detect < DETECT_S, detect
    assert not leftovers(tag)


def test_exception_without_explicit_hook_does_not_hang():
    run, detect, tag, timed_out = launch(3, "fault_rank.py", "raise", "1", "0", limit=45)
    stray = leftovers(tag)
    assert not timed_out and run.returncode != 0
    assert detect < DETECT_S, detect
    assert len(program_lines(run.stderr, "injected failure")) == 1, run.stderr[-3000:]
    assert not stray


def test_sigkill_of_one_rank_ends_the_job():
    run, detect, tag, timed_out = launch(3, "fault_rank.py", "kill", "2", "0", limit=90)
    assert not timed_out and run.returncode != 0, run.stderr[-3000:]
    assert "finished" not in run.stdout
    assert "rank 2" in run.stderr and "signal 9" in run.stderr, run.stderr[-3000:]
    assert detect < DETECT_S, detect
    assert not leftovers(tag)


@pytest.mark.parametrize("mode,dp", [("kill", "ps"), ("raise", "ps"), ("raise", "ps-async")])
def test_dead_worker_ends_a_parameter_server_job(mode, dp):
    """1 server + 2 workers; worker 1 dies before its 4th step.  The server and the other
    worker must not wait for it forever."""
    run, detect, tag, timed_out = launch(3, "fault_train.py", mode, "1", "4", "1",
                                         "--", "--dp", dp, "--servers", "1", *TRAIN, limit=150)
    assert not timed_out, f"the job hung:\n{run.stderr[-3000:]}"
    assert run.returncode != 0
    assert "samples/s" not in run.stdout           # no summary table: training did not 'finish'
    if mode == "raise":
        lines = program_lines(run.stderr, "injected failure")
        assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert detect < DETECT_S, detect
    assert not leftovers(tag)


def test_a_users_error_is_one_line_per_rank_naming_the_users_line(tmp_path):
    """A user's script (no hook of its own) raising inside torch on one rank, and on two ranks
    at once, under mpi_launch: at most one line per rank on stderr, none cut into another,
    each naming the user's file and line before torch's, nothing of MPI's abort notice, which
    is kept in the file the line names, in the job's directory of PSRT_LOG_DIR."""
    script = MPI_SCRIPTS / "user_error.py"
    line = next(i for i, text in enumerate(script.read_text().splitlines(), 1) if "# LINE" in text)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_", "PMIX_", "PSRT_"))}
    env.pop("OMP_NUM_THREADS", None)            # (mpi_launch would note that it keeps it)
    env.update(PYTHONPATH=str(ROOT), PSRT_LOG_DIR=str(tmp_path))
    procs = {ranks: subprocess.Popen([str(ROOT / "mpi_launch"), "-np", "2", sys.executable, str(script), ranks],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     stdin=subprocess.DEVNULL)
             for ranks in ("1", "0,1")}
    for ranks, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 1, err[-3000:]
        lines = err.splitlines()
        assert 1 <= len(lines) <= len(ranks.split(",")), err[-3000:]
        assert len(set(l.split("]")[0] for l in lines)) == len(lines), err     # one per rank
        for text in lines:
            rank = int(text.split("]")[0].removeprefix("[rank "))
            assert str(rank) in ranks.split(","), text
            assert text.startswith(f"[rank {rank}] psrt: error: RuntimeError: mat1 and mat2 shapes"), text
            assert f"(user_error.py:{line}, in torch/nn/modules/linear.py:" in text, text
            assert text.count("psrt: error") == 1, text
        logs = {text.rsplit("(MPI's abort notice: ", 1)[1].rstrip(")") for text in lines}
        assert len(logs) == 1, lines
        log = Path(logs.pop())
        assert log.parent.parent == tmp_path and log.name == "mpi.log", log
        kept = log.read_text()      # the abort notice, or the daemon's error line two aborts at once leave in its place
        assert "MPI_ABORT was invoked" in kept or "ORTE_ERROR_LOG" in kept, kept
        assert "MPI_ABORT" not in err and "ORTE" not in err and "----" not in err


def test_a_join_that_a_rank_never_reaches_ends_with_an_error_naming_it(run_ranks):
    """psrt.train's join at the end of each strategy's run (psrt.collectives.p2p.barrier) is a
    wait the watchdog does not see (no rank is in a collective): it has a deadline of its own."""
    records = run_ranks(2, "late_join.py", "6", "1", timeout=60).check().records()
    late = next(r for r in records if r["rank"] == 1)
    assert late["said"] == "the test's join: not every rank of 2 came within 1 s (PSRT_TIMEOUT)", late
    assert 1 <= late["waited"] < 5, late
