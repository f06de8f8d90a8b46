"""Errors that speak to the user, and the guard that turns them into one line and exit 2."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys


class PsrtError(Exception):
    """Bad input or a broken contract: the message names what and where.

    `everywhere=True` marks an error every rank hits identically (a bad flag); only rank 0
    prints it, so a job of 8 ranks does not print the same line 8 times.
    """

    exit_code = 2

    def __init__(self, message: str, everywhere: bool = False):
        super().__init__(message)
        self.everywhere = everywhere


class CollectiveMismatch(PsrtError):
    """Ranks called a collective with arguments that do not agree."""


class PeerTimeout(PsrtError):
    """A wait for another rank ran out of time (PSRT_TIMEOUT): that rank is dead, stuck or
    out of reach.  Exit 3, as the watchdog's abort, not 2: the same command may well work
    again, so `mpi_launch --restarts` starts it again (psrt/launch/restart.py)."""

    exit_code = 3


class StorageError(PsrtError):
    """A file psrt must write could not be written (a full disk, a file system gone read-only).
    Exit 4, so that `mpi_launch --restarts` can say why it does not start the job again: the
    same write would fail the same way until someone makes room (psrt/launch/restart.py)."""

    exit_code = 4


# The exit code of a job that stopped at a checkpoint because its launcher asked it to widen
# again to a host it had lost (a grow-back, psrt/launch/growback.py): not a failure.
GROW_BACK_EXIT = 5

# What the survivors of an in-job recovery print once all of them have finished: the launcher
# ends the job on it (Open MPI 5's runtime would wait for a lost host's daemon for ever).
IN_JOB_DONE = "psrt.train: in-job recovery: every surviving rank has finished"


def make_options(cls, given: dict, where: str):
    """`cls(**given)` for an options dataclass, refusing a key that is not one of its fields
    in one line naming what it accepts: a misspelt `bucket_m=` must not run with the default
    and say nothing.  `where` names the receiver (e.g. "--dp ring")."""
    accepted = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(given) - set(accepted))
    if unknown:
        what = f"it accepts {', '.join(accepted)}" if accepted else "it takes no options"
        raise PsrtError(f"{where}: unknown option{'s' * (len(unknown) > 1)} {', '.join(unknown)} "
                        f"({what})", everywhere=True)
    return cls(**given)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are a PsrtError (one line, exit 2 through cli_main) instead of
    usage lines; sub-command parsers made from it behave the same."""

    def error(self, message: str):
        raise PsrtError(f"{self.prog}: {message} (see --help)", everywhere=True)

    def add_subparsers(self, **kwargs):
        kwargs.setdefault("parser_class", ArgumentParser)
        return super().add_subparsers(**kwargs)


def launcher_rank() -> int | None:
    """This process's rank as its launcher numbered it (before or without MPI)."""
    for key in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "HOROVOD_RANK", "SLURM_PROCID", "RANK"):
        if key in os.environ:
            try:
                return int(os.environ[key])
            except ValueError:
                pass
    return None


def report(err: BaseException, prog: str = "psrt", note: str = "") -> None:
    """Print `err` as one line on stderr with the rank in front (if there is one) and `note`
    after it (where MPI's notice of the abort that follows is kept: psrt.faults)."""
    rank = launcher_rank()
    if getattr(err, "everywhere", False) and rank not in (None, 0):
        return
    where = f"[rank {rank}] " if rank is not None else ""
    msg = " ".join(str(err).split()) or type(err).__name__
    write_line(f"{where}{prog}: error: {msg}{note}")


def write_line(line: str) -> None:
    """Write `line` to stderr in one write(2): mpirun forwards each rank's output as it reads
    it, and a line written in pieces (print() under PYTHONUNBUFFERED) can be cut by another
    rank's line.  A pipe takes up to PIPE_BUF (4096) bytes at once (POSIX write())."""
    data = (line + "\n").encode(errors="replace")
    try:
        sys.stderr.flush()
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):   # replaced by an object without a file
        print(line, file=sys.stderr, flush=True)
        return
    while data:
        data = data[os.write(fd, data):]


def multi_rank() -> bool:
    """Whether MPI runs here with more than one rank (so abort() ends a job)."""
    mpi = sys.modules.get("mpi4py.MPI")
    return (mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized()
            and mpi.COMM_WORLD.Get_size() > 1)


def cli_main(prog: str):
    """Decorator for entry points: PsrtError -> one line on stderr and exit 2, no traceback."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except PsrtError as err:
                report(err, prog)
                if not err.everywhere:
                    abort(err.exit_code)   # the others may wait for this rank in a collective
                sys.exit(err.exit_code)
            except KeyboardInterrupt:
                print(f"{prog}: interrupted", file=sys.stderr)
                sys.exit(130)
        return run
    return wrap


def abort(code: int) -> None:
    """End every rank of the job with `code` when MPI runs with more than one rank (MPI 4.1
    sec. 9.5, MPI_ABORT): the others may be waiting in a collective for this one, and would
    hang.  Returns (does nothing) when there is no such job; the caller then exits itself.
    The one abort path of psrt: errors, the exception hook and the watchdog all end here."""
    if multi_rank():
        sys.stdout.flush()
        sys.stderr.flush()
        sys.modules["mpi4py.MPI"].COMM_WORLD.Abort(code)
