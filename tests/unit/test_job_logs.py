"""Where the launchers keep what they leave out of stderr (psrt/launch/logs.py): one directory
per job under PSRT_LOG_DIR, a file per start, nothing left by a job that ended cleanly, the
directory kept and named in one line when the job failed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from conftest import ROOT

from psrt.errors import PsrtError
from psrt.launch import logs as L
from psrt.launch import mpi

RULE = "-" * 74
ABORT = f"{RULE}\nMPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD\nwith errorcode 1.\n{RULE}\n"


def _job(tmp_path, code: int, stderr: str) -> list[str]:
    """A stand-in for mpirun: writes `stderr`, records the PSRT_MPI_LOG it was given, exits `code`."""
    return [sys.executable, "-c",
            f"import os, sys; open({str(tmp_path / 'told')!r}, 'a').write(os.environ['PSRT_MPI_LOG'] + '\\n'); "
            f"sys.stderr.write({stderr!r}); sys.exit({code})"]


def test_one_directory_per_job_a_file_per_start_and_what_is_kept(tmp_path):
    env = {"PSRT_LOG_DIR": str(tmp_path / "logs")}
    job = L.JobLogs(env)
    first, again = Path(job.new_file()), Path(job.new_file())
    assert first.parent == again.parent and first.parent.parent == tmp_path / "logs"
    assert (first.name, again.name) == ("mpi.log", "mpi-restart1.log")
    assert oct((tmp_path / "logs").stat().st_mode & 0o777) == "0o700"
    first.write_text("MPI_ABORT was invoked on rank 1\n")
    assert job.finish(0) is None and not first.parent.exists()          # ended cleanly: nothing left
    job = L.JobLogs(env)
    kept = Path(job.new_file())
    kept.write_text("MPI_ABORT was invoked on rank 1\n")
    job.new_file()
    assert job.finish(1) == str(kept.parent) and [p.name for p in kept.parent.iterdir()] == ["mpi.log"]
    job = L.JobLogs(env)
    empty = Path(job.new_file())
    assert job.finish(137) is None and not empty.parent.exists()         # failed, nothing to keep
    assert L.JobLogs(env).finish(1) is None                               # never asked: nothing made
    assert [p.parent for p in (tmp_path / "logs").glob("*/*")] == [kept.parent]


def test_the_default_place_and_a_foreign_one(tmp_path, monkeypatch):
    monkeypatch.delenv("PSRT_LOG_DIR", raising=False)
    assert L.root() == Path(tempfile.gettempdir()) / f"psrt-logs-{os.getuid()}"
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(PsrtError, match=r"log directory .*link: not a directory of this user's \(set PSRT_LOG_DIR"):
        L.JobLogs({"PSRT_LOG_DIR": str(tmp_path / "link")}).new_file()


def test_keeping_logs_says_where_a_failed_job_left_them(tmp_path):
    env = {"PSRT_LOG_DIR": str(tmp_path)}
    said = []

    def fails(logs):
        Path(logs.new_file()).write_text("notice\n")
        return 3
    assert L.keeping_logs(fails, said.append, env) == 3
    (folder,) = [p for p in tmp_path.iterdir()]
    assert said == [f"the MPI library's notices left out above are kept in {folder}"]

    def interrupted(logs):
        Path(logs.new_file()).write_text("notice\n")
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        L.keeping_logs(interrupted, said.append, env)
    assert len(said) == 2 and len(list(tmp_path.iterdir())) == 2
    assert L.keeping_logs(lambda logs: Path(logs.new_file()).write_text("x") and 0, said.append, env) == 0
    assert len(said) == 2 and len(list(tmp_path.iterdir())) == 2


def test_run_job_keeps_the_notices_of_a_failed_job_only(tmp_path, capfd):
    """Under a launcher's quiet exit: Open MPI's notices go to the job's file; a job that ends
    cleanly leaves nothing (its help-message noise included), a failed one its directory, said
    in one line where no rank's error line said it."""
    env = {**os.environ, "PSRT_LOG_DIR": str(tmp_path / "logs")}
    noise = "[vm:01234] 1 more process has sent help message help-mpi-btl-base.txt\n"
    assert mpi.run_job(_job(tmp_path, 0, noise), env, quiet_exit=True) == 0
    assert not any((tmp_path / "logs").iterdir())
    assert mpi.run_job(_job(tmp_path, 1, ABORT), env, quiet_exit=True) == 1
    (folder,) = list((tmp_path / "logs").iterdir())
    told = (tmp_path / "told").read_text().split()
    assert Path(told[1]) == folder / "mpi.log" and "MPI_ABORT was invoked" in Path(told[1]).read_text()
    err = capfd.readouterr().err
    assert "MPI_ABORT" not in err
    assert err == f"psrt: the MPI library's notices left out above are kept in {folder}\n"
    # a rank's one-line error (which names the file itself) stays the failure's one line
    said = "[rank 1] psrt: error: RuntimeError: boom (x.py:3) (MPI's abort notice: FILE)\n"
    assert mpi.run_job(_job(tmp_path, 1, said + ABORT), env, quiet_exit=True) == 1
    assert capfd.readouterr().err == said and len(list((tmp_path / "logs").iterdir())) == 2


def test_a_signal_stops_the_job_then_reaches_the_callers_own_handler(tmp_path):
    """SIGTERM during run_job goes to the launcher; once the job is over the caller's own
    handler runs (an emulated cluster's `running` raises SystemExit there and takes its hosts
    down), so a bench does not start its next job after being told to stop."""
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys, threading, time
        sys.path.insert(0, {str(ROOT)!r})
        from psrt.launch import mpi
        def stop(signum, frame):
            raise SystemExit(100 + signum)
        signal.signal(signal.SIGTERM, stop)
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        t0 = time.monotonic()
        try:
            mpi.run_job([sys.executable, "-c", "import time; time.sleep(30)"], dict(os.environ))
        finally:
            print(f"returned after {{time.monotonic() - t0:.1f}} s", flush=True)
        print("went on to the next job", flush=True)
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 100 + signal.SIGTERM, done.stdout + done.stderr
    assert "went on" not in done.stdout and float(done.stdout.split()[2]) < 20
