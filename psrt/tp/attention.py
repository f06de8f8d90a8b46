"""Multi-head self-attention with the heads split over the TP ranks.

Shoeybi et al. 2019, sec. 3, fig. 3b: the Q, K and V projections are column-parallel, so
rank i computes heads [i*h/t, (i+1)*h/t) entirely locally; the output projection is
row-parallel and its all-reduce (g) is the block's only forward communication; f before
the QKV projection is the only backward one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from psrt.errors import PsrtError
from psrt.tp.layers import ColumnParallelLinear, RowParallelLinear


def head_rows(dim: int, heads: int, tp_size: int, tp_rank: int) -> torch.Tensor:
    """Rows of a fused [q; k; v] weight (3*dim x dim) that belong to this rank's heads:
    the same head slice of q, of k and of v, so the local output splits into q, k, v."""
    if heads % tp_size:
        raise PsrtError(f"tensor parallelism over {tp_size} ranks needs the number of attention "
                        f"heads ({heads}) to divide by {tp_size}")
    width = dim // tp_size
    part = torch.arange(tp_rank * width, (tp_rank + 1) * width)
    return torch.cat([part, part + dim, part + 2 * dim])


class ParallelAttention(nn.Module):
    """Causal self-attention, heads/t heads per rank; input and output whole (b, s, dim)."""

    def __init__(self, dim: int, heads: int, group, qkv: ColumnParallelLinear | None = None,
                 proj: RowParallelLinear | None = None, sequence_parallel: bool = False):
        super().__init__()
        if dim % heads or heads % group.size:
            raise PsrtError(f"attention: dim {dim} must divide by heads {heads}, and heads by "
                            f"the tensor-parallel size {group.size}")
        self.dim, self.heads, self.group = dim, heads, group
        self.local_heads = heads // group.size
        self.qkv = qkv or ColumnParallelLinear(dim, 3 * dim, group, sequence_parallel=sequence_parallel)
        self.proj = proj or RowParallelLinear(dim, dim, group, sequence_parallel=sequence_parallel)

    @classmethod
    def from_dense(cls, qkv: nn.Linear, proj: nn.Linear, heads: int, group,
                   sequence_parallel: bool = False) -> "ParallelAttention":
        """From a dense fused QKV projection (rows q; k; v) and output projection."""
        dim = proj.out_features
        rows = head_rows(dim, heads, group.size, group.rank)
        sp = sequence_parallel
        return cls(dim, heads, group, ColumnParallelLinear.from_dense(qkv, group, rows=rows, sequence_parallel=sp),
                   RowParallelLinear.from_dense(proj, group, cols=rows[:dim // group.size], sequence_parallel=sp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = self.dim // self.group.size
        y = self.qkv(x)                  # with sequence parallelism: the whole sequence now
        b, s, _ = y.shape
        q, k, v = y.split(width, dim=2)
        hd = self.dim // self.heads
        q, k, v = (z.view(b, s, self.local_heads, hd).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(att.transpose(1, 2).reshape(b, s, width))
