"""Fail fast: an uncaught exception on one rank ends the whole job, with one line naming it.

Without this, a rank whose Python code raises prints a traceback and then, on its way out,
calls MPI_Finalize, which waits for the other ranks; they in turn wait in a collective for
the dead rank, so the job hangs until someone kills it.  `install()` replaces
`sys.excepthook` on this process: the exception becomes one line on stderr,

    [rank 3] psrt: error: RuntimeError: loss is nan (train.py:88)

and, when MPI runs with more than one rank, MPI_Abort ends every rank (MPI 4.1 sec. 9.5).
A PsrtError is printed the same way as psrt.errors.cli_main prints it.  PSRT_TRACEBACK=1 also
prints the full traceback (for debugging) before aborting.
"""
from __future__ import annotations

import os
import sys
import time
import traceback

from psrt import env
from psrt.errors import abort, launcher_rank, report


def describe(err: BaseException) -> str:
    """`Type: message (file:line)` of where `err` was raised, on one line."""
    from psrt.errors import PsrtError
    if isinstance(err, PsrtError):
        return str(err)
    where = ""
    tb = traceback.extract_tb(err.__traceback__) if err.__traceback__ else []
    if tb:
        frame = tb[-1]
        where = f" ({os.path.basename(frame.filename)}:{frame.lineno})"
    return f"{type(err).__name__}: {err}{where}"


def excepthook(kind, err, tb, prog: str = "psrt") -> None:
    if issubclass(kind, KeyboardInterrupt):
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        abort(130)
        return
    # torch.distributed wraps the hook it finds and captures stderr around it, printing what it
    # caught afterwards; the abort below ends the process first, so write to the real stderr.
    if sys.__stderr__ is not None:
        sys.stderr = sys.__stderr__
    if env.traceback():
        traceback.print_exception(kind, err, tb)
    if err.__traceback__ is None:
        err = err.with_traceback(tb)

    everywhere = getattr(err, "everywhere", False)

    class _Line(Exception):
        pass
    _Line.everywhere = everywhere
    report(_Line(describe(err)), prog)
    code = getattr(err, "exit_code", 1)
    if everywhere and launcher_rank() not in (None, 0):
        # Every rank raised the same error and rank 0 says it for all: leave it time to, as
        # the abort below ends the whole job.
        time.sleep(2.0)
    abort(code)
    # One rank (or MPI not started): leave with the code now, without running MPI_Finalize.
    os._exit(code)


def install(prog: str = "psrt") -> None:
    """Install the hook on this process (calling it again only renames the program).
    psrt.init installs it; an entry point may call it again with its own name."""
    sys.excepthook = lambda kind, err, tb: excepthook(kind, err, tb, prog)


def uninstall() -> None:
    """Back to Python's own hook."""
    sys.excepthook = sys.__excepthook__
