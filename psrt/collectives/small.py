"""Small messages: psrt's all-reduce schedules written directly in mpi4py over NumPy arrays.

Below SMALL_BYTES a call costs Python more than bytes: a torch slice, a torch add and a tensor to
MPI-buffer conversion each take microseconds, while a message of a few bytes takes one or two.
So for small CPU tensors the Communicator runs these functions on a NumPy view of the tensor's
memory.  They send the same messages, with the same tags, to the same peers, in the same order
as ring.py, recursive.py, tree.py and ps.py (a rank on one path and its peer on the other still
match), and reduce in the same order, so the bits are the same.  `python -m psrt.bench
collectives` times them bare, as the floor psrt's own calls are measured against.

Each function works in place on `a`, with `tmp` scratch of a's size and `ufunc` the reduction
(numpy.add, multiply, maximum or minimum).
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from psrt.collectives.layout import even_counts, offsets
from psrt.collectives.p2p import TAG_PS, TAG_RD, TAG_RHD, TAG_RING, TAG_TREE

# Up to 4 MiB a call's cost is set by Python between MPI calls (a torch slice, a torch add, a
# tensor to MPI-buffer conversion: tens of microseconds per step), and with more ranks than
# cores every microsecond a rank spends there holds up the ranks waiting on it.  Measured with
# `bench collectives` (ring vs mpi4py-ring): at N = 2, 80 KiB-1 MiB, the torch path took
# 1.4-4x the NumPy one and 1.1x at 4 MiB; at N = 4 on 2 cores 2-4.5x.  At 16 MiB the torch
# ring's cache-sized segments win (0.8x), so larger tensors take that path.
SMALL_BYTES = 4 << 20


def takes(algo: str, nbytes: int) -> bool:
    """Whether an all-reduce of nbytes with `algo` runs here: up to SMALL_BYTES, and for the
    parameter server up to one pipeline segment, so that it sends what ps.py sends."""
    from psrt.collectives.ps import PIPELINE_BYTES
    return nbytes <= (PIPELINE_BYTES if algo == "ps" else SMALL_BYTES)
UFUNCS = {"sum": np.add, "avg": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum,
          "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}
# dtypes whose NumPy arithmetic is torch's (16-bit floats and bool travel as raw words)
DTYPES = frozenset({torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8, torch.int8})


def ring(comm, a: np.ndarray, tmp: np.ndarray, ufunc) -> None:
    """Ring reduce-scatter then ring all-gather (ring.py), one segment per chunk."""
    n, r = comm.size, comm.rank
    if n == 1:
        return
    off = offsets(even_counts(a.size, n))
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):
        s, c = (r - step - 1) % n, (r - step - 2) % n
        dst = a[off[c]:off[c + 1]]
        got = tmp[:dst.size]
        comm.Sendrecv(a[off[s]:off[s + 1]], right, TAG_RING, got, left, TAG_RING)
        ufunc(dst, got, out=dst)
    for step in range(n - 1):
        s, c = (r - step) % n, (r - step - 1) % n
        comm.Sendrecv(a[off[s]:off[s + 1]], right, TAG_RING, a[off[c]:off[c + 1]], left, TAG_RING)


def _fold(comm, a, tmp, ufunc, tag) -> tuple[int, int, int]:
    """recursive._fold: N ranks onto p = 2**k; returns (p, rem, newrank), -1 sits out."""
    n, r = comm.size, comm.rank
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    if r < 2 * rem:
        if r % 2 == 0:
            comm.Send(a, r + 1, tag)
            return p, rem, -1
        comm.Recv(tmp, r - 1, tag)
        ufunc(a, tmp, out=a)
        return p, rem, r // 2
    return p, rem, r - rem


def _unfold(comm, a, rem: int, tag: int) -> None:
    r = comm.rank
    if r < 2 * rem:
        if r % 2 == 0:
            comm.Recv(a, r + 1, tag)
        else:
            comm.Send(a, r - 1, tag)


def _real(newrank: int, rem: int) -> int:
    return newrank * 2 + 1 if newrank < rem else newrank + rem


def doubling(comm, a: np.ndarray, tmp: np.ndarray, ufunc) -> None:
    """Recursive doubling (recursive.allreduce_doubling)."""
    if comm.size == 1:
        return
    p, rem, me = _fold(comm, a, tmp, ufunc, TAG_RD)
    if me >= 0:
        mask = 1
        while mask < p:
            peer = _real(me ^ mask, rem)
            comm.Sendrecv(a, peer, TAG_RD, tmp, peer, TAG_RD)
            ufunc(a, tmp, out=a)
            mask <<= 1
    _unfold(comm, a, rem, TAG_RD)


def halving_doubling(comm, a: np.ndarray, tmp: np.ndarray, ufunc) -> None:
    """Rabenseifner's reduce-scatter by halving, all-gather by doubling
    (recursive.allreduce_halving_doubling)."""
    if comm.size == 1:
        return
    p, rem, me = _fold(comm, a, tmp, ufunc, TAG_RHD)
    if me >= 0:
        off = offsets(even_counts(a.size, p))
        lo, hi, mask = 0, p, p >> 1
        while mask:
            peer = _real(me ^ mask, rem)
            mid = (lo + hi) // 2
            keep, give = ((mid, hi), (lo, mid)) if me & mask else ((lo, mid), (mid, hi))
            mine = a[off[keep[0]]:off[keep[1]]]
            got = tmp[:mine.size]
            comm.Sendrecv(a[off[give[0]]:off[give[1]]], peer, TAG_RHD, got, peer, TAG_RHD)
            ufunc(mine, got, out=mine)
            lo, hi = keep
            mask >>= 1
        mask = 1
        while mask < p:
            peer = _real(me ^ mask, rem)
            width = hi - lo
            plo = lo + width if (me & mask) == 0 else lo - width
            comm.Sendrecv(a[off[lo]:off[hi]], peer, TAG_RHD, a[off[plo]:off[plo + width]], peer, TAG_RHD)
            lo, hi = min(lo, plo), max(hi, plo + width)
            mask <<= 1
    _unfold(comm, a, rem, TAG_RHD)


def tree(comm, a: np.ndarray, tmp: np.ndarray, ufunc) -> None:
    """Binomial-tree reduce to rank 0, then binomial-tree broadcast (tree.allreduce)."""
    n, vr = comm.size, comm.rank
    mask = 1
    while mask < n:
        if vr & mask:
            comm.Send(a, vr - mask, TAG_TREE)
            break
        if (vr | mask) < n:
            comm.Recv(tmp, vr | mask, TAG_TREE)
            ufunc(a, tmp, out=a)
        mask <<= 1
    mask = 1
    while mask < n:
        if vr & mask:
            comm.Recv(a, vr - mask, TAG_TREE)
            break
        mask <<= 1
    mask >>= 1
    while mask:
        if vr + mask < n:
            comm.Send(a, vr + mask, TAG_TREE)
        mask >>= 1


def ps(comm, a: np.ndarray, tmp: np.ndarray, ufunc) -> None:
    """Everything to rank 0, reduced there in rank order, sent back (ps.allreduce, one segment)."""
    from mpi4py import MPI
    n = comm.size
    if n == 1 or a.size == 0:
        return
    if comm.rank != 0:
        comm.Sendrecv(a, 0, TAG_PS, tmp, 0, TAG_PS)
        a[...] = tmp
        return
    rows = np.empty((n - 1, a.size), dtype=a.dtype)
    MPI.Request.Waitall([comm.Irecv(rows[i], i + 1, TAG_PS) for i in range(n - 1)])
    for row in rows:
        ufunc(a, row, out=a)
    MPI.Request.Waitall([comm.Isend(a, dst, TAG_PS) for dst in range(1, n)])


def native(comm, a: np.ndarray, tmp: np.ndarray, ufunc) -> None:
    """The MPI library's own all-reduce, in place (not a floor: a fast path)."""
    from mpi4py import MPI
    comm.Allreduce(MPI.IN_PLACE, a, _mpi_op(ufunc))


@functools.lru_cache(maxsize=None)
def _mpi_op(ufunc):
    from mpi4py import MPI
    return {np.add: MPI.SUM, np.multiply: MPI.PROD, np.maximum: MPI.MAX, np.minimum: MPI.MIN,
            np.bitwise_and: MPI.BAND, np.bitwise_or: MPI.BOR, np.bitwise_xor: MPI.BXOR}[ufunc]


# psrt's own schedules (the bench's floors); FAST adds the MPI library's call for the fast path
ALLREDUCE = {"ring": ring, "doubling": doubling, "halving-doubling": halving_doubling,
             "tree": tree, "ps": ps}
FAST = dict(ALLREDUCE, native=native)
