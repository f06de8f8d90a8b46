"""One description of each of psrt's own schedules, run two ways.

An algorithm (ring.py, recursive.py, tree.py, ps.py) writes its schedule once, as a function
`schedule(b, ...)` of a builder `b` that holds the flat buffer `b.a` (a torch tensor or a
NumPy array: the schedule only slices it) and offers these steps:

- `scratch(shape)`: a buffer like `b.a`, for what arrives before it is reduced;
- `transfer(sends, recvs)`: send each (buffer, peer) of sends, receive into each (buffer,
  peer) of recvs, all at once; the step ends when all are complete;
- `start(sends, recvs)` and `complete(handle)`: the same, split, so that transfers overlap the
  steps between them (the parameter server's pipeline);
- `send_reduce(send, right, dst, mine, left, tmp)`: send `send` to `right` while receiving
  len(dst) elements from `left` into `tmp`, and dst <- mine (op) received (the ring's step);
- `reduce(dst, src)`: dst <- dst (op) src; `copy(dst, src)`.

A builder also has `itemsize` (bytes per element) and `window` (the most elements of one
incoming ring chunk it holds in scratch at once; None: all).  Two builders run every schedule:

- `Eager` (torch tensors, CPU or CUDA): each step runs as it is described, as torch kernels
  and MPI calls on the tensors' memory; the path of every call above SMALL_BYTES, of CUDA
  tensors and of 16-bit floats (psrt/collectives/paths.py, General).
- `Recorder` (NumPy arrays): the steps are recorded once into a `Plan`, a flat list of
  (function, arguments) on fixed slices of a fixed array, that a call then runs: nothing is
  sliced, allocated or looked up again (psrt/collectives/small.py, the small CPU calls).

So the two paths send the same messages, with the same tags, to the same peers, in the same
order, and reduce in the same order: a rank on one path and its peer on the other still match,
and their bits are the same.  Both cut a transfer of the ring into the same segments
(PSRT_RING_SEGMENT); the eager one reduces each as it lands.
"""
from __future__ import annotations

import numpy as np
import torch

from psrt import env
from psrt.transport import msg, reduce_into

# The eager ring receives at most this many segments into scratch at once.
WINDOW_SEGMENTS = 64


def segments(start: int, stop: int, seg: int) -> list[tuple[int, int]]:
    """[start, stop) cut into pieces of at most `seg` elements (one empty piece if empty)."""
    return [(a, min(a + seg, stop)) for a in range(start, stop, seg)] or [(start, start)]


def segment_elems(itemsize: int, segment: int | None = None) -> int:
    return max(1, (segment or env.ring_segment_bytes()) // itemsize)


def _waitall(requests: list) -> None:
    from mpi4py import MPI
    MPI.Request.Waitall(requests)


def post(comm, sends=(), recvs=(), tag: int = 0) -> list:
    """Start the sends, then the receives, of torch tensors: (tensor, peer) pairs.

    Sends go first.  A large message goes by rendezvous: its header out, the receiver's
    go-ahead back, then the data (Open MPI's ob1 over TCP).  Where a rank arrives late at a
    step whose peer already sent it a header, posting its receive first sends the go-ahead
    before its own header, so the peer starts its bulk data at once and the go-ahead for the
    late rank's header queues behind that data on the one connection between them: the two
    directions of a two-rank exchange ran one after the other, a whole chunk's transfer late
    (psrt.collectives.ring on 2 emulated hosts: 157 ms against 107 ms for 3 MiB at
    250 Mbit/s).  Header first, both flow."""
    return [comm.Isend(msg(b), p, tag) for b, p in sends] + [comm.Irecv(msg(b), p, tag) for b, p in recvs]


def transfer(comm, sends=(), recvs=(), tag: int = 0) -> None:
    """Move (tensor, peer) sends and receives and wait for them: MPI_Sendrecv for one small
    exchange, MPI_Send or MPI_Recv alone, else `post` (not Sendrecv, which posts its receive
    first) and MPI_Waitall."""
    if _small_exchange(sends, recvs):
        (sb, dst), (rb, src) = sends[0], recvs[0]
        comm.Sendrecv(msg(sb), dst, tag, msg(rb), src, tag)
    elif len(sends) == 1 and not recvs:
        comm.Send(msg(sends[0][0]), sends[0][1], tag)
    elif len(recvs) == 1 and not sends:
        comm.Recv(msg(recvs[0][0]), recvs[0][1], tag)
    else:
        _waitall(post(comm, sends, recvs, tag))


class Eager:
    """Runs a schedule's steps at once on torch tensors (the module's docstring)."""

    def __init__(self, comm, a: torch.Tensor, op: str, tag: int, segment: int | None = None):
        self.comm, self.a, self.op, self.tag = comm, a, op, tag
        self.itemsize = a.element_size()
        self.seg = segment_elems(self.itemsize, segment)
        self.window = self.seg * WINDOW_SEGMENTS

    def scratch(self, shape) -> torch.Tensor:
        return torch.empty(shape, dtype=self.a.dtype, device=self.a.device)

    def start(self, sends=(), recvs=()) -> list:
        return post(self.comm, sends, recvs, self.tag)

    def complete(self, handle: list) -> None:
        _waitall(handle)

    def transfer(self, sends=(), recvs=()) -> None:
        transfer(self.comm, sends, recvs, self.tag)

    def send_reduce(self, send, right: int, dst, mine, left: int, tmp) -> None:
        """Segments of `send` go out at once; the incoming ones are received in windows of
        `tmp` and each reduced as soon as it lands, while later ones are still in flight, so
        the reduction works on a cache-sized piece."""
        c, tag, seg, op = self.comm, self.tag, self.seg, self.op
        sends = [c.Isend(msg(send[a:b]), right, tag) for a, b in segments(0, len(send), seg)]
        hi, width = len(dst), max(len(tmp), 1)
        for w0 in range(0, max(hi, 1), width):
            w1 = min(w0 + width, hi)
            parts = segments(w0, w1, seg)
            reqs = [c.Irecv(msg(tmp[a - w0:b - w0]), left, tag) for a, b in parts]
            for (a, b), req in zip(parts, reqs):
                req.Wait()
                reduce_into(dst[a:b], mine[a:b], tmp[a - w0:b - w0], op)
        _waitall(sends)

    def reduce(self, dst, src) -> None:
        reduce_into(dst, dst, src, self.op)

    def copy(self, dst, src) -> None:
        dst.copy_(src)


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


# Sends are posted before receives on both paths (why: `post`).  Below Open MPI's TCP
# eager limit (btl_tcp_eager_limit) a message needs no go-ahead, so the order is moot there
# and one small exchange keeps MPI_Sendrecv, the cheapest call for it.
RENDEZVOUS_BYTES = 64 << 10


def _small_exchange(sends, recvs) -> bool:
    """One send and one receive of a message under the eager limit (torch tensors or buffers)."""
    return len(sends) == 1 and len(recvs) == 1 and sends[0][0].nbytes < RENDEZVOUS_BYTES


def _exchange(comm, recvs: tuple, sends: tuple, tag: int) -> None:
    from mpi4py import MPI
    MPI.Request.Waitall([comm.Isend(b, p, tag) for b, p in sends] + [comm.Irecv(b, p, tag) for b, p in recvs])


def _post(held: list, comm, recvs: tuple, sends: tuple, tag: int) -> None:
    held[:] = [comm.Isend(b, p, tag) for b, p in sends] + [comm.Irecv(b, p, tag) for b, p in recvs]


def _start_wait(requests: list) -> None:
    from mpi4py import MPI
    MPI.Prequest.Startall(requests)
    MPI.Request.Waitall(requests)


def _start(requests: list) -> None:
    from mpi4py import MPI
    MPI.Prequest.Startall(requests)


class _Started:
    """A `Recorder.start` not yet completed: its step, and what it moves."""

    __slots__ = ("step", "sends", "recvs", "requests")

    def __init__(self, sends, recvs):
        self.sends, self.recvs, self.step, self.requests = tuple(sends), tuple(recvs), None, []


class Recorder:
    """Records a schedule's steps on a NumPy array into a Plan (the module's docstring).  With
    `persistent`, each transfer is a set of persistent requests (MPI_Send_init / MPI_Recv_init,
    MPI 4.1 sec. 3.9) started and completed together, instead of MPI_Sendrecv / MPI_Send /
    MPI_Recv."""

    def __init__(self, comm, a: np.ndarray, ufunc, tag: int, persistent: bool = False):
        self.comm, self.a, self.ufunc, self.tag, self.persistent = comm, a, ufunc, tag, persistent
        self.itemsize = a.itemsize
        self.seg = segment_elems(self.itemsize)
        self.window = None          # the whole incoming chunk in scratch
        self.steps: list = []
        self.requests: list = []
        self.nbytes = 0

    def plan(self) -> Plan:
        return Plan(self.steps, self.requests, self.nbytes)

    def scratch(self, shape) -> np.ndarray:
        tmp = np.empty(shape, dtype=self.a.dtype)
        self.nbytes += tmp.nbytes
        return tmp

    def transfer(self, sends=(), recvs=()) -> None:
        c, tag = self.comm, self.tag
        if self.persistent:
            reqs = [c.Send_init(b, p, tag) for b, p in sends] + [c.Recv_init(b, p, tag) for b, p in recvs]
            self.requests += reqs
            self.steps.append((_start_wait, (reqs,)))
        elif _small_exchange(sends, recvs):
            (sb, dst), (rb, src) = sends[0], recvs[0]
            self.steps.append((c.Sendrecv, (sb, dst, tag, rb, src, tag)))
        elif len(sends) == 1 and not recvs:
            self.steps.append((c.Send, (sends[0][0], sends[0][1], tag)))
        elif len(recvs) == 1 and not sends:
            self.steps.append((c.Recv, (recvs[0][0], recvs[0][1], tag)))
        else:
            self.steps.append((_exchange, (c, tuple(recvs), tuple(sends), tag)))

    def start(self, sends=(), recvs=()) -> _Started:
        h = _Started(sends, recvs)
        c, tag = self.comm, self.tag
        if self.persistent:
            h.requests = [c.Send_init(b, p, tag) for b, p in h.sends] + [c.Recv_init(b, p, tag) for b, p in h.recvs]
            self.requests += h.requests
            h.step = (_start, (h.requests,))
        else:
            h.step = (_post, (h.requests, c, h.recvs, h.sends, tag))
        self.steps.append(h.step)
        return h

    def complete(self, h: _Started) -> None:
        if self.steps and self.steps[-1] is h.step:
            # nothing between the start and its end: one transfer, the cheapest MPI call for it
            self.steps.pop()
            self.requests = [r for r in self.requests if all(r is not q for q in h.requests)]
            for req in h.requests if self.persistent else ():
                req.Free()
            self.transfer(h.sends, h.recvs)
        else:
            self.steps.append((_waitall, (h.requests,)))

    def send_reduce(self, send, right: int, dst, mine, left: int, tmp) -> None:
        got = tmp[:len(dst)]
        seg = self.seg
        self.transfer([(send[a:b], right) for a, b in segments(0, len(send), seg)],
                      [(got[a:b], left) for a, b in segments(0, len(dst), seg)])
        self.steps.append((self.ufunc, (mine, got, dst)))

    def reduce(self, dst, src) -> None:
        self.steps.append((self.ufunc, (dst, src, dst)))

    def copy(self, dst, src) -> None:
        self.steps.append((np.copyto, (dst, src)))
