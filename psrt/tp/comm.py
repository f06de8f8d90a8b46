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
