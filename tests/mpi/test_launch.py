"""mpi_launch for real: jobs started through it on this machine, what the ranks see, exit
codes and signals, and the one-line errors of a bad launch."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import NOWHERE, PYTHON, interruptible, root_flag

from psrt.launch.__main__ import main as launch_main

ROOT = Path(__file__).resolve().parents[2]


# --- the CLI ----------------------------------------------------------------------------------


needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun on PATH")


@needs_mpirun
@pytest.mark.mpi
def test_mpi_launch_script_runs_ranks_and_errors_without_traceback(tmp_path):
    """The real script, end to end: two ranks report their world; bad input is one line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "SLURM_"))}
    env.pop("OMP_NUM_THREADS", None)
    out = subprocess.run([sys.executable, str(ROOT / "mpi_launch"), "-np", "2", "python", "-m",
                          "psrt.info", "--json", "--allreduce", "64KiB", "--iters", "1"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    recs = sorted((json.loads(l.split(" ", 1)[1]) for l in out.stdout.splitlines()
                   if l.startswith("PSRT-RESULT ")), key=lambda r: r["rank"])
    assert [(r["rank"], r["size"], r["local_rank"], r["num_nodes"], r["launcher"])
            for r in recs] == [(0, 2, 0, 1, "openmpi"), (1, 2, 1, 1, "openmpi")]
    assert all(r["allreduce_bytes"] == 65536 for r in recs)
    bad = subprocess.run([sys.executable, str(ROOT / "mpi_launch"), "-np", "0", "true"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr == "mpi_launch: error: -np 0: a job needs at least one rank\n"


@needs_mpirun
@pytest.mark.mpi
def test_psrt_yield_decides_what_each_ranks_mpi_does_under_mpi_launch(tmp_path):
    """3 ranks on a host of 1 slot: mpi_launch tells Open MPI to yield (`--mca
    mpi_yield_when_idle 1`), and PSRT_YIELD=0 still makes every rank's MPI poll, as its library
    reports it (psrt.info's yields_when_idle, read back through MPI_T)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "SLURM_", "PSRT_"))}
    seen = {}
    for psrt_yield in (None, "0"):
        out = subprocess.run([sys.executable, str(ROOT / "mpi_launch"), "--hosts", "localhost:1", "-np", "3",
                              "--oversubscribe", "python", "-m", "psrt.info", "--json"],
                             capture_output=True, text=True, timeout=300, cwd=tmp_path,
                             env={**env, **({"PSRT_YIELD": psrt_yield} if psrt_yield else {})})
        assert out.returncode == 0, out.stderr
        seen[psrt_yield] = [json.loads(l.split(" ", 1)[1])["yields_when_idle"]
                            for l in out.stdout.splitlines() if l.startswith("PSRT-RESULT ")]
    assert seen == {None: [True] * 3, "0": [False] * 3}


# --- the CLI, with this machine's mpirun ----------------------------------------------------

def cli(capsys, *args):
    """Run mpi_launch's main in this process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as done:
        sys.exit(launch_main(list(args)))
    out = capsys.readouterr()
    return done.value.code, out.out, out.err


@needs_mpirun
def test_cli_dry_run_prints_the_command(capsys, monkeypatch):
    for k in list(os.environ):
        if k.startswith("PSRT_") or k in ("OMP_NUM_THREADS", "PYTHONPATH"):
            monkeypatch.delenv(k)
    code, out, err = cli(capsys, "--dry-run", "-np", "2", "python", "-m", "psrt.info", "--json")
    threads = max(1, (os.cpu_count() or 1) // 2)
    assert code == 0 and out.count("\n") == 1
    assert out.startswith(" ".join(["mpirun", *root_flag(), "-np", "2"]))
    assert out.rstrip().endswith(f"-x PYTHONPATH={ROOT} -x OMP_NUM_THREADS={threads} "
                                 "python -m psrt.info --json")


@needs_mpirun
@pytest.mark.parametrize("args,message", [
    (["-np", "0", "true"], "-np 0: a job needs at least one rank"),
    (["--hosts", "a:2,b:2", "-np", "5", "true"], "-np 5 but --hosts offers 4 slots (a 2, b 2)"),
    (["--hosts", f"localhost:1,{NOWHERE}:1", "-np", "2", "true"], f"unknown host '{NOWHERE}'"),
    (["--emulate", "-np", "2", "true"], "an emulated cluster needs at least 2 hosts"),
    (["--rate", "1gbit", "-np", "1", "true"], "--rate, --delay and --subnet shape the emulated"),
    (["-np", "2"], "no command given"),
    (["--launcher", "srun", "--hostfile", str(ROOT / "hostfiles" / "two_nodes"), "true"],
     "srun places ranks on the Slurm allocation's nodes"),
])
def test_cli_bad_input_is_one_line_and_exit_2(capsys, args, message):
    code, out, err = cli(capsys, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("mpi_launch: error: ") and message in err


@needs_mpirun
@pytest.mark.parametrize("mpirun", [None, "abs"], ids=["mpirun-on-path", "mpirun-by-path"])
def test_ranks_run_the_python_the_user_meant(tmp_path, mpirun):
    """`mpi_launch ... python3 ...`: every rank runs the python3 of the user's PATH, also
    when mpirun is called by its absolute path (Open MPI then puts its own bin directory
    first on the ranks' PATH, where python3 may be the system's, without torch)."""
    want = subprocess.run(["python3", "-c", "import sys; print(sys.executable)"], capture_output=True,
                          text=True).stdout.strip()
    extra = ["--mpirun", shutil.which("mpirun")] if mpirun else []
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_", "PMIX_", "SLURM_"))}
    out = subprocess.run([str(ROOT / "mpi_launch"), "-np", "2", *extra, "python3", "-c",
                          "import sys, torch; sys.stdout.write(f'EXE {sys.executable}\\n')"],
                         capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = [line.split(" ", 1)[1] for line in out.stdout.splitlines() if line.startswith("EXE ")]
    assert seen == [want, want], out.stdout


@needs_mpirun
def test_an_error_every_rank_agrees_on_is_one_line_under_mpi_launch(tmp_path):
    """`mpi_launch ... psrt.train` with a bad batch: psrt's one line and exit 2, without Open
    MPI's non-zero-exit notices; a rank killed by a signal is still reported by mpirun."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_", "PMIX_", "SLURM_"))}
    bad = subprocess.run([str(ROOT / "mpi_launch"), "-np", "2", "python", "-m", "psrt.train", "--batch-size", "3"],
                         capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.splitlines() == ["[rank 0] psrt.train: error: --batch-size 3 does not split evenly over "
                                       "the 2 workers of --dp ring x 1 micro-batch (--accum): use a multiple of 2"]
    killed = subprocess.run([str(ROOT / "mpi_launch"), "-np", "2", "python", "-c",
                             "import os, signal\nfrom mpi4py import MPI\nif MPI.COMM_WORLD.rank == 1: "
                             "os.kill(os.getpid(), signal.SIGKILL)\nMPI.COMM_WORLD.Barrier()"],
                            capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert killed.returncode != 0 and "exited on signal 9" in killed.stderr, killed.stderr


# --- signals ----------------------------------------------------------------------------------


def job_processes(tag: str) -> list[str]:
    """Processes (not zombies) whose command line holds `tag`."""
    ps = subprocess.run(["ps", "-eo", "pid,stat,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if tag in line and " Z" not in line[:12]]


def _started(ignored: int | None):
    """preexec_fn: as from an interactive shell, or with `ignored` ignored (as from the
    background of a script)."""
    def preexec():
        import signal as signals
        interruptible()
        if ignored:
            signals.signal(ignored, signals.SIG_IGN)
    return preexec


def signal_jobs(cases: dict, limit: float = 120) -> dict:
    """Start each case's launcher of busy_job.py (argv, signal, tag, ignored) in its own
    session, all at once, and send it its signal once its job runs; a case's `ignored` signal
    (or None), which its launcher starts with ignored, is sent 2 s before.  Returns, per case,
    (exit code, whether it still ran after the ignored signal, seconds from the signal to the
    launcher's end, what is left of the job 10 s after the signal)."""
    import signal as signals
    import time
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_", "PMIX_", "SLURM_", "PSRT_"))}
    env["PYTHONPATH"] = str(ROOT)
    procs = {name: subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=_started(ignored))
             for name, (argv, _, _, ignored) in cases.items()}
    results = {}
    try:
        for name, proc in procs.items():
            assert proc.stdout.readline() == "running\n", proc.stderr.read()[-3000:]
            if cases[name][3]:
                proc.send_signal(cases[name][3])
        time.sleep(2)
        sent = {}
        for name, proc in procs.items():
            results[name] = [None, proc.poll() is None]
            sent[name] = time.monotonic()
            proc.send_signal(cases[name][1])
        for name, proc in procs.items():
            results[name][0] = proc.wait(timeout=limit)
            results[name].append(time.monotonic() - sent[name])
        time.sleep(max(0.0, 10 - (time.monotonic() - min(sent.values()))))
        for name, (_, _, tag, _) in cases.items():
            results[name].append(job_processes(tag))
    finally:
        for name, (_, _, tag, _) in cases.items():
            for line in job_processes(tag):       # never leave them to the next test
                try:
                    os.kill(int(line.split()[0]), signals.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            if procs[name].poll() is None:
                os.killpg(procs[name].pid, signals.SIGKILL)
    return results


@needs_mpirun
@pytest.mark.mpi
# It times the launcher's end (under 8 s) and starts five jobs at once.
@pytest.mark.alone
def test_a_signal_to_mpi_launch_ends_every_rank():
    """SIGTERM (what kill, timeout and batch schedulers send), SIGHUP and SIGINT to mpi_launch
    while its ranks run: it exits with 128 + the signal within a few seconds and nothing of
    the job is left 10 s after the signal, also when the ranks ignore SIGTERM (SIGKILL after
    the grace).  A signal the launcher was started with ignored (Ctrl-C in the background of a
    script) changes nothing."""
    import signal as signals
    import uuid
    cases = {}
    for name, sig, extra, ignored in (("term", signals.SIGTERM, (), None), ("hup", signals.SIGHUP, (), None),
                                      ("int", signals.SIGINT, (), None),
                                      ("term-ignored", signals.SIGTERM, ("ignore-term",), None),
                                      ("int-ignored-by-caller", signals.SIGTERM, (), signals.SIGINT)):
        tag = f"psrt-sig-{uuid.uuid4().hex[:10]}"
        # fresh interpreters (not the suite's warm python): the signal goes to mpi_launch
        # itself, and what is left is found by the tag on the ranks' command lines
        argv = [PYTHON, str(ROOT / "mpi_launch"), "-np", "2", PYTHON,
                str(ROOT / "tests" / "mpi" / "ranks" / "busy_job.py"), tag, *extra]
        cases[name] = (argv, sig, tag, ignored)
    for name, (code, ran_on, took, left) in signal_jobs(cases).items():
        assert ran_on, f"{name}: the launcher ended on a signal it was started with ignored"
        assert code == 128 + cases[name][1], (name, code)
        assert took < 8, (name, took)
        assert left == [], (name, left)
