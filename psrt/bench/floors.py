"""The floor of psrt's own all-reduces: each schedule written directly in mpi4py over NumPy
arrays, as a program without psrt would write it, for `bench collectives` to time psrt's calls
against (`mpi4py-ring`, `mpi4py-ps`, ...).

Nothing here comes from psrt: no plan, no cached slices, no psrt function; only mpi4py and
NumPy, and integer arithmetic done on each call.  Each function sums `a` over `comm` in
place, with `tmp` scratch at least a's size (the parameter server's rank 0 needs N-1 rows of
it).  The algorithms are the textbook ones psrt implements: the ring (Patarasuk & Yuan, JPDC
2009), recursive doubling and halving-doubling with non-powers of two folded onto the nearest
power (Thakur, Rabenseifner & Gropp, IJHPCA 2005), a binomial tree to rank 0 and back, and
every rank to rank 0 and back.

The call shapes mirror psrt's: `out` (copy the input into a held result, then reduce it),
`inplace` (reduce the array itself), `new` (a fresh result array per call) and `async` (the
call handed to a worker thread, which a program needs for a non-blocking call, and waited on).
"""
from __future__ import annotations

import queue
import threading

import numpy as np
from mpi4py import MPI

TAG = 777


def ring(comm, a, tmp) -> None:
    n, r = comm.size, comm.rank
    if n == 1:
        return
    base, extra = divmod(a.size, n)

    def chunk(i):
        lo = i * base + min(i, extra)
        return a[lo:lo + base + (i < extra)]
    right, left = (r + 1) % n, (r - 1) % n
    for k in range(n - 1):
        mine = chunk((r - k - 2) % n)
        got = tmp[:mine.size]
        comm.Sendrecv(chunk((r - k - 1) % n), right, TAG, got, left, TAG)
        mine += got
    for k in range(n - 1):
        comm.Sendrecv(chunk((r - k) % n), right, TAG, chunk((r - k - 1) % n), left, TAG)


def _power_of_two(comm, a, tmp, body) -> None:
    """Fold N ranks onto the largest power of two p <= N (each even rank below 2(N-p) hands
    its array to the next odd one and sits out), run body(p, me, peer_of), unfold."""
    n, r = comm.size, comm.rank
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    if r < 2 * rem and r % 2 == 0:
        comm.Send(a, r + 1, TAG)
        comm.Recv(a, r + 1, TAG)
        return
    if r < 2 * rem:
        comm.Recv(tmp[:a.size], r - 1, TAG)
        a += tmp[:a.size]
    me = r // 2 if r < 2 * rem else r - rem
    body(p, me, lambda v: 2 * v + 1 if v < rem else v + rem)
    if r < 2 * rem:
        comm.Send(a, r - 1, TAG)


def doubling(comm, a, tmp) -> None:
    if comm.size == 1:
        return

    def body(p, me, real):
        got = tmp[:a.size]
        d = 1
        while d < p:
            peer = real(me ^ d)
            comm.Sendrecv(a, peer, TAG, got, peer, TAG)
            np.add(a, got, out=a)
            d *= 2
    _power_of_two(comm, a, tmp, body)


def halving_doubling(comm, a, tmp) -> None:
    if comm.size == 1:
        return

    def body(p, me, real):
        base, extra = divmod(a.size, p)

        def start(i):
            return i * base + min(i, extra)
        lo, hi, d = 0, p, p // 2
        while d:                                     # reduce-scatter, halving the range
            peer, mid = real(me ^ d), (lo + hi) // 2
            keep, give = ((mid, hi), (lo, mid)) if me & d else ((lo, mid), (mid, hi))
            mine = a[start(keep[0]):start(keep[1])]
            got = tmp[:mine.size]
            comm.Sendrecv(a[start(give[0]):start(give[1])], peer, TAG, got, peer, TAG)
            mine += got
            lo, hi = keep
            d //= 2
        d = 1
        while d < p:                                 # all-gather, doubling it
            peer, width = real(me ^ d), hi - lo
            other = lo + width if not me & d else lo - width
            comm.Sendrecv(a[start(lo):start(hi)], peer, TAG, a[start(other):start(other + width)], peer, TAG)
            lo, hi = min(lo, other), max(hi, other + width)
            d *= 2
    _power_of_two(comm, a, tmp, body)


def tree(comm, a, tmp) -> None:
    n, r = comm.size, comm.rank
    got = tmp[:a.size]
    d = 1
    while d < n and not r & d:                       # reduce up the binomial tree to rank 0
        if r + d < n:
            comm.Recv(got, r + d, TAG)
            a += got
        d *= 2
    if d < n:
        comm.Send(a, r - d, TAG)
        comm.Recv(a, r - d, TAG)                     # the result comes back the same way
    d //= 2
    while d:
        if r + d < n:
            comm.Send(a, r + d, TAG)
        d //= 2


def ps(comm, a, tmp) -> None:
    n = comm.size
    if n == 1 or a.size == 0:
        return
    if comm.rank:
        got = tmp[:a.size]
        comm.Sendrecv(a, 0, TAG, got, 0, TAG)
        a[:] = got
        return
    rows = tmp[:(n - 1) * a.size].reshape(n - 1, a.size)
    MPI.Request.Waitall([comm.Irecv(rows[i], i + 1, TAG) for i in range(n - 1)])
    for row in rows:
        a += row
    MPI.Request.Waitall([comm.Isend(a, i, TAG) for i in range(1, n)])


SCHEDULES = {"ring": ring, "doubling": doubling, "halving-doubling": halving_doubling, "tree": tree, "ps": ps}


class Worker:
    """A thread running the calls handed to it, in order; `run(fn)` returns a waitable."""

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            fn, done = self.jobs.get()
            if fn is None:
                return
            fn()
            done.release()

    def run(self, fn) -> threading.Lock:
        done = threading.Lock()
        done.acquire()
        self.jobs.put((fn, done))
        return done

    def close(self) -> None:
        self.jobs.put((None, None))
        self.thread.join()


def call(comm, algorithm: str, shape: str, x: np.ndarray, out: np.ndarray, worker: Worker | None = None):
    """A zero-argument call of the floor of `algorithm` in call shape `shape` on x (and out)."""
    fn = SCHEDULES[algorithm]
    tmp = np.empty(max(comm.size - 1, 1) * x.size, dtype=x.dtype)
    if shape == "inplace":
        def in_place():
            fn(comm, x, tmp)
            return x
        return in_place
    if shape == "new":
        def fresh():
            a = x.copy()
            fn(comm, a, tmp)
            return a
        return fresh
    if shape == "async":
        def run():
            fn(comm, x, tmp)

        def asynchronous():
            worker.run(run).acquire()
            return x
        return asynchronous

    def held():
        np.copyto(out, x)
        fn(comm, out, tmp)
        return out
    return held
