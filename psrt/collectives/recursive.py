"""Recursive doubling and recursive halving-doubling (Rabenseifner) all-reduce.

Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in MPICH",
IJHPCA 19(1), 2005, sections 4.3-4.4.  Recursive doubling exchanges the whole vector in
log2(N) steps (latency-optimal, for small messages); halving-doubling does a reduce-scatter by
recursive halving and an all-gather by recursive doubling (2 log2(N) steps, but only
2(N-1)/N of the data, for medium messages).

World sizes that are not a power of two are folded first: with p the largest power of two
<= N and rem = N - p, the even ranks among the first 2*rem hand their vector to their odd
neighbour and sit out; the remaining p ranks run the power-of-two algorithm; the odd ranks
hand the result back.
"""
from __future__ import annotations

import torch

from psrt.collectives.layout import even_counts, offsets
from psrt.collectives.p2p import TAG_RD, TAG_RHD, recv, scratch, send, sendrecv
from psrt.transport import reduce_


def _fold(comm, buf: torch.Tensor, op: str, tag: int) -> tuple[int, int, int]:
    """Reduce N ranks onto p = 2**k of them.  Returns (p, rem, newrank); newrank -1 sits out."""
    n, r = comm.size, comm.rank
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    if r < 2 * rem:
        if r % 2 == 0:
            send(comm, buf, r + 1, tag)
            return p, rem, -1
        tmp = scratch(buf, buf.numel())
        recv(comm, tmp, r - 1, tag)
        reduce_(buf, tmp, op)
        return p, rem, r // 2
    return p, rem, r - rem


def _unfold(comm, buf: torch.Tensor, rem: int, tag: int) -> None:
    r = comm.rank
    if r < 2 * rem:
        if r % 2 == 0:
            recv(comm, buf, r + 1, tag)
        else:
            send(comm, buf, r - 1, tag)


def _real_rank(newrank: int, rem: int) -> int:
    return newrank * 2 + 1 if newrank < rem else newrank + rem


def allreduce_doubling(comm, buf: torch.Tensor, op: str) -> None:
    """In place, log2(N) exchanges of the whole vector."""
    if comm.size == 1:
        return
    p, rem, newrank = _fold(comm, buf, op, TAG_RD)
    if newrank >= 0:
        tmp = scratch(buf, buf.numel())
        mask = 1
        while mask < p:
            peer = _real_rank(newrank ^ mask, rem)
            sendrecv(comm, buf, peer, tmp, peer, TAG_RD)
            reduce_(buf, tmp, op)  # IEEE + and * commute, so both partners get equal bits
            mask <<= 1
    _unfold(comm, buf, rem, TAG_RD)


def allreduce_halving_doubling(comm, buf: torch.Tensor, op: str) -> None:
    """In place: reduce-scatter by recursive halving, then all-gather by recursive doubling."""
    if comm.size == 1:
        return
    p, rem, newrank = _fold(comm, buf, op, TAG_RHD)
    if newrank >= 0:
        off = offsets(even_counts(buf.numel(), p))
        tmp = scratch(buf, off[p // 2])  # the larger half (even_counts puts extras first)
        lo, hi = 0, p  # range of chunk indices this rank still reduces
        mask = p >> 1
        while mask:
            peer = _real_rank(newrank ^ mask, rem)
            mid = (lo + hi) // 2
            if newrank & mask:
                keep, give = (mid, hi), (lo, mid)
            else:
                keep, give = (lo, mid), (mid, hi)
            a, b = off[keep[0]], off[keep[1]]
            incoming = tmp[:b - a]
            sendrecv(comm, buf[off[give[0]]:off[give[1]]], peer, incoming, peer, TAG_RHD)
            reduce_(buf[a:b], incoming, op)
            lo, hi = keep
            mask >>= 1
        # Now rank `newrank` holds chunk `newrank` complete; double the owned range back up.
        mask = 1
        while mask < p:
            peer = _real_rank(newrank ^ mask, rem)
            width = hi - lo
            plo = lo + width if (newrank & mask) == 0 else lo - width
            sendrecv(comm, buf[off[lo]:off[hi]], peer, buf[off[plo]:off[plo + width]], peer, TAG_RHD)
            lo, hi = min(lo, plo), max(hi, plo + width)
            mask <<= 1
    _unfold(comm, buf, rem, TAG_RHD)
