"""The conjugate communication operators of tensor parallelism, as autograd functions.

Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism", 2019, sec. 3, fig. 3:
  f: identity in forward, all-reduce of the gradient in backward (before a column-parallel
     layer: every rank uses the whole input, so the input's gradient is the sum of every
     rank's partial gradient);
  g: all-reduce in forward, identity in backward (after a row-parallel layer: each rank
     holds a partial sum of the output, whose gradient every rank needs whole).
Plus the split / gather pair along the last dimension for layers whose input or output is
wanted whole.  `group` is a psrt Communicator over the tensor-parallel ranks (Grid.tp_group).

Sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", 2022, sec. 4.2.2) keeps the activations between the tensor-parallel
regions split along the sequence (dim 1 of [batch, seq, hidden]) and replaces f and g with
  f-bar: all-gather along the sequence forward, reduce-scatter backward (before a
         column-parallel layer, which needs the whole sequence);
  g-bar: reduce-scatter along the sequence forward, all-gather backward (after a
         row-parallel layer: each rank keeps the sum for its own slice of the sequence).
An all-reduce is a reduce-scatter plus an all-gather, so the bytes are those of f and g,
while LayerNorm and the residual stream hold 1/t of the sequence.
"""
from __future__ import annotations

import torch

from psrt.collectives.layout import shard_range


def _allreduce(t: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    if group.size == 1:
        return t
    return group.allreduce(t.contiguous(), op=op)


class CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _allreduce(grad, ctx.group), None


class ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _allreduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ScatterToTP(torch.autograd.Function):
    """Keep this rank's slice of the last dimension; backward gathers the slices."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        start, end = shard_range(x.shape[-1], group.size, group.rank)
        return x[..., start:end].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class GatherFromTP(torch.autograd.Function):
    """Concatenate every rank's slice along the last dimension; backward keeps this rank's."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.width = group, x.shape[-1]
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        start, end = shard_range(grad.shape[-1], group.size, group.rank)
        return grad[..., start:end].contiguous(), None


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    if group.size == 1:
        return x
    # psrt's allgather concatenates along dim 0: bring the last dimension to the front.
    front = x.movedim(-1, 0).contiguous()
    return group.allgather(front).movedim(0, -1).contiguous()


def _seq_counts(seq: int, group) -> list[int]:
    return [shard_range(seq, group.size, r)[1] - shard_range(seq, group.size, r)[0] for r in range(group.size)]


def _gather_seq(x: torch.Tensor, group, seq: int | None) -> torch.Tensor:
    """Every rank's slice of the sequence, in rank order; with `seq` unknown the slice lengths
    are exchanged first (psrt's allgather does that when given no counts)."""
    front = x.transpose(0, 1).contiguous()            # psrt's collectives work along dim 0
    counts = _seq_counts(seq, group) if seq is not None else None
    return group.allgather(front, counts=counts).transpose(0, 1).contiguous()


def _reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    front = x.transpose(0, 1).contiguous()
    counts = _seq_counts(x.shape[1], group)
    return group.reduce_scatter(front, op="sum", counts=counts).transpose(0, 1).contiguous()


class GatherSeq(torch.autograd.Function):
    """f-bar: all-gather along the sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, group, seq):
        ctx.group = group
        return _gather_seq(x, group, seq) if group.size > 1 else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (_reduce_scatter_seq(grad, ctx.group) if ctx.group.size > 1 else grad), None, None


class ReduceScatterSeq(torch.autograd.Function):
    """g-bar: reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.seq = group, x.shape[1]
        return _reduce_scatter_seq(x, group) if group.size > 1 else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (_gather_seq(grad, ctx.group, ctx.seq) if ctx.group.size > 1 else grad), None


class ScatterSeq(torch.autograd.Function):
    """Keep this rank's slice of the sequence; backward gathers the slices (the embedding's
    output, whole on every rank, entering the sequence-parallel region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.seq = group, x.shape[1]
        start, end = shard_range(x.shape[1], group.size, group.rank)
        return x[:, start:end].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return (_gather_seq(grad, ctx.group, ctx.seq) if ctx.group.size > 1 else grad), None


def gather_seq(x, group, seq: int | None = None):
    """The whole sequence (`seq` long, if known) from every rank's slice of it."""
    return GatherSeq.apply(x, group, seq)


def reduce_scatter_seq(x, group):
    return ReduceScatterSeq.apply(x, group)


def scatter_seq(x, group):
    return ScatterSeq.apply(x, group)


def reduce_sequence_parallel_grads(params, group) -> int:
    """Sum over the TP group the gradients of parameters used on a slice of the sequence
    (LayerNorms and the biases after g-bar, marked `sequence_parallel`): each rank computed
    them from its own tokens only.  One all-reduce; returns its payload bytes."""
    grads = [p.grad for p in params if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if group.size == 1 or not grads:
        return 0
    flat = torch.cat([g.reshape(-1) for g in grads])
    group.allreduce(flat, op="sum", out=flat)
    at = 0
    for g in grads:
        g.copy_(flat[at:at + g.numel()].view_as(g))
        at += g.numel()
    return flat.numel() * flat.element_size()


def copy_to_tp(x, group):
    return CopyToTP.apply(x, group)


def reduce_from_tp(x, group):
    return ReduceFromTP.apply(x, group)


def scatter_to_tp(x, group):
    return ScatterToTP.apply(x, group)


def gather_from_tp(x, group):
    return GatherFromTP.apply(x, group)


class CountingGroup:
    """A TP group that counts what goes through it: calls and payload bytes per collective
    (the tensor each rank contributes, the unit Megatron-LM's analysis counts).  Wrap a
    model's group with it to measure communication per layer."""

    def __init__(self, group):
        self.group, self.rank, self.size = group, group.rank, group.size
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    def _count(self, what: str, t: torch.Tensor) -> None:
        self.calls[what] = self.calls.get(what, 0) + 1
        self.bytes[what] = self.bytes.get(what, 0) + t.numel() * t.element_size()

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    def allreduce(self, t, **kw):
        self._count("allreduce", t)
        return self.group.allreduce(t, **kw)

    def allgather(self, t, **kw):
        self._count("allgather", t)
        return self.group.allgather(t, **kw)

    def reduce_scatter(self, t, **kw):
        self._count("reduce_scatter", t)
        return self.group.reduce_scatter(t, **kw)
