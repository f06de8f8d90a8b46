"""torch.distributed (gloo on CPU, nccl on GPU) behind psrt's interface (the 'torch' algorithm).

The process group is the default one set up by `psrt.world.init_torch_distributed`, so this
backend serves communicators that span the whole world.  gloo has no AVG and no
reduce_scatter, so AVG is a SUM (the Communicator divides) and reduce_scatter is an
all-reduce followed by keeping one's own chunk: correct, not bandwidth-optimal.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from psrt.collectives.layout import offsets

_OPS = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN", "prod": "PRODUCT",
        "band": "BAND", "bor": "BOR", "bxor": "BXOR"}


def _op(op: str):
    return getattr(dist.ReduceOp, _OPS[op])


def allreduce(group, buf: torch.Tensor, op: str) -> None:
    dist.all_reduce(buf, _op(op), group=group)


def reduce(group, buf: torch.Tensor, root: int, op: str) -> None:
    dist.reduce(buf, root, _op(op), group=group)


def broadcast(group, buf: torch.Tensor, root: int) -> None:
    dist.broadcast(buf, root, group=group)


def reduce_scatter(group, buf: torch.Tensor, counts: list[int], op: str) -> None:
    dist.all_reduce(buf, _op(op), group=group)


def allgather(group, buf: torch.Tensor, counts: list[int]) -> None:
    rank = dist.get_rank(group)
    off = offsets(counts)
    width = max(counts) if counts else 0
    # Uneven sizes: pad every chunk to the largest, gather, then unpack.
    padded = torch.zeros(width, dtype=buf.dtype, device=buf.device)
    padded[:counts[rank]] = buf[off[rank]:off[rank + 1]]
    out = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(out, padded, group=group)
    for i, part in enumerate(out):
        buf[off[i]:off[i + 1]] = part[:counts[i]]


def barrier(group) -> None:
    dist.barrier(group=group)
