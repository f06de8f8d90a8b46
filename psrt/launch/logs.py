"""Where a launcher keeps what it leaves out of the terminal: one directory per job.

Under Open MPI, `mpi_launch` (and `mpi_launch --emulate`, and srun under `--restarts`) shows a
failure as the one line its rank printed and keeps the library's notices (a rank's non-zero
exit, MPI_Abort, its daemons' error lines: psrt/launch/mpi.py) in a file, which the ranks are
told of (PSRT_MPI_LOG) and name in their error line.  Every such file of one job is in one
directory,

    PSRT_LOG_DIR/YYYYmmdd-HHMMSS-PID-XXXX/mpi.log            the first start
                                         mpi-restart1.log   restart 1 of --restarts, ...

with PSRT_LOG_DIR by default `psrt-logs-UID` in the temporary directory (TMPDIR, else /tmp),
made for this user alone.  A job that ends cleanly (exit 0, after its restarts) leaves
nothing there: its directory is removed.  A job that fails keeps the files that hold
something (a directory with nothing kept is removed all the same), and its path is printed
in one line: by the rank whose one-line error ended the job (psrt.faults names its file), or,
where no rank printed one (a rank killed by a signal, a lost host, a failure of MPI's own),
by the launcher.  So a failure a rank explained stays that one line.
"""
from __future__ import annotations

import os
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Callable

from psrt import env as psrt_env
from psrt.errors import PsrtError


def root(environ=os.environ) -> Path:
    """PSRT_LOG_DIR, else psrt-logs-UID in the temporary directory."""
    return Path(psrt_env.log_dir(environ) or os.path.join(tempfile.gettempdir(), f"psrt-logs-{os.getuid()}"))


def _own_folder(path: Path) -> None:
    """Make `path` (mode 0700 when made here) and refuse one that is not this user's own
    directory: a shared /tmp lets anyone create the name first."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(path)
    except OSError as err:
        raise PsrtError(f"log directory {path}: {err.strerror or err} (set PSRT_LOG_DIR elsewhere)") from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise PsrtError(f"log directory {path}: not a directory of this user's "
                        "(set PSRT_LOG_DIR to one of yours)")


class JobLogs:
    """The log files of one job, in its own directory, made when the first file is asked for."""

    def __init__(self, environ=os.environ):
        self.root = root(environ)
        self.dir: Path | None = None
        self.files: list[Path] = []
        self.said_by_rank = False     # the last start's failure was a rank's one-line error

    def new_file(self) -> str:
        """An empty file for the next start of the job: mpi.log, then mpi-restart1.log, ..."""
        if self.dir is None:
            _own_folder(self.root)
            stamp = time.strftime("%Y%m%d-%H%M%S")
            self.dir = Path(tempfile.mkdtemp(prefix=f"{stamp}-{os.getpid()}-", dir=self.root))
        name = "mpi.log" if not self.files else f"mpi-restart{len(self.files)}.log"
        path = self.dir / name
        path.touch(mode=0o600)
        self.files.append(path)
        self.said_by_rank = False
        return str(path)

    def finish(self, code: int) -> str | None:
        """After the job ended with `code`: the directory when it is kept (a failure that kept
        something), else None, the directory removed.  Empty files go either way."""
        if self.dir is None:
            return None
        for path in self.files:
            try:
                if path.stat().st_size == 0:
                    path.unlink()
            except OSError:
                pass
        kept = code != 0 and any(self.dir.iterdir())
        if not kept:
            shutil.rmtree(self.dir, ignore_errors=True)
            return None
        return str(self.dir)


def kept_line(folder: str | None) -> str | None:
    """The one line a launcher prints about a failed job's logs (None: nothing kept)."""
    return None if folder is None else f"the MPI library's notices left out above are kept in {folder}"


def keeping_logs(run: Callable[[JobLogs], int], say: Callable[[str], None], environ=os.environ) -> int:
    """`run(logs)` a job (every start of it) with its log directory, and return its exit code;
    afterwards the directory is removed, or kept when the job failed (an exception, Ctrl-C
    included, counts as a failure) and said in one line unless a rank's error line said it."""
    logs = JobLogs(environ)
    code = 1
    try:
        code = run(logs)
        return code
    finally:
        line = kept_line(logs.finish(code))
        if line and not logs.said_by_rank:
            say(line)
