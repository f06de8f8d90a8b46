"""How a flat buffer is cut into per-rank chunks, and the one check that a `comm` argument
is an mpi4py communicator (psrt's naming rule: see psrt/grid.py)."""
from __future__ import annotations

from psrt.errors import PsrtError


def require_mpi_comm(comm, where: str):
    """`comm` itself if it is an mpi4py communicator, else a one-line PsrtError."""
    if not hasattr(comm, "Get_rank"):
        hint = " (pass world.comm)" if hasattr(comm, "comm") else ""
        raise PsrtError(f"{where}: comm must be an mpi4py communicator, got {type(comm).__name__}{hint}")
    return comm


def even_counts(total: int, parts: int) -> list[int]:
    """Split `total` items into `parts` counts that differ by at most one, larger ones first
    (numpy.array_split's rule), so every size works: 0, fewer items than parts, not divisible."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def shard_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` of `even_counts(total, parts)`, without the list."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def offsets(counts: list[int]) -> list[int]:
    """Start of each chunk, plus the end: len(counts) + 1 entries."""
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out
