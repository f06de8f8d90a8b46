"""How a flat buffer is cut into per-rank chunks."""
from __future__ import annotations


def even_counts(total: int, parts: int) -> list[int]:
    """Split `total` items into `parts` counts that differ by at most one, larger ones first
    (numpy.array_split's rule), so every size works: 0, fewer items than parts, not divisible."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def offsets(counts: list[int]) -> list[int]:
    """Start of each chunk, plus the end: len(counts) + 1 entries."""
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out
