"""Argument checks shared by the collectives: one-line errors naming the call and what is
wrong, raised before anything moves."""
from __future__ import annotations

import torch

from psrt.collectives.layout import even_counts
from psrt.errors import PsrtError


def check_out(out: torch.Tensor | None, shape, dtype, what: str) -> None:
    if out is not None and (tuple(out.shape) != tuple(shape) or out.dtype != dtype):
        raise PsrtError(f"{what}: out has shape {tuple(out.shape)} and dtype {out.dtype}, "
                        f"expected {tuple(shape)} and {dtype}")


def row_counts(t: torch.Tensor, counts, size: int, what: str) -> list[int]:
    """Rows of dim 0 per rank: `counts` checked against t, or an even split over `size`."""
    total = t.shape[0] if t.dim() else 1
    counts = list(counts) if counts is not None else even_counts(total, size)
    if len(counts) != size or sum(counts) != total or min(counts) < 0:
        raise PsrtError(f"{what}: counts {counts} must be {size} non-negative numbers "
                        f"adding up to dim 0 of the input ({total})")
    return counts


def check_root(root: int, size: int, what: str) -> None:
    if not 0 <= root < size:
        raise PsrtError(f"{what}: root {root} is not a rank of this communicator (0..{size - 1})")
