"""How a flat buffer is cut into per-rank chunks, how consecutive tensors are grouped into
buckets, and the one check that a `comm` argument is an mpi4py communicator (psrt's naming
rule: see psrt/grid.py)."""
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


def group_by_size(sizes: list[int], nbytes: float, kinds: list | None = None) -> list[list[int]]:
    """Indices of consecutive items of `sizes` bytes grouped into buckets of at least `nbytes`
    (the last may be smaller); where `kinds` differ from the bucket's first (a dtype, a device)
    a new bucket starts.  The one bucketing rule: the gradient reducers' buckets
    (psrt.dp.common.group_by_bytes) and the step model's (psrt.bench.step_model)."""
    buckets, cur, size = [], [], 0
    for i, n in enumerate(sizes):
        if cur and (size >= nbytes or (kinds is not None and kinds[i] != kinds[cur[0]])):
            buckets.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += n
    if cur:
        buckets.append(cur)
    return buckets
