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
import signal
import subprocess
import sys
import time
import traceback

from psrt import env
from psrt.errors import abort, launcher_rank, multi_rank, report


def _libraries() -> dict[str, str]:
    """Folders of code that is not the user's (psrt, torch, the standard library, installed
    packages), each with the folder its files are named from in a message."""
    import sysconfig
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    packages = {os.path.dirname(os.path.abspath(__file__))}      # psrt
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "__file__", None):
        packages.add(os.path.dirname(torch.__file__))
    found = {os.path.realpath(d) + os.sep: os.path.realpath(d) for d in roots}
    # torch/nn/modules/linear.py rather than nn/modules/linear.py
    found.update({os.path.realpath(d) + os.sep: os.path.dirname(os.path.realpath(d)) for d in packages})
    return dict(sorted(found.items(), key=lambda item: -len(item[0])))   # innermost first


def location(tb) -> str:
    """` (file:line)` of the innermost frame of the user's own code in the extracted
    traceback `tb`, followed by the innermost frame when that is in a library
    (` (train.py:12, in torch/nn/modules/linear.py:134)`); '' without frames."""
    if not tb:
        return ""
    libraries = _libraries()

    def library(frame) -> str | None:
        path = os.path.realpath(frame.filename)
        return next((base for d, base in libraries.items() if path.startswith(d)), None)
    user = [f for f in tb if not f.filename.startswith("<") and library(f) is None]
    inner = tb[-1]
    if not user or user[-1] is inner:
        return f" ({os.path.basename(inner.filename)}:{inner.lineno})"
    base = library(inner)
    shown = os.path.relpath(os.path.realpath(inner.filename), base) if base else os.path.basename(inner.filename)
    return f" ({os.path.basename(user[-1].filename)}:{user[-1].lineno}, in {shown}:{inner.lineno})"


def describe(err: BaseException) -> str:
    """`Type: message (file:line)` of where `err` was raised in the user's code, on one line."""
    from psrt.errors import PsrtError
    if isinstance(err, PsrtError):
        return str(err)
    tb = traceback.extract_tb(err.__traceback__) if err.__traceback__ else []
    return f"{type(err).__name__}: {err}{location(tb)}"


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
    # Under psrt's launchers MPI's notice of the abort below is kept in a file, named here.
    log = env.mpi_log() if multi_rank() else None
    report(_Line(describe(err)), prog, f" (MPI's abort notice: {log})" if log else "")
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


def kill_if_asked(step: int) -> None:
    """SIGKILL this process before training step `step` when PSRT_KILL_AT names its launcher
    rank (among others) and that step: a crash at a known moment, for tests of recovery and its benchmark.
    The line it prints first gives the moment (seconds since the epoch).  Only the first start
    crashes: a restart (PSRT_RESTART_COUNT 1 or more) inherits the variable and resumes from a
    checkpoint taken before that step, and would otherwise crash again at the same step."""
    asked = env.kill_at()
    if asked is None or asked[1] != step or launcher_rank() not in asked[0] or env.restarts()[1]:
        return
    print(f"psrt: PSRT_KILL_AT: rank {launcher_rank()} killed before step {step} at {time.time():.3f}",
          file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


# Moments whose STEP field says which occurrence; at the others (evaluation, gather, recovery)
# a run passes through once per start and STEP is not compared.
_COUNTED = ("step", "checkpoint")


def strike_if_asked(moment: str, step: int = 0) -> None:
    """Apply the PSRT_FAULT faults that name this rank, this start of the job and `moment`
    (one of env.FAULT_MOMENTS; `step` the training step it belongs to): SIGKILL, or SIGSTOP
    with a SIGCONT `seconds` later from a process of its own (a stopped process cannot wake
    itself).  The line printed first gives the moment (seconds since the epoch), for
    `psrt.bench chaos` to time the recovery from."""
    asked = env.faults()
    if not asked:
        return
    rank, start = launcher_rank(), env.restarts()[1]
    for action, ranks, at, when, seconds, in_start in asked:
        if at != moment or rank not in ranks or in_start != start or (moment in _COUNTED and when != step):
            continue
        what = "killed" if action == "kill" else f"stopped for {seconds:g} s"
        print(f"psrt: PSRT_FAULT: rank {rank} {what} at {moment} {step} at {time.time():.3f}",
              file=sys.stderr, flush=True)
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            # Its own session: the job's end (which may kill this rank meanwhile) leaves it be,
            # and it ends by itself after `seconds`.
            subprocess.Popen(["/bin/sh", "-c", f"sleep {seconds:g}; kill -CONT {os.getpid()} 2>/dev/null"],
                             start_new_session=True, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            os.kill(os.getpid(), signal.SIGSTOP)
