"""Ring all-reduce = ring reduce-scatter + ring all-gather.

Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations",
JPDC 69(2), 2009; the shape Baidu's ring all-reduce and Horovod made common.  Each rank sends
and receives 2(N-1)/N of the data, the lower bound for all-reduce, in 2(N-1) steps.

Chunk c is reduced along the ring starting at rank c+1 and ends complete on rank c, so after
the reduce-scatter rank r holds chunk r (the layout `reduce_scatter` promises).  Within a
step the chunk is cut into segments (collectives/schedule.py: the torch path reduces each
as soon as it lands, while later segments are still in flight).

The schedules are written once (`schedule_*`, over a builder of collectives/schedule.py) and
run on torch tensors here and on NumPy arrays by collectives/small.py.
"""
from __future__ import annotations

import torch

from psrt.collectives.layout import even_counts, offsets
from psrt.collectives.p2p import TAG_RING
from psrt.collectives.schedule import Eager

# Segment size (PSRT_RING_SEGMENT, default 4 MiB).  Over shared memory and TCP, Open MPI
# progresses transfers only inside MPI calls, so small segments buy little overlap and cost
# per-message overhead: 4 MiB measured best here (64 KiB to 1 GiB swept at N=2).


def schedule_reduce_scatter(b, n: int, r: int, off: list[int], src=None) -> None:
    """On return b.a[off[r]:off[r+1]] holds the reduction of every rank's chunk r.

    With `src`, this rank's values are read from src and b.a needs no initial copy: every
    chunk is reduced exactly once on each rank, so the reduction can write a = src (op)
    incoming, and the one chunk a rank only sends is sent from src."""
    a = b.a
    mine = a if src is None else src
    if n == 1:
        if src is not None:
            b.copy(a, src)
        return
    right, left = (r + 1) % n, (r - 1) % n
    largest = max(off[i + 1] - off[i] for i in range(n))
    tmp = b.scratch(largest if b.window is None else min(largest, b.window))
    for step in range(n - 1):
        s, c = (r - step - 1) % n, (r - step - 2) % n
        # Step 0 sends this rank's own values; later steps forward what the last step reduced.
        first = mine if step == 0 else a
        b.send_reduce(first[off[s]:off[s + 1]], right, a[off[c]:off[c + 1]], mine[off[c]:off[c + 1]], left, tmp)


def schedule_allgather(b, n: int, r: int, off: list[int]) -> None:
    """Rank r's chunk r is passed around the ring until every rank has all chunks; received
    straight into place (chunks are disjoint slices), no scratch."""
    a = b.a
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):
        s, c = (r - step) % n, (r - step - 1) % n
        b.transfer([(a[off[s]:off[s + 1]], right)], [(a[off[c]:off[c + 1]], left)])


def schedule_allreduce(b, n: int, r: int, src=None) -> None:
    off = offsets(even_counts(len(b.a), n))
    schedule_reduce_scatter(b, n, r, off, src)
    schedule_allgather(b, n, r, off)


def reduce_scatter(comm, buf: torch.Tensor, counts: list[int], op: str,
                   segment: int | None = None, src: torch.Tensor | None = None) -> None:
    """In place (or reading this rank's values from src): buf[off[r]:off[r+1]] ends holding
    the reduction of every rank's chunk r."""
    schedule_reduce_scatter(Eager(comm, buf, op, TAG_RING, segment), comm.size, comm.rank, offsets(counts), src)


def allgather(comm, buf: torch.Tensor, counts: list[int]) -> None:
    schedule_allgather(Eager(comm, buf, "sum", TAG_RING), comm.size, comm.rank, offsets(counts))


def allreduce(comm, buf: torch.Tensor, op: str, counts: list[int], src: torch.Tensor | None = None) -> None:
    """buf <- the reduction over ranks of buf (or of src, which is then left untouched)."""
    b = Eager(comm, buf, op, TAG_RING)
    off = offsets(counts)
    schedule_reduce_scatter(b, comm.size, comm.rank, off, src)
    schedule_allgather(b, comm.size, comm.rank, off)
