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

The schedules are written once (`schedule_*`, over a builder of collectives/schedule.py) and
run on torch tensors here and on NumPy arrays by collectives/small.py.
"""
from __future__ import annotations

import torch

from psrt.collectives.layout import even_counts, offsets
from psrt.collectives.p2p import TAG_RD, TAG_RHD
from psrt.collectives.schedule import Eager


def _fold(b, n: int, r: int, tmp) -> tuple[int, int, int]:
    """Reduce N ranks onto p = 2**k of them.  Returns (p, rem, newrank); newrank -1 sits out."""
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    if r < 2 * rem:
        if r % 2 == 0:
            b.transfer(sends=[(b.a, r + 1)])
            return p, rem, -1
        b.transfer(recvs=[(tmp, r - 1)])
        b.reduce(b.a, tmp)
        return p, rem, r // 2
    return p, rem, r - rem


def _unfold(b, r: int, rem: int) -> None:
    if r < 2 * rem:
        if r % 2 == 0:
            b.transfer(recvs=[(b.a, r + 1)])
        else:
            b.transfer(sends=[(b.a, r - 1)])


def _real_rank(newrank: int, rem: int) -> int:
    return newrank * 2 + 1 if newrank < rem else newrank + rem


def schedule_doubling(b, n: int, r: int) -> None:
    """log2(N) exchanges of the whole vector."""
    if n == 1:
        return
    a, tmp = b.a, b.scratch(len(b.a))
    p, rem, newrank = _fold(b, n, r, tmp)
    if newrank >= 0:
        mask = 1
        while mask < p:
            peer = _real_rank(newrank ^ mask, rem)
            b.transfer([(a, peer)], [(tmp, peer)])
            b.reduce(a, tmp)  # IEEE + and * commute, so both partners get equal bits
            mask <<= 1
    _unfold(b, r, rem)


def schedule_halving_doubling(b, n: int, r: int) -> None:
    """Reduce-scatter by recursive halving, then all-gather by recursive doubling."""
    if n == 1:
        return
    a = b.a
    p = 1 << (n.bit_length() - 1)
    off = offsets(even_counts(len(a), p))
    # the larger half (even_counts puts extras first), or all of it for a rank that folds
    tmp = b.scratch(len(a) if r < 2 * (n - p) else off[p // 2])
    p, rem, newrank = _fold(b, n, r, tmp)
    if newrank >= 0:
        lo, hi = 0, p  # range of chunk indices this rank still reduces
        mask = p >> 1
        while mask:
            peer = _real_rank(newrank ^ mask, rem)
            mid = (lo + hi) // 2
            keep, give = ((mid, hi), (lo, mid)) if newrank & mask else ((lo, mid), (mid, hi))
            mine = a[off[keep[0]]:off[keep[1]]]
            incoming = tmp[:len(mine)]
            b.transfer([(a[off[give[0]]:off[give[1]]], peer)], [(incoming, peer)])
            b.reduce(mine, incoming)
            lo, hi = keep
            mask >>= 1
        # Now rank `newrank` holds chunk `newrank` complete; double the owned range back up.
        mask = 1
        while mask < p:
            peer = _real_rank(newrank ^ mask, rem)
            width = hi - lo
            plo = lo + width if (newrank & mask) == 0 else lo - width
            b.transfer([(a[off[lo]:off[hi]], peer)], [(a[off[plo]:off[plo + width]], peer)])
            lo, hi = min(lo, plo), max(hi, plo + width)
            mask <<= 1
    _unfold(b, r, rem)


def allreduce_doubling(comm, buf: torch.Tensor, op: str) -> None:
    """In place, log2(N) exchanges of the whole vector."""
    schedule_doubling(Eager(comm, buf, op, TAG_RD), comm.size, comm.rank)


def allreduce_halving_doubling(comm, buf: torch.Tensor, op: str) -> None:
    """In place: reduce-scatter by recursive halving, then all-gather by recursive doubling."""
    schedule_halving_doubling(Eager(comm, buf, op, TAG_RHD), comm.size, comm.rank)
