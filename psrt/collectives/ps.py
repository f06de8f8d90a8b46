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


# Pipeline granularity of the all-reduce.  Small enough that the first results go back while
# most of the data is still coming in (so the server's link is busy in both directions at
# once, as a server holding many keys is), large enough that per-message costs stay small.
PIPELINE_BYTES = 1 << 20
# Segments whose receives the server keeps posted ahead.  A large message moves only once its
# receive is posted (MPI's rendezvous), and the server's go-ahead travels on its busy uplink,
# queued behind the results it is sending: with one receive posted at a time every segment
# would wait for that queue, so the server asks for the next segments early.
PIPELINE_DEPTH = 2


def allreduce(comm, buf: torch.Tensor, op: str, root: int = 0) -> None:
    """Reduce at the root and send the result back, pipelined by segments: the root returns
    segment k to the workers while segments k+1.. come in, so on a full-duplex link the
    server needs (N-1) x M / bandwidth, not twice that as a store-and-forward server would
    (psrt.collectives.cost has the model).  Each segment is reduced in rank order, so the
    result is the same left-to-right sum as `reduce` gives."""
    if comm.size == 1 or buf.numel() == 0:
        return
    step = max(1, PIPELINE_BYTES // buf.element_size())
    bounds = [(lo, min(lo + step, buf.numel())) for lo in range(0, buf.numel(), step)]
    if comm.rank != root:
        # Receives go up first: a large message moves only once its receive is posted.
        out = scratch(buf, buf.numel())
        reqs = [comm.Irecv(msg(out[lo:hi]), root, TAG_PS) for lo, hi in bounds]
        reqs += [comm.Isend(msg(buf[lo:hi]), root, TAG_PS) for lo, hi in bounds]
        MPI.Request.Waitall(reqs)
        buf.copy_(out)
        return
    others = [r for r in range(comm.size) if r != root]
    row = {src: i for i, src in enumerate(others)}   # each sender's row of a slot
    slots = [scratch(buf, step * len(others)).view(len(others), step) for _ in range(PIPELINE_DEPTH)]

    def post(k: int) -> list:
        lo, hi = bounds[k]
        space = slots[k % PIPELINE_DEPTH]
        return [comm.Irecv(msg(space[i, :hi - lo]), src, TAG_PS) for i, src in enumerate(others)]

    pending = [post(k) for k in range(min(PIPELINE_DEPTH, len(bounds)))]
    sends = []
    for k, (lo, hi) in enumerate(bounds):
        MPI.Request.Waitall(pending.pop(0))
        part, got = buf[lo:hi], slots[k % PIPELINE_DEPTH][:, :hi - lo]
        mine = part.clone() if root != 0 else None
        for r in range(comm.size):   # left to right over ranks
            x = mine if r == root else got[row[r]]
            if r == 0:
                if root != 0:
                    part.copy_(x)
            else:
                reduce_(part, x, op)
        sends += [comm.Isend(msg(part), dst, TAG_PS) for dst in others]
        if k + PIPELINE_DEPTH < len(bounds):
            pending.append(post(k + PIPELINE_DEPTH))   # this segment's slot is free again
    MPI.Request.Waitall(sends)


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
