"""The parameter-server pattern as a collective: everything goes to one root, is reduced
there, and is sent back, one worker at a time.

Built from point-to-point on purpose: the MPI library's tuned Reduce/Bcast would hide the
cost this design is known for, a server link that carries (N-1) x M in and (N-1) x M out
(Li et al., "Scaling Distributed Machine Learning with the Parameter Server", OSDI 2014,
describe the sharded remedy).  The root reduces in rank order, so the result is bitwise
reproducible and equal to a left-to-right sum over ranks.
"""
from __future__ import annotations

import torch
from mpi4py import MPI

from psrt.collectives.layout import offsets
from psrt.collectives.p2p import TAG_PS, recv, scratch, send
from psrt.transport import msg, reduce_


def reduce(comm, buf: torch.Tensor, root: int, op: str) -> None:
    if comm.rank != root:
        send(comm, buf, root, TAG_PS)
        return
    if comm.size == 1:
        return
    # Left-to-right over ranks: acc = x0 op x1 op x2 ..., whatever the root's own rank is.
    mine = buf.clone() if root != 0 else None
    tmp = scratch(buf, buf.numel())
    for src in range(comm.size):
        if src == root:
            if src != 0:
                reduce_(buf, mine, op)
            continue
        if src == 0:
            recv(comm, buf, 0, TAG_PS)
        else:
            recv(comm, tmp, src, TAG_PS)
            reduce_(buf, tmp, op)


def broadcast(comm, buf: torch.Tensor, root: int) -> None:
    if comm.rank == root:
        reqs = [comm.Isend(msg(buf), dst, TAG_PS) for dst in range(comm.size) if dst != root]
        MPI.Request.Waitall(reqs)
    else:
        recv(comm, buf, root, TAG_PS)


def allreduce(comm, buf: torch.Tensor, op: str, root: int = 0) -> None:
    reduce(comm, buf, root, op)
    broadcast(comm, buf, root)


def reduce_scatter(comm, buf: torch.Tensor, counts: list[int], op: str, root: int = 0) -> None:
    reduce(comm, buf, root, op)
    off = offsets(counts)
    if comm.rank == root:
        reqs = [comm.Isend(msg(buf[off[d]:off[d + 1]]), d, TAG_PS) for d in range(comm.size) if d != root]
        MPI.Request.Waitall(reqs)
    else:
        recv(comm, buf[off[comm.rank]:off[comm.rank + 1]], root, TAG_PS)


def allgather(comm, buf: torch.Tensor, counts: list[int], root: int = 0) -> None:
    off = offsets(counts)
    r = comm.rank
    if r == root:
        for src in range(comm.size):
            if src != root:
                recv(comm, buf[off[src]:off[src + 1]], src, TAG_PS)
    else:
        send(comm, buf[off[r]:off[r + 1]], root, TAG_PS)
    broadcast(comm, buf, root)
