"""Whether a run's steps were bound by the host CPU: what a rank's scheduler statistics say.

An emulated accelerator host (--profile) leaves the arithmetic to timed waits, so the link
should bound each step.  Where the ranks' reductions, copies, the TCP stack, or other jobs
keep the host's cores busy, a rank that has work (a message arrived, a wait ended) waits for
a core first: the step is then the CPU's, and no link model explains it.  Linux counts that
wait per task: /proc/self/schedstat's second field is the time spent runnable but not
running (the run-queue delay; Documentation/scheduler/sched-stats.rst).  Its share of the
wall time, averaged over the ranks, is `run_queue`; above RUN_QUEUE_BOUND the run is marked
CPU-bound.  The process CPU time against wall time (`cpu_busy`) is reported beside it: high
where a rank computes or polls.  Neither needs privileges; on a system without schedstat
the run-queue share is unknown (None) and the run is not marked.

/proc/self/schedstat is the main thread's alone, and that is the one read on purpose: the
communicator's thread waits in MPI, whose blocking waits poll (with mpi_yield_when_idle a
sched_yield per poll), so it is runnable for as long as it waits and its run-queue time
counts polling, not delay (docs/explanation/scaling.md says what that leaves out).
"""
from __future__ import annotations

import time

# A rank that waited for a core for more than a fifth of the time was slowed by the CPU by
# about as much: beyond the measurement noise of a link-bound step (docs/explanation/scaling.md).
RUN_QUEUE_BOUND = 0.2


def sample() -> tuple[float, float, float | None]:
    """(wall seconds, this process's CPU seconds, its run-queue seconds or None)."""
    try:
        with open("/proc/self/schedstat") as f:
            waited = int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        waited = None
    return time.perf_counter(), time.process_time(), waited


def shares(start, end) -> dict:
    """{'cpu_busy': CPU share of the wall time, 'run_queue': run-queue share or None}."""
    wall = max(end[0] - start[0], 1e-9)
    queue = None if start[2] is None or end[2] is None else (end[2] - start[2]) / wall
    return {"cpu_busy": (end[1] - start[1]) / wall, "run_queue": queue}


def verdict(per_rank: list[dict]) -> dict:
    """The run's figures from every rank's shares: the means, and bound 'cpu' where the mean
    run-queue share passes RUN_QUEUE_BOUND (None: not CPU-bound, or unknown)."""
    busy = [r["cpu_busy"] for r in per_rank if r.get("cpu_busy") is not None]
    queue = [r["run_queue"] for r in per_rank if r.get("run_queue") is not None]
    mean_queue = sum(queue) / len(queue) if queue else None
    return {"cpu_busy": sum(busy) / len(busy) if busy else None, "run_queue": mean_queue,
            "cpu_bound": mean_queue is not None and mean_queue > RUN_QUEUE_BOUND}
