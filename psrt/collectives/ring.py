"""Ring all-reduce = ring reduce-scatter + ring all-gather.

Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations",
JPDC 69(2), 2009; the shape Baidu's ring all-reduce and Horovod made common.  Each rank sends
and receives 2(N-1)/N of the data, the lower bound for all-reduce, in 2(N-1) steps.

Chunk c is reduced along the ring starting at rank c+1 and ends complete on rank c, so after
the reduce-scatter rank r holds chunk r (the layout `reduce_scatter` promises).  Within a
step the chunk is cut into segments: all segment receives are posted at once and each segment
is reduced as soon as it lands, while later segments are still in flight, and the reduction
works on a cache-sized piece instead of streaming the whole chunk through memory twice.
"""
from __future__ import annotations

import torch
from mpi4py import MPI

from psrt import env
from psrt.collectives.layout import offsets
from psrt.collectives.p2p import TAG_RING, scratch
from psrt.transport import msg, reduce_into

# Segment size (PSRT_RING_SEGMENT, default 4 MiB).  Over shared memory and TCP, Open MPI
# progresses transfers only inside MPI calls, so small segments buy little overlap and cost
# per-message overhead: 4 MiB measured best here (64 KiB to 1 GiB swept at N=2).


def _segments(start: int, stop: int, seg: int):
    return [(a, min(a + seg, stop)) for a in range(start, stop, seg)] or [(start, start)]


def reduce_scatter(comm, buf: torch.Tensor, counts: list[int], op: str,
                   segment: int | None = None, src: torch.Tensor | None = None) -> None:
    """On return buf[off[r]:off[r+1]] holds the reduction of every rank's chunk r.

    In place by default.  With `src`, this rank's values are read from src and buf needs no
    initial copy: every chunk is reduced exactly once on each rank, so the reduction can
    write buf = src (op) incoming, and the one chunk a rank only sends is sent from src.
    """
    n, r = comm.size, comm.rank
    mine = buf if src is None else src
    if n == 1:
        if src is not None:
            buf.copy_(src)
        return
    off = offsets(counts)
    right, left = (r + 1) % n, (r - 1) % n
    seg = max(1, (segment or env.ring_segment_bytes()) // buf.element_size())
    tmp = scratch(buf, min(max(counts), seg * 64) if max(counts) else 0)
    for step in range(n - 1):
        send_c, recv_c = (r - step - 1) % n, (r - step - 2) % n
        # Step 0 sends this rank's own values; later steps forward what the last step reduced.
        first = mine if step == 0 else buf
        sends = [comm.Isend(msg(first[a:b]), right, TAG_RING)
                 for a, b in _segments(off[send_c], off[send_c + 1], seg)]
        # Receive the incoming chunk in windows of at most 64 segments of scratch space.
        lo, hi = off[recv_c], off[recv_c + 1]
        for w0 in range(lo, max(hi, lo + 1), max(len(tmp), 1)):
            w1 = min(w0 + len(tmp), hi)
            parts = _segments(w0, w1, seg)
            reqs = [comm.Irecv(msg(tmp[a - w0:b - w0]), left, TAG_RING) for a, b in parts]
            for (a, b), req in zip(parts, reqs):
                req.Wait()
                reduce_into(buf[a:b], mine[a:b], tmp[a - w0:b - w0], op)
        MPI.Request.Waitall(sends)


def allgather(comm, buf: torch.Tensor, counts: list[int]) -> None:
    """In place: rank r's chunk r is passed around the ring until every rank has all chunks."""
    n, r = comm.size, comm.rank
    if n == 1:
        return
    off = offsets(counts)
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):
        send_c, recv_c = (r - step) % n, (r - step - 1) % n
        # Chunks are disjoint slices of buf: receive straight into place, no scratch copy.
        comm.Sendrecv(msg(buf[off[send_c]:off[send_c + 1]]), right, TAG_RING,
                      msg(buf[off[recv_c]:off[recv_c + 1]]), left, TAG_RING)


def allreduce(comm, buf: torch.Tensor, op: str, counts: list[int], src: torch.Tensor | None = None) -> None:
    """buf <- the reduction over ranks of buf (or of src, which is then left untouched)."""
    reduce_scatter(comm, buf, counts, op, src=src)
    allgather(comm, buf, counts)
