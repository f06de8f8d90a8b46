"""Small messages: psrt's all-reduce schedules over NumPy arrays, made ready once per buffer.

Below SMALL_BYTES a call costs Python more than bytes: a torch slice, a torch add and a tensor to
MPI-buffer conversion each take microseconds, while a message of a few bytes takes one or two.
So for small CPU tensors the Communicator runs these schedules on a NumPy view of the tensor's
memory.  They send the same messages, with the same tags, to the same peers, in the same order
as ring.py, recursive.py, tree.py and ps.py (a rank on one path and its peer on the other still
match), and reduce in the same order, so the bits are the same.

A schedule is data: `plan` turns (algorithm, communicator, array) into a `Plan`, a flat list of
(function, arguments) steps (MPI transfers on fixed slices of the array, NumPy reductions into
fixed slices, the scratch they need) built once.  A call is then the loop over those steps:
nothing is sliced, allocated or looked up again, which is what a buffer reduced every step (a
loss, a gradient norm, a DDP bucket) pays.  With `persistent=True` each transfer is a set of
persistent requests (MPI_Send_init / MPI_Recv_init, MPI 4.1 sec. 3.9) started and completed
together, instead of MPI_Sendrecv / MPI_Send / MPI_Recv.
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


class Plan:
    """One all-reduce of a fixed array, ready to run: `plan()` runs it in place."""

    __slots__ = ("steps", "requests", "nbytes")

    def __init__(self, steps: list, requests: list, nbytes: int):
        self.steps = steps          # [(function, arguments)], run in order
        self.requests = requests    # persistent requests, freed by free()
        self.nbytes = nbytes        # scratch this plan allocated

    def __call__(self) -> None:
        for fn, args in self.steps:
            fn(*args)

    def free(self) -> None:
        """Free the persistent requests (inactive between calls, so any time after one)."""
        for req in self.requests:
            req.Free()
        self.requests = []


def _exchange(comm, recvs: tuple, sends: tuple, tag: int) -> None:
    from mpi4py import MPI
    MPI.Request.Waitall([comm.Irecv(b, p, tag) for b, p in recvs] + [comm.Isend(b, p, tag) for b, p in sends])


def _start_wait(requests: list) -> None:
    from mpi4py import MPI
    MPI.Prequest.Startall(requests)
    MPI.Request.Waitall(requests)


class _Builder:
    """Collects a schedule's steps; `transfer` picks the MPI call for a set of messages."""

    def __init__(self, comm, a: np.ndarray, ufunc, tag: int, persistent: bool):
        self.comm, self.a, self.ufunc, self.tag, self.persistent = comm, a, ufunc, tag, persistent
        self.steps: list = []
        self.requests: list = []
        self.nbytes = 0

    def scratch(self, shape) -> np.ndarray:
        tmp = np.empty(shape, dtype=self.a.dtype)
        self.nbytes += tmp.nbytes
        return tmp

    def transfer(self, sends=(), recvs=()) -> None:
        """Send each (array, peer) of sends and receive into each (array, peer) of recvs, all
        at once; the step ends when every one is complete."""
        c, tag = self.comm, self.tag
        if self.persistent:
            reqs = [c.Recv_init(b, p, tag) for b, p in recvs] + [c.Send_init(b, p, tag) for b, p in sends]
            self.requests += reqs
            self.steps.append((_start_wait, (reqs,)))
        elif len(sends) == 1 and len(recvs) == 1:
            (sb, dst), (rb, src) = sends[0], recvs[0]
            self.steps.append((c.Sendrecv, (sb, dst, tag, rb, src, tag)))
        elif len(sends) == 1 and not recvs:
            self.steps.append((c.Send, (sends[0][0], sends[0][1], tag)))
        elif len(recvs) == 1 and not sends:
            self.steps.append((c.Recv, (recvs[0][0], recvs[0][1], tag)))
        else:
            self.steps.append((_exchange, (c, tuple(recvs), tuple(sends), tag)))

    def reduce(self, dst: np.ndarray, src: np.ndarray) -> None:
        self.steps.append((self.ufunc, (dst, src, dst)))

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        self.steps.append((np.copyto, (dst, src)))


def _ring(b: _Builder, n: int, r: int) -> None:
    """Ring reduce-scatter then ring all-gather (ring.py), one segment per chunk."""
    if n == 1:
        return
    a = b.a
    off = offsets(even_counts(a.size, n))
    right, left = (r + 1) % n, (r - 1) % n
    tmp = b.scratch(off[1])                 # the first chunk is the largest
    for step in range(n - 1):
        s, c = (r - step - 1) % n, (r - step - 2) % n
        dst = a[off[c]:off[c + 1]]
        got = tmp[:dst.size]
        b.transfer([(a[off[s]:off[s + 1]], right)], [(got, left)])
        b.reduce(dst, got)
    for step in range(n - 1):
        s, c = (r - step) % n, (r - step - 1) % n
        b.transfer([(a[off[s]:off[s + 1]], right)], [(a[off[c]:off[c + 1]], left)])


def _fold(b: _Builder, n: int, r: int, tmp: np.ndarray) -> tuple[int, int, int]:
    """recursive._fold: N ranks onto p = 2**k; returns (p, rem, newrank), -1 sits out."""
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


def _unfold(b: _Builder, r: int, rem: int) -> None:
    if r < 2 * rem:
        if r % 2 == 0:
            b.transfer(recvs=[(b.a, r + 1)])
        else:
            b.transfer(sends=[(b.a, r - 1)])


def _real(newrank: int, rem: int) -> int:
    return newrank * 2 + 1 if newrank < rem else newrank + rem


def _doubling(b: _Builder, n: int, r: int) -> None:
    """Recursive doubling (recursive.allreduce_doubling)."""
    if n == 1:
        return
    a, tmp = b.a, b.scratch(b.a.size)
    p, rem, me = _fold(b, n, r, tmp)
    if me >= 0:
        mask = 1
        while mask < p:
            peer = _real(me ^ mask, rem)
            b.transfer([(a, peer)], [(tmp, peer)])
            b.reduce(a, tmp)
            mask <<= 1
    _unfold(b, r, rem)


def _halving_doubling(b: _Builder, n: int, r: int) -> None:
    """Rabenseifner's reduce-scatter by halving, all-gather by doubling
    (recursive.allreduce_halving_doubling)."""
    if n == 1:
        return
    a, tmp = b.a, b.scratch(b.a.size)
    p, rem, me = _fold(b, n, r, tmp)
    if me >= 0:
        off = offsets(even_counts(a.size, p))
        lo, hi, mask = 0, p, p >> 1
        while mask:
            peer = _real(me ^ mask, rem)
            mid = (lo + hi) // 2
            keep, give = ((mid, hi), (lo, mid)) if me & mask else ((lo, mid), (mid, hi))
            mine = a[off[keep[0]]:off[keep[1]]]
            got = tmp[:mine.size]
            b.transfer([(a[off[give[0]]:off[give[1]]], peer)], [(got, peer)])
            b.reduce(mine, got)
            lo, hi = keep
            mask >>= 1
        mask = 1
        while mask < p:
            peer = _real(me ^ mask, rem)
            width = hi - lo
            plo = lo + width if (me & mask) == 0 else lo - width
            b.transfer([(a[off[lo]:off[hi]], peer)], [(a[off[plo]:off[plo + width]], peer)])
            lo, hi = min(lo, plo), max(hi, plo + width)
            mask <<= 1
    _unfold(b, r, rem)


def _tree(b: _Builder, n: int, vr: int) -> None:
    """Binomial-tree reduce to rank 0, then binomial-tree broadcast (tree.allreduce)."""
    a = b.a
    tmp = b.scratch(a.size) if n > 1 else None
    mask = 1
    while mask < n:
        if vr & mask:
            b.transfer(sends=[(a, vr - mask)])
            break
        if (vr | mask) < n:
            b.transfer(recvs=[(tmp, vr | mask)])
            b.reduce(a, tmp)
        mask <<= 1
    mask = 1
    while mask < n:
        if vr & mask:
            b.transfer(recvs=[(a, vr - mask)])
            break
        mask <<= 1
    mask >>= 1
    while mask:
        if vr + mask < n:
            b.transfer(sends=[(a, vr + mask)])
        mask >>= 1


def _ps(b: _Builder, n: int, r: int) -> None:
    """Everything to rank 0, reduced there in rank order, sent back (ps.allreduce, one segment)."""
    a = b.a
    if n == 1 or a.size == 0:
        return
    if r != 0:
        tmp = b.scratch(a.size)
        b.transfer([(a, 0)], [(tmp, 0)])
        b.copy(a, tmp)
        return
    rows = b.scratch((n - 1, a.size))
    b.transfer(recvs=[(rows[i], i + 1) for i in range(n - 1)])
    for row in rows:
        b.reduce(a, row)
    b.transfer(sends=[(a, dst) for dst in range(1, n)])


def _native(b: _Builder, n: int, r: int) -> None:
    """The MPI library's own all-reduce, in place (not psrt's schedule: a fast path)."""
    from mpi4py import MPI
    b.steps.append((b.comm.Allreduce, (MPI.IN_PLACE, b.a, _mpi_op(b.ufunc))))


@functools.lru_cache(maxsize=None)
def _mpi_op(ufunc):
    from mpi4py import MPI
    return {np.add: MPI.SUM, np.multiply: MPI.PROD, np.maximum: MPI.MAX, np.minimum: MPI.MIN,
            np.bitwise_and: MPI.BAND, np.bitwise_or: MPI.BOR, np.bitwise_xor: MPI.BXOR}[ufunc]


# psrt's own schedules, and their tags (those of ring.py, recursive.py, tree.py, ps.py)
ALLREDUCE = {"ring": (_ring, TAG_RING), "doubling": (_doubling, TAG_RD),
             "halving-doubling": (_halving_doubling, TAG_RHD), "tree": (_tree, TAG_TREE), "ps": (_ps, TAG_PS)}
# ... and the MPI library's call, for the Communicator's ready-made calls
FAST = dict(ALLREDUCE, native=(_native, 0))


def plan(algo: str, comm, a: np.ndarray, ufunc, persistent: bool = False) -> Plan:
    """The all-reduce `algo` of the flat array `a` over `comm` with `ufunc`, made ready."""
    build, tag = FAST[algo]
    b = _Builder(comm, a, ufunc, tag, persistent and algo != "native")
    build(b, comm.Get_size(), comm.Get_rank())
    return Plan(b.steps, b.requests, b.nbytes)


def allreduce(algo: str, comm, a: np.ndarray, ufunc) -> None:
    """One all-reduce of `a` in place, for a buffer that is not reduced again."""
    plan(algo, comm, a, ufunc)()
