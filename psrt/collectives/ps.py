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
from psrt.collectives.schedule import Eager
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


def schedule_allreduce(b, n: int, r: int, root: int = 0) -> None:
    """Reduce at the root and send the result back, pipelined by segments: the root returns
    segment k to the workers while segments k+1.. come in, so on a full-duplex link the
    server needs (N-1) x M / bandwidth, not twice that as a store-and-forward server would
    (psrt.collectives.cost has the model).  Each segment is reduced in rank order, so the
    result is the same left-to-right sum as `reduce` gives."""
    a = b.a
    total = len(a)
    if n == 1 or total == 0:
        return
    step = max(1, PIPELINE_BYTES // b.itemsize)
    bounds = [(lo, min(lo + step, total)) for lo in range(0, total, step)]
    if r != root:
        # Receives go up first: a large message moves only once its receive is posted.
        out = b.scratch(total)
        b.transfer(sends=[(a[lo:hi], root) for lo, hi in bounds], recvs=[(out[lo:hi], root) for lo, hi in bounds])
        b.copy(a, out)
        return
    others = [q for q in range(n) if q != root]
    row = {src: i for i, src in enumerate(others)}   # each sender's row of a slot
    slots = [b.scratch((len(others), min(step, total))) for _ in range(min(PIPELINE_DEPTH, len(bounds)))]
    mine = b.scratch(min(step, total)) if root != 0 else None

    def post(k: int):
        lo, hi = bounds[k]
        space = slots[k % PIPELINE_DEPTH]
        return b.start(recvs=[(space[i, :hi - lo], src) for i, src in enumerate(others)])

    pending = [post(k) for k in range(len(slots))]
    sends = []
    for k, (lo, hi) in enumerate(bounds):
        b.complete(pending.pop(0))
        part, got = a[lo:hi], slots[k % PIPELINE_DEPTH][:, :hi - lo]
        if root != 0:
            b.copy(mine[:hi - lo], part)
        for q in range(n):   # left to right over ranks
            x = (mine[:hi - lo] if root != 0 else part) if q == root else got[row[q]]
            if q == 0:
                if root != 0:
                    b.copy(part, x)
            else:
                b.reduce(part, x)
        sends.append(b.start(sends=[(part, dst) for dst in others]))
        if k + PIPELINE_DEPTH < len(bounds):
            pending.append(post(k + PIPELINE_DEPTH))   # this segment's slot is free again
    for h in sends:
        b.complete(h)


def allreduce(comm, buf: torch.Tensor, op: str, root: int = 0) -> None:
    """In place: everything to the root, reduced there in rank order, sent back
    (`schedule_allreduce`)."""
    schedule_allreduce(Eager(comm, buf, op, TAG_PS), comm.size, comm.rank, root)


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
