"""Every rank agrees on a collective call before any byte of it moves.

MPI does not check that the ranks' calls match.  Counts that differ in one rank's
MPI_Allreduce are erroneous (MPI 4.1 sec. 6.9.6: count and datatype must be the same on all
processes) and Open MPI answers with MPI_ERR_TRUNCATE, a wrong result or a corrupted heap
(4M against 5M floats: `double free or corruption`), depending on the size; psrt's own
schedules move point-to-point messages, where a message shorter than the receive buffer is
received without an error (MPI 4.1 sec. 3.2.4), so a mismatch there gives a wrong sum on one
rank and a truncation or a hang on another.  So, before a call moves data, the ranks agree on
what it is:

- 'cheap' (the default): each rank makes a 62-bit fingerprint of (collective, arguments)
  and one all-reduce (MAX) of (f, -f) on a communicator of its own gives every rank the
  largest and the smallest fingerprint.  They are equal exactly when every rank called the
  same thing: 16 bytes, one latency of the MPI library's own all-reduce per call.

The agreement is also where a rank waits for a peer that is late to the call (or never
comes): it is non-blocking (MPI_Iallreduce) and waited on by polling, for a millisecond and
then sleeping up to a millisecond between polls, so a waiting rank leaves its core to the others
instead of busy-polling inside MPI for as long as the peer takes.  It costs about 3 us more
per call than a blocking MPI_Allreduce (Open MPI 4.1, 2 ranks on one host: 7.0 against 3.8
us for the 16 bytes alone).
- 'all': every rank's (collective, arguments) is gathered on every call (a debugging mode:
  it also compares what the fingerprint leaves out).
- 'off': nothing.

When they disagree, every rank learns it from the same all-reduce, gathers every rank's
description and raises the same CollectiveMismatch naming each rank's call; nothing of the
call has moved.
"""
from __future__ import annotations

import hashlib
import time

import numpy as np

from psrt.errors import CollectiveMismatch

_MASK = (1 << 62) - 1       # fingerprints stay positive and their negation fits an int64
_CACHE = 4096               # signatures whose fingerprint is kept


def fingerprint(signature: tuple) -> int:
    """A fingerprint of a call's signature that is the same in every process (Python's own
    hash() of a string differs between processes)."""
    digest = hashlib.blake2b(repr(signature).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK


def show(description: tuple) -> str:
    """`allreduce(op=sum, shape=(4,), ...)` from a (name, ((key, value), ...)) description."""
    name, items = description
    return name + "(" + ", ".join(f"{k}={v}" for k, v in items) + ")"


SPIN_S = 1e-3                   # polled without sleeping for this long first
CROWDED_SPIN_S = 2e-5           # the same where ranks outnumber the cores
MAX_PAUSE_S = 1e-3              # then slept between polls, at most this long


def spin_for(crowd: float) -> float:
    """How long `wait` polls before it sleeps, given the ranks per core on the most crowded
    machine (psrt.world.crowding): where ranks outnumber the cores, the peer a rank waits for
    may need the very core it would poll on (a 4-rank run of every collective on 2 cores, alone
    on the machine, took 12-24% less CPU time polling for 20 us than for 1 ms)."""
    return SPIN_S if crowd <= 1.0 else CROWDED_SPIN_S


def wait(request, spin_s: float = SPIN_S) -> None:
    """Complete an MPI request without holding a core for long: test it in a loop for spin_s
    (a peer that is there, or nearly, answers within that: sleeping at once would add a
    timer's slack, about 50 us on Linux, to every call whose peer is a little late; Open
    MPI's progress inside the test yields the core when asked to, mpi_yield_when_idle),
    then sleep between tests with a doubling pause of at most MAX_PAUSE_S."""
    if request.Test():
        return
    spins, pause = 0, 5e-5
    deadline = time.monotonic() + spin_s
    while not request.Test():
        spins += 1
        if spins & 63 == 0 and time.monotonic() > deadline:
            time.sleep(pause)
            pause = min(MAX_PAUSE_S, pause * 2)


class Agreement:
    """The per-call agreement of one Communicator (see the module's docstring).

    Args:
        meta: a communicator used for nothing else (a Dup), so the agreement never matches a
            message of the data it guards.
        mode: 'all', 'cheap' or 'off'.
        crowd: ranks per core on the most crowded machine (how long a wait polls: spin_for).
    """

    def __init__(self, meta, mode: str, crowd: float = 1.0):
        from mpi4py import MPI
        self.meta, self.mode, self._max = meta, mode, MPI.MAX
        self.spin_s = spin_for(crowd)
        self._send = np.zeros(2, dtype=np.int64)
        self._recv = np.zeros(2, dtype=np.int64)
        self._prints: dict = {}

    def signature(self, name: str, signature: dict) -> tuple:
        return (name, tuple(sorted((k, str(v)) for k, v in signature.items())))

    def fingerprint_of(self, sig: tuple) -> int:
        fp = self._prints.get(sig)
        if fp is None:
            if len(self._prints) >= _CACHE:
                self._prints.clear()
            fp = self._prints[sig] = fingerprint(sig)
        return fp

    def agree(self, call: int, sig: tuple, shown: tuple = (), fp: int | None = None) -> None:
        """Return when every rank makes call number `call` with signature `sig`; else raise
        CollectiveMismatch on every rank.  `shown` adds (key, value) pairs that are only
        named in the message (a tensor's shape where the call needs only its size agreed)."""
        if self.mode == "off":
            return
        if self.mode == "all":
            self._differ(call, sig, shown)
            return
        f = self.fingerprint_of(sig) if fp is None else fp
        send, recv = self._send, self._recv
        send[0], send[1] = f, -f
        wait(self.meta.Iallreduce(send, recv, self._max), self.spin_s)
        if recv[0] != f or recv[1] != -f:
            self._differ(call, sig, shown)

    def _differ(self, call: int, sig: tuple, shown: tuple) -> None:
        """Gather every rank's call and raise when any differs from rank 0's."""
        every = self.meta.allgather((sig, (sig[0], tuple(sorted(sig[1] + tuple(shown))))))
        bad = [r for r, (s, _) in enumerate(every) if s != every[0][0]]
        if not bad:
            return
        listing = "; ".join(f"rank {r}: {show(d)}" for r, (_, d) in enumerate(every))
        raise CollectiveMismatch(f"collective call #{call} does not match across ranks: "
                                 f"ranks {bad} differ from rank 0 ({listing})", everywhere=True)



def agree_shapes(meta, t, what: str) -> list[tuple]:
    """Every rank's shape of t (gathered on `meta`), checking that all but dim 0 and the
    dtype agree."""
    mine = (tuple(t.shape), str(t.dtype))
    shapes = meta.allgather(mine)
    ref_tail, ref_dtype = shapes[0][0][1:], shapes[0][1]
    bad = [r for r, (s, d) in enumerate(shapes) if s[1:] != ref_tail or d != ref_dtype or not s]
    if bad:
        listing = ", ".join(f"rank {r}: {s} {d}" for r, (s, d) in enumerate(shapes))
        raise CollectiveMismatch(f"{what}: ranks {bad} disagree with rank 0 on trailing shape or "
                                 f"dtype ({listing})")
    return [s for s, _ in shapes]


def agree_pairs(meta, send_counts: list[int], recv_counts: list[int]) -> None:
    """An all-to-all's counts: every rank's receive counts are N non-negative numbers, and what
    rank i sends to j is what j expects from i (gathered on `meta`, so every rank names the
    same culprits)."""
    size = meta.Get_size()
    every = meta.allgather((send_counts, recv_counts))
    sends, recvs = [s for s, _ in every], [r for _, r in every]
    malformed = [r for r, c in enumerate(recvs) if len(c) != size or min(c, default=0) < 0]
    if malformed:
        listing = "; ".join(f"rank {r}: {recvs[r]}" for r in malformed)
        raise CollectiveMismatch(f"alltoallv: receive counts must be {size} non-negative numbers "
                                 f"on every rank ({listing})", everywhere=True)
    bad = [(i, j) for i in range(size) for j in range(size) if sends[i][j] != recvs[j][i]]
    if bad:
        listing = "; ".join(f"rank {i} sends {sends[i][j]} rows to rank {j}, which expects "
                            f"{recvs[j][i]}" for i, j in bad[:4])
        raise CollectiveMismatch(f"alltoallv: counts disagree between ranks ({listing})",
                                 everywhere=True)
