"""Tensor-parallel layers: column- and row-parallel linear, vocabulary-parallel embedding.

Shoeybi et al. 2019, sec. 3: Y = XA with A split by columns, A = [A_1 .. A_t], gives each
rank Y_i = X A_i with no communication (column-parallel); Z = YB with B split by rows and Y
by columns gives partial sums Z = sum_i Y_i B_i, added by one all-reduce (row-parallel).  A
column-parallel layer followed by a row-parallel one therefore costs one all-reduce forward
(g after the row layer) and one backward (f before the column layer).

Every layer can be built from its dense counterpart (`from_dense`), taking this rank's
slice, so tests can compare it with the unpartitioned layer.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from psrt.collectives.layout import shard_range
from psrt.errors import PsrtError
from psrt.tp.comm import (copy_to_tp, gather_from_tp, gather_seq, reduce_from_tp, reduce_scatter_seq,
                          scatter_to_tp)


def _take(t: torch.Tensor, index: torch.Tensor | None, dim: int, group) -> torch.Tensor:
    """This rank's part of t along dim: the rows in `index`, else a contiguous shard."""
    if index is None:
        start, end = shard_range(t.shape[dim], group.size, group.rank)
        index = torch.arange(start, end)
    return t.detach().index_select(dim, index.to(t.device)).clone()


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A's output rows (and b) split over the TP ranks.

    Args:
        in_features, out_features: of the whole layer.
        group: psrt Communicator over the TP ranks.
        gather_output: all-gather the output slices (else each rank keeps its slice, the
            input a row-parallel layer expects).
        sequence_parallel: the input is this rank's slice of the sequence, all-gathered here
            (f-bar; psrt.tp.comm) instead of whole on every rank (f).
    """

    def __init__(self, in_features: int, out_features: int, group, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.gather_output = group, gather_output
        self.sequence_parallel = sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        start, end = shard_range(out_features, group.size, group.rank)
        self.weight = nn.Parameter(torch.empty(end - start, in_features))
        self.bias = nn.Parameter(torch.zeros(end - start)) if bias else None
        # nn.Linear's default initialisation, with the fan-in of the whole layer.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(in_features)
            nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_dense(cls, linear: nn.Linear, group, rows: torch.Tensor | None = None,
                   gather_output: bool = False, sequence_parallel: bool = False) -> "ColumnParallelLinear":
        """This rank's output rows of `linear` (`rows`: explicit indices, e.g. a head's q/k/v)."""
        with torch.random.fork_rng(devices=[]):   # the throw-away init leaves the RNG alone
            layer = cls(linear.in_features, linear.out_features, group, linear.bias is not None,
                        gather_output, sequence_parallel)
        with torch.no_grad():
            w = _take(linear.weight, rows, 0, group)
            if w.shape != layer.weight.shape:
                raise PsrtError(f"column-parallel shard of {tuple(linear.weight.shape)} has shape "
                                f"{tuple(w.shape)}, expected {tuple(layer.weight.shape)}")
            layer.weight.copy_(w)
            if layer.bias is not None:
                layer.bias.copy_(_take(linear.bias, rows, 0, group))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_seq(x, self.group)
        else:
            x = copy_to_tp(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A's input columns split over the TP ranks; one all-reduce (g).

    Args:
        input_is_parallel: x is already this rank's slice of the last dimension (the output
            of a column-parallel layer); else the whole x is given and sliced here.
        sequence_parallel: reduce-scatter the output along the sequence (g-bar) instead of
            all-reducing it (g); the bias is then added to this rank's tokens only, so its
            gradient is marked for reduce_sequence_parallel_grads.
    """

    def __init__(self, in_features: int, out_features: int, group, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.input_is_parallel = group, input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        start, end = shard_range(in_features, group.size, group.rank)
        self.weight = nn.Parameter(torch.empty(out_features, end - start))
        # The bias is added once, after the reduction, so it is whole on every rank.
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        bound = 1 / math.sqrt(in_features)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)
            self.bias.sequence_parallel = sequence_parallel

    @classmethod
    def from_dense(cls, linear: nn.Linear, group, cols: torch.Tensor | None = None,
                   input_is_parallel: bool = True, sequence_parallel: bool = False) -> "RowParallelLinear":
        with torch.random.fork_rng(devices=[]):
            layer = cls(linear.in_features, linear.out_features, group, linear.bias is not None,
                        input_is_parallel, sequence_parallel)
        with torch.no_grad():
            layer.weight.copy_(_take(linear.weight, cols, 1, group))
            if layer.bias is not None:
                layer.bias.copy_(linear.bias.detach())
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        y = F.linear(x, self.weight)
        y = reduce_scatter_seq(y, self.group) if self.sequence_parallel else reduce_from_tp(y, self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split over the TP ranks.

    Each rank looks up the ids in its range [start, end), zeroes the rest, and one
    all-reduce (g) sums the partial results (Shoeybi et al. 2019, sec. 3, "input embedding").
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group):
        super().__init__()
        self.group = group
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.start, self.end = shard_range(num_embeddings, group.size, group.rank)
        self.weight = nn.Parameter(torch.randn(self.end - self.start, embedding_dim))

    @classmethod
    def from_dense(cls, emb: nn.Embedding, group) -> "VocabParallelEmbedding":
        with torch.random.fork_rng(devices=[]):
            layer = cls(emb.num_embeddings, emb.embedding_dim, group)
        with torch.no_grad():
            layer.weight.copy_(emb.weight[layer.start:layer.end])
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)
