"""Errors that speak to the user, and the guard that turns them into one line and exit 2."""
from __future__ import annotations

import argparse
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


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are a PsrtError (one line, exit 2 through cli_main) instead of
    usage lines; sub-command parsers made from it behave the same."""

    def error(self, message: str):
        raise PsrtError(f"{self.prog}: {message} (see --help)", everywhere=True)

    def add_subparsers(self, **kwargs):
        kwargs.setdefault("parser_class", ArgumentParser)
        return super().add_subparsers(**kwargs)


def _rank_from_env() -> int | None:
    for key in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "HOROVOD_RANK", "SLURM_PROCID", "RANK"):
        if key in os.environ:
            try:
                return int(os.environ[key])
            except ValueError:
                pass
    return None


def report(err: BaseException, prog: str = "psrt") -> None:
    """Print `err` as one line on stderr with the rank in front (if there is one)."""
    rank = _rank_from_env()
    if getattr(err, "everywhere", False) and rank not in (None, 0):
        return
    where = f"[rank {rank}] " if rank is not None else ""
    msg = " ".join(str(err).split()) or type(err).__name__
    print(f"{where}{prog}: error: {msg}", file=sys.stderr, flush=True)


def cli_main(prog: str):
    """Decorator for entry points: PsrtError -> one line on stderr and exit 2, no traceback."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except PsrtError as err:
                report(err, prog)
                _exit(err.exit_code, err.everywhere)
            except KeyboardInterrupt:
                print(f"{prog}: interrupted", file=sys.stderr)
                sys.exit(130)
        return run
    return wrap


def _exit(code: int, everywhere: bool) -> None:
    """Leave with `code`.  An error on one rank of a running job aborts the whole job, since
    the other ranks may be waiting in a collective for it (MPI 4.1 sec. 9.5, MPI_ABORT)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and not everywhere and mpi.Is_initialized() and not mpi.Is_finalized():
        if mpi.COMM_WORLD.Get_size() > 1:
            sys.stderr.flush()
            mpi.COMM_WORLD.Abort(code)
    sys.exit(code)
