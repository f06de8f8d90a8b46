"""Binomial-tree broadcast and reduce (log2(N) rounds; MPICH's classic small-message shape,
Thakur et al., IJHPCA 2005, section 4.1).  Ranks are numbered relative to the root."""
from __future__ import annotations

import torch

from psrt.collectives.p2p import TAG_TREE, recv, scratch, send
from psrt.transport import reduce_


def broadcast(comm, buf: torch.Tensor, root: int) -> None:
    n = comm.size
    vr = (comm.rank - root) % n
    mask = 1
    while mask < n:
        if vr & mask:
            recv(comm, buf, (vr - mask + root) % n, TAG_TREE)
            break
        mask <<= 1
    mask >>= 1
    while mask:
        if vr + mask < n:
            send(comm, buf, (vr + mask + root) % n, TAG_TREE)
        mask >>= 1


def reduce(comm, buf: torch.Tensor, root: int, op: str) -> None:
    """Result in buf on root; other ranks' buf is left as partial sums (their own copy)."""
    n = comm.size
    vr = (comm.rank - root) % n
    tmp = None
    mask = 1
    while mask < n:
        if vr & mask:
            send(comm, buf, (vr - mask + root) % n, TAG_TREE)
            break
        child = vr | mask
        if child < n:
            tmp = scratch(buf, buf.numel()) if tmp is None else tmp
            recv(comm, tmp, (child + root) % n, TAG_TREE)
            reduce_(buf, tmp, op)
        mask <<= 1


def allreduce(comm, buf: torch.Tensor, op: str) -> None:
    reduce(comm, buf, 0, op)
    broadcast(comm, buf, 0)
