"""Ping-pong between two ranks: the one-way time of a message, per size.

The first rank sends m bytes, the last rank sends them back; half the round trip is the
one-way time T(m).  On a link that behaves like Hockney's model, T(m) = alpha + m * beta
(R. W. Hockney, "The communication challenge for MPP: Intel Paragon and Meiko CS-2",
Parallel Computing 20(3), 1994); psrt.collectives.cost fits the two numbers.  Run the two
ranks on different hosts (the first and last rank of a job with one rank per host) to
measure the link between them.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

TAG = 9


def raw_trips(comm, size: int):
    """The round trip of `size` bytes in a NumPy buffer, MPI_Send and MPI_Recv: the link as
    the MPI library sees it."""
    me, peer = comm.rank, comm.size - 1
    buf = np.zeros(max(size, 1), dtype=np.uint8)[:size]

    def trip() -> None:
        if me == 0:
            comm.Send(buf, peer, TAG)
            comm.Recv(buf, peer, TAG)
        elif me == peer:
            comm.Recv(buf, 0, TAG)
            comm.Send(buf, 0, TAG)
    return trip


def pingpong(comm, sizes: list[int], repeats: int = 5, min_time_s: float = 0.05, trips=raw_trips) -> list[dict]:
    """[{"nbytes", "one_way_s", "min_s", "max_s"}] measured between rank 0 and the last rank
    of `comm` (an mpi4py communicator); the other ranks only join the barriers.

    Each size is timed as `repeats` loops of round trips (`trips(comm, size)` gives one), a
    loop lasting about `min_time_s`; the median loop gives one_way_s, the fastest and
    slowest give the spread.
    """
    if comm.size < 2:
        raise ValueError("ping-pong needs at least 2 ranks")
    points = []
    for size in sizes:
        trip = trips(comm, size)
        loops = []
        count = 1
        for i in range(repeats + 1):           # the first loop warms up and sizes the others
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(count):
                trip()
            elapsed = comm.bcast(time.perf_counter() - t0, root=0)
            if i == 0:
                count = comm.bcast(max(1, min(1000, int(min_time_s / max(elapsed, 1e-7)))), root=0)
            else:
                loops.append(elapsed / count / 2)
        points.append({"nbytes": size, "one_way_s": statistics.median(loops),
                       "min_s": min(loops), "max_s": max(loops)})
    return points


def measure_fit(comm, sizes: list[int], repeats: int = 5, min_time_s: float = 0.05, attempts: int = 3,
                trips=raw_trips):
    """(points, fit, why): a ping-pong of `comm` (collective) and, on rank 0, its alpha-beta
    fit (psrt.collectives.cost.fit).  A busy host can make a larger message look no slower
    than a smaller one: then the ranks measure again, each time for longer, up to `attempts`
    times; if no fit came out, fit is None and `why` says why (rank 0; None elsewhere)."""
    from psrt.collectives import cost
    fit = why = None
    for attempt in range(attempts):
        points = pingpong(comm, sizes, repeats=repeats, min_time_s=min_time_s * (attempt + 1), trips=trips)
        if comm.rank == 0:
            try:
                fit, why = cost.fit(points), None
            except ValueError as err:
                why = f"{err} after {attempt + 1} ping-pongs (a busy host?)"
        if comm.bcast(fit is not None, root=0):
            break
    return points, fit, why
