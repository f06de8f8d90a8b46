"""Every PSRT_* environment variable, in one place: its meaning, default and check.

Library code reads a setting through the accessor below (`timeout_s()`, `check_mode()`, ...),
never through os.environ, so a bad value is refused with the same one-line message wherever
it is first used; `check_all()` (called by psrt.init) refuses it at start-up instead.  The
documentation's table of variables (docs/reference/env.md) is `markdown_table()` (a test keeps
the two equal).

Only this module and the launcher (which forwards PSRT_* to every rank as they are) look at
these names.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from psrt.errors import PsrtError

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_RING_SEGMENT = 1 << 22     # 4 MiB; why: psrt/collectives/ring.py
CHECK_MODES = ("all", "cheap", "off")
STAGED_REDUCE = ("host", "gpu")
# The algorithms a torch.distributed group on psrt may use (psrt.collectives.algorithms names
# them all; 'torch' and 'nccl' are left out, as they would call torch.distributed themselves).
BACKEND_ALGORITHMS = ("auto", "ring", "doubling", "halving-doubling", "tree", "ps", "hierarchical", "native")


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise ValueError
    return value


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError
    return int(text)


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def _count_float(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise ValueError(text)
    return value


def _one_of(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError
        return text
    return parse


def _host_ids(text: str) -> tuple[int, ...]:
    parts = text.split(",")
    if not all(p.strip().isdigit() for p in parts):
        raise ValueError
    return tuple(int(p) for p in parts)


def _ranks_step(text: str) -> tuple[tuple[int, ...], int]:
    ranks, colon, step = text.partition(":")
    if not colon or not step.strip().isdigit() or int(step) < 1:
        raise ValueError
    return _host_ids(ranks), int(step)


# The moments of psrt.train at which PSRT_FAULT can strike (psrt.faults.strike_if_asked).
FAULT_MOMENTS = ("step", "checkpoint", "evaluation", "gather", "recovery")
FAULT_ACTIONS = ("kill", "stop")


def _faults(text: str) -> tuple[tuple, ...]:
    """`ACTION:RANKS:MOMENT:STEP[:SECONDS][@START]`, several joined by `;`, as tuples
    (action, ranks, moment, step, seconds, start)."""
    found = []
    for part in text.split(";"):
        part, at, start = part.strip().partition("@")
        fields = part.split(":")
        if len(fields) not in (4, 5) or fields[0] not in FAULT_ACTIONS or fields[2] not in FAULT_MOMENTS:
            raise ValueError
        if not fields[3].isdigit() or (at and not start.isdigit()):
            raise ValueError
        seconds = _positive_float(fields[4]) if len(fields) == 5 else 0.0
        found.append((fields[0], _host_ids(fields[1]), fields[2], int(fields[3]), seconds,
                      int(start) if at else 0))
    return tuple(found)


def _flag(text: str) -> bool:
    return _one_of("0", "1")(text) == "1"


@dataclass(frozen=True)
class Variable:
    name: str
    parse: Callable[[str], object]
    expected: str          # what a valid value looks like, for the error message
    default: object
    meaning: str


VARIABLES = {v.name: v for v in (
    Variable("PSRT_TIMEOUT", _positive_float, "a positive number of seconds", DEFAULT_TIMEOUT_S,
             "seconds a collective, a pipeline receive or a parameter-server wait may block before "
             "it is an error naming the ranks; the watchdog ends a stuck job after as long "
             "(default 300; `psrt.train --timeout`; a torch.distributed group made with `timeout=` "
             "waits that long instead)"),
    Variable("PSRT_CHECK", _one_of(*CHECK_MODES), "all, cheap or off", "cheap",
             "how collective calls are checked across ranks before they move data: `cheap` (every "
             "call agrees on a fingerprint of its arguments, default), `all` (every call gathers "
             "every rank's arguments: debugging), `off`"),
    Variable("PSRT_CUDA_AWARE", _flag, "0 or 1", None,
             "`1`/`0`: hand CUDA tensors to MPI directly or stage them (default: ask the MPI library)"),
    Variable("PSRT_STAGED_REDUCE", _one_of(*STAGED_REDUCE), "host or gpu", "host",
             "where a staged CUDA all-reduce adds (an MPI that is not CUDA-aware): `host`, each piece "
             "reduced between the ranks by the call's algorithm on the host; `gpu`, each piece "
             "all-gathered on the host and summed on the GPU"),
    Variable("PSRT_TUNING", str, "a file name", None,
             "a table for `algorithm=\"auto\"` written by `python -m psrt.bench tune`"),
    Variable("PSRT_RING_SEGMENT", _positive_int, "a positive number of bytes", DEFAULT_RING_SEGMENT,
             "ring segment size in bytes (default 4 MiB)"),
    Variable("PSRT_MASTER_ADDR", str, "an address", None,
             "rank 0's address for torch.distributed when its host name does not resolve to it"),
    Variable("PSRT_YIELD", _flag, "0 or 1", None,
             "`1`/`0`: ranks waiting in MPI yield the core (Open MPI's `mpi_yield_when_idle`) or "
             "busy-poll, whatever the launcher passed (default: an `OMPI_MCA_mpi_yield_when_idle` "
             "or `--mca mpi_yield_when_idle` of yours is kept, else ranks yield when a host runs "
             "more ranks than it has cores or is an emulated host)"),
    Variable("PSRT_ALGORITHM", _one_of(*BACKEND_ALGORITHMS), ", ".join(BACKEND_ALGORITHMS), "auto",
             "the algorithm of the `psrt` torch.distributed backend's collectives: `auto` "
             "(default), `ring`, `ps`, `halving-doubling`, `tree`, `doubling`, `hierarchical` (inside each "
             "host, then between hosts) or `native` (the MPI "
             "library's); a group's `pg_options` win"),
    Variable("PSRT_HOSTS", _host_ids, "host numbers, one per rank, e.g. 0,0,0,1,1,2", None,
             "fake a placement on one machine: rank i (as the launcher numbers it) counts as "
             "running on host number i of this list, within its real host, for the `hierarchical` "
             "algorithm, `auto` and `world.local_comm` (tests of uneven placements)"),
    Variable("PSRT_TRACEBACK", _flag, "0 or 1", False,
             "`1`: print the full traceback before the one-line error"),
    Variable("PSRT_MPI_LOG", str, "a file name", None,
             "set by `mpi_launch` (under Open MPI, and under srun with `--restarts`) for its ranks: the "
             "file, in the job's directory of `PSRT_LOG_DIR`, keeping the MPI library's abort notices "
             "it leaves out of stderr, named in the one-line error of a rank's uncaught exception"),
    Variable("PSRT_LOG_DIR", str, "a directory", None,
             "where `mpi_launch` keeps each job's log files, one directory per job "
             "(`YYYYmmdd-HHMMSS-PID-XXXX`, a file per start: `mpi.log`, `mpi-restart1.log`, ...): "
             "removed when the job ends with exit 0, kept and printed in one line when it fails "
             "(default `psrt-logs-UID` in the temporary directory, `$TMPDIR` or `/tmp`)"),
    Variable("PSRT_RESTARTS", _count, "0 or more", 0,
             "set by `mpi_launch --restarts N` for its ranks: N, the restarts allowed (`psrt.train` "
             "then writes a checkpoint every few steps unless told `--checkpoint-every`)"),
    Variable("PSRT_RESTART_COUNT", _count, "0 or more", 0,
             "set by `mpi_launch --restarts` for its ranks: which restart this is (0: the first "
             "start; like torchrun's `TORCHELASTIC_RESTART_COUNT`); from 1 on `psrt.train` "
             "continues from its `--checkpoint`"),
    Variable("PSRT_FAILED_AT", float, "seconds since the epoch", None,
             "set by `mpi_launch --restarts` on a restart: when the failure was seen, for the "
             "time a recovery took"),
    Variable("PSRT_GROW_BACK_S", _count_float, "0 or more seconds", 10.0,
             "`mpi_launch --restarts`: while a job runs on fewer hosts than it was given, how often the "
             "launcher asks the lost ones whether they answer again (a grow-back: the job stops at its next "
             "checkpoint and starts again on every host); 0: never"),
    Variable("PSRT_GROW_FILE", str, "a file name", None,
             "set by `mpi_launch --restarts` for its ranks while the job runs on fewer hosts than it was "
             "given: the file the launcher creates when a lost host answers again; `psrt.train`'s rank 0 "
             "looks for it at each checkpoint and the job then stops there with exit 5"),
    Variable("PSRT_IN_JOB_RECOVERY", _flag, "0 or 1", False,
             "set by `mpi_launch --in-job-recovery` for its ranks: `psrt.train` survives a lost rank "
             "inside the job (MPI's ULFM: the survivors shrink their communicators and go on from "
             "the last step they all finished; see docs/how-to/reliability.md)"),
    Variable("PSRT_KILL_AT", _ranks_step, "RANK[,RANK...]:STEP, e.g. 2:31", None,
             "fault injection: each rank the launcher numbered RANK ends itself with SIGKILL before "
             "`psrt.train`'s step STEP (1-based), as a crash would, in the first start only (not again in a "
             "restart of `mpi_launch --restarts`; tests, `psrt.bench recovery`)"),
    Variable("PSRT_FAULT", _faults, "ACTION:RANKS:MOMENT:STEP[:SECONDS][@START] (ACTION kill or stop, "
             f"MOMENT one of {', '.join(FAULT_MOMENTS)}), several joined by ';', e.g. kill:1:checkpoint:6", (),
             "fault injection at a moment of `psrt.train` (`psrt.bench chaos`): each rank the launcher "
             "numbered in RANKS is SIGKILLed (kill) or stopped for SECONDS and then resumed (stop) before "
             "step STEP, half-way through the write of the checkpoint of step STEP, in the final "
             "evaluation, before the final gather, or while a restart loads its checkpoint (recovery); "
             "only in start START of `mpi_launch --restarts` (default 0, the first)"),
)}


def get(name: str, environ=os.environ):
    """The parsed value of `name`, or its default when unset; a bad value is a PsrtError."""
    var = VARIABLES[name]
    text = environ.get(name)
    if text is None:
        return var.default
    try:
        return var.parse(text)
    except ValueError:
        raise PsrtError(f"{name}={text!r}: expected {var.expected}", everywhere=True) from None


def check_all(environ=os.environ) -> None:
    """Refuse every malformed PSRT_* setting now, not when it is first used."""
    for name in VARIABLES:
        get(name, environ)


def yield_when_idle(crowded: bool, environ=os.environ, extra=()) -> str | None:
    """The mpi_yield_when_idle ("0" or "1") Open MPI's ranks get, or None to leave them what
    they have.  PSRT_YIELD decides when set; else an OMPI_MCA_mpi_yield_when_idle in `environ`
    or a `--mca mpi_yield_when_idle` among `extra` (mpirun flags) is the user's and is kept;
    else ranks on a crowded host (more ranks than cores) yield.  The launchers (psrt.launch)
    and every rank before MPI starts (psrt.world) apply this one rule."""
    forced = get("PSRT_YIELD", environ)
    if forced is not None:
        return "1" if forced else "0"
    if "OMPI_MCA_mpi_yield_when_idle" in environ or "mpi_yield_when_idle" in extra:
        return None
    return "1" if crowded else None


def timeout_s() -> float:
    return get("PSRT_TIMEOUT")


def check_mode() -> str:
    return get("PSRT_CHECK")


def cuda_aware() -> bool | None:
    """True or False when PSRT_CUDA_AWARE says so, None to ask the MPI library."""
    return get("PSRT_CUDA_AWARE")


def staged_reduce() -> str:
    return get("PSRT_STAGED_REDUCE")


def tuning_path() -> str | None:
    return get("PSRT_TUNING")


def ring_segment_bytes() -> int:
    return get("PSRT_RING_SEGMENT")


def algorithm() -> str:
    return get("PSRT_ALGORITHM")


def master_addr() -> str | None:
    return get("PSRT_MASTER_ADDR")


def fake_hosts() -> tuple[int, ...] | None:
    return get("PSRT_HOSTS")


def traceback() -> bool:
    return get("PSRT_TRACEBACK")


def mpi_log() -> str | None:
    return get("PSRT_MPI_LOG")


def log_dir(environ=os.environ) -> str | None:
    """PSRT_LOG_DIR (None: the launcher's default, psrt.launch.logs.root)."""
    return get("PSRT_LOG_DIR", environ)


def restarts() -> tuple[int, int, float | None]:
    """(restarts allowed, this restart's number, when the failure was seen) from mpi_launch."""
    return get("PSRT_RESTARTS"), get("PSRT_RESTART_COUNT"), get("PSRT_FAILED_AT")


def grow_back_s(environ=os.environ) -> float:
    """Seconds between the launcher's asks of the hosts a job lost (0: no grow-back)."""
    return get("PSRT_GROW_BACK_S", environ)


def grow_file() -> str | None:
    """The file whose existence asks this job to stop at its next checkpoint (a grow-back)."""
    return get("PSRT_GROW_FILE")


def in_job_recovery() -> bool:
    """Whether mpi_launch --in-job-recovery started this job (psrt.train.in_job)."""
    return get("PSRT_IN_JOB_RECOVERY")


def kill_at() -> tuple[tuple[int, ...], int] | None:
    """(launcher ranks, step) of PSRT_KILL_AT (psrt.faults.kill_if_asked), or None."""
    return get("PSRT_KILL_AT")


def faults() -> tuple[tuple, ...]:
    """The faults PSRT_FAULT asks for (psrt.faults.strike_if_asked), () when unset."""
    return get("PSRT_FAULT")


def markdown_table() -> str:
    """The table of variables of docs/reference/env.md (scripts/gen_reference.py writes it)."""
    rows = [f"| `{v.name}` | {v.meaning} |" for v in VARIABLES.values()]
    return "\n".join(["| variable | meaning |", "|---|---|"] + rows) + "\n"
