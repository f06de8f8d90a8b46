"""Timed rounds: the one timing loop of every benchmark that times calls on MPI ranks.

nccl-tests' shape (src/common.cu): untimed warm-up calls, then rounds of back-to-back calls
between barriers, each round's time being the slowest rank's (a collective, or a training
step, is over when the last rank is done), and the median over rounds reported, with the
spread beside it.  Several things timed together run interleaved (A B C, A B C, ...), so a
change of machine load during the run hits all of them alike and their ratios hold.

A benchmark that times whole MPI jobs (suite, tune, network, oversubscription) takes the
times those jobs' own ranks measured with this module.
"""
from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Mapping


@dataclass(frozen=True)
class Timing:
    """Seconds per call of one timed thing, per round: the slowest and the fastest rank's."""
    slowest: tuple[float, ...]
    fastest: tuple[float, ...]
    calls: int = 1              # calls per round

    @property
    def median(self) -> float:
        """The figure a benchmark reports: the median round of the slowest rank (nan: no round)."""
        return statistics.median(self.slowest) if self.slowest else float("nan")

    @property
    def mean(self) -> float:
        return statistics.mean(self.slowest) if self.slowest else float("nan")

    @property
    def fastest_median(self) -> float:
        """The same of the fastest rank: how far the ranks were apart."""
        return statistics.median(self.fastest) if self.fastest else float("nan")

    @property
    def spread(self) -> tuple[float, float]:
        """(best, worst) round of the slowest rank."""
        return (min(self.slowest), max(self.slowest)) if self.slowest else (float("nan"),) * 2


def one_round(comm, call: Callable[[], object], calls: int = 1) -> tuple[float, float]:
    """(slowest, fastest) rank's seconds per call over `calls` back-to-back calls, all ranks
    starting together after a barrier."""
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    per = comm.allgather((time.perf_counter() - t0) / calls)
    return max(per), min(per)


def calls_for(comm, call: Callable[[], object], min_time_s: float, most: int = 1000) -> int:
    """How many calls make a round last about `min_time_s`, from one call timed on rank 0
    (its answer holds for every rank: they must make the same number of calls)."""
    t0 = time.perf_counter()
    call()
    dt = max(time.perf_counter() - t0, 1e-7)
    return comm.bcast(max(1, min(most, int(min_time_s / dt))), root=0)


def interleaved(comm, calls: Mapping[str, Callable[[], object]], repeats: int, warmup: int = 0,
                per_round: int | Mapping[str, int] = 1, min_time_s: float | None = None,
                most: int = 1000, on_round: Callable[[str], None] | None = None) -> dict[str, Timing]:
    """Each of `calls` timed in `repeats` interleaved rounds, after `warmup` untimed calls of
    each.  A round makes `per_round` calls (one count, or one per name), or with `min_time_s`
    as many as last about that long (at most `most`).  `on_round(name)` follows each name's
    warm-up and each of its rounds (a progress display)."""
    counts = {}
    for name, call in calls.items():
        for _ in range(warmup):
            call()
        if min_time_s is not None:
            counts[name] = calls_for(comm, call, min_time_s, most)
        else:
            counts[name] = per_round if isinstance(per_round, int) else per_round[name]
        if on_round and warmup:
            on_round(name)
    slow: dict[str, list[float]] = {name: [] for name in calls}
    fast: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            s, f = one_round(comm, call, counts[name])
            slow[name].append(s)
            fast[name].append(f)
            if on_round:
                on_round(name)
    return {name: Timing(tuple(slow[name]), tuple(fast[name]), counts[name]) for name in calls}


def timed(comm, call: Callable[[], object], repeats: int, warmup: int = 0, per_round: int = 1,
          min_time_s: float | None = None, most: int = 1000) -> Timing:
    """One thing timed alone: `interleaved` with a single entry."""
    return interleaved(comm, {"": call}, repeats, warmup, per_round, min_time_s, most)[""]


def cycling(items: list, step: Callable[[object], object]) -> Callable[[], object]:
    """A zero-argument call that runs `step` on the next of `items`, round and round (the
    batches of a timed training step)."""
    batches = itertools.cycle(items)
    return lambda: step(next(batches))


def ticker(progress) -> Callable[[str], None] | None:
    """An `on_round` for `interleaved` that moves a psrt.train.report.Progress on by one."""
    if progress is None:
        return None
    done = itertools.count(1)
    return lambda name: progress.update(next(done), name)
