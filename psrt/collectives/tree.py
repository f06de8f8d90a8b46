"""Binomial-tree broadcast and reduce (log2(N) rounds; MPICH's classic small-message shape,
Thakur et al., IJHPCA 2005, section 4.1).  Ranks are numbered relative to the root.

The schedules are written once (`schedule_*`, over a builder of collectives/schedule.py) and
run on torch tensors here and on NumPy arrays by collectives/small.py.
"""
from __future__ import annotations

import torch

from psrt.collectives.p2p import TAG_TREE
from psrt.collectives.schedule import Eager


def schedule_broadcast(b, n: int, r: int, root: int) -> None:
    vr = (r - root) % n
    mask = 1
    while mask < n:
        if vr & mask:
            b.transfer(recvs=[(b.a, (vr - mask + root) % n)])
            break
        mask <<= 1
    mask >>= 1
    while mask:
        if vr + mask < n:
            b.transfer(sends=[(b.a, (vr + mask + root) % n)])
        mask >>= 1


def schedule_reduce(b, n: int, r: int, root: int) -> None:
    """Result in b.a on root; other ranks' b.a is left as partial sums (their own copy)."""
    vr = (r - root) % n
    tmp = None
    mask = 1
    while mask < n:
        if vr & mask:
            b.transfer(sends=[(b.a, (vr - mask + root) % n)])
            break
        child = vr | mask
        if child < n:
            tmp = b.scratch(len(b.a)) if tmp is None else tmp
            b.transfer(recvs=[(tmp, (child + root) % n)])
            b.reduce(b.a, tmp)
        mask <<= 1


def schedule_allreduce(b, n: int, r: int) -> None:
    schedule_reduce(b, n, r, 0)
    schedule_broadcast(b, n, r, 0)


def broadcast(comm, buf: torch.Tensor, root: int) -> None:
    schedule_broadcast(Eager(comm, buf, "sum", TAG_TREE), comm.size, comm.rank, root)


def reduce(comm, buf: torch.Tensor, root: int, op: str) -> None:
    """Result in buf on root; other ranks' buf is left as partial sums (their own copy)."""
    schedule_reduce(Eager(comm, buf, op, TAG_TREE), comm.size, comm.rank, root)


def allreduce(comm, buf: torch.Tensor, op: str) -> None:
    schedule_allreduce(Eager(comm, buf, op, TAG_TREE), comm.size, comm.rank)
