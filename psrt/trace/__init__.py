"""A timeline of every rank: spans recorded per rank, gathered by rank 0 into one Chrome-trace
JSON (chrome://tracing, https://ui.perfetto.dev), drawn as a PNG by `python -m psrt.trace`.

A span is (name, category, thread, start, end, args).  Recording one costs a perf_counter_ns
call at each end and a tuple append; a disabled tracer (`OFF`, what every object holds unless
given one) costs an attribute test.  The tracer is passed explicitly: a Communicator carries
one (`group.tracer`), and the strategies, the pipeline runtime and the training loop record
through the tracer of the communicator they were given.

Categories (the PNG's colours): step (one training step, around the rest), compute
(forward, backward, optimizer), comm (a collective, with its algorithm and bytes; a DDP
bucket's all-reduce on psrt's communication thread; a pipeline send or receive), wait (a PS
server waiting for pushes, a worker blocked on its buckets or on Horovod), server (a PS
server's reduce, update and replies), pipeline (a stage's forward or backward of one
micro-batch).

Clocks: each rank's spans are in its own clock (`Tracer.clock`, perf_counter_ns unless
given; whatever records into a tracer reads the time from it).  At write time every rank
measures its offset to rank 0 by a ping-pong (Cristian, "Probabilistic clock
synchronization", Distributed Computing 3(3), 1989): rank 0's time at the reply, minus the
midpoint of the round trip, from the fastest of several round trips.  On one machine the
offset is ~0; across hosts it is what makes the ranks' spans line up.
"""
from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path

CATEGORIES = ("step", "compute", "comm", "wait", "server", "pipeline")
TAG = 31_337


class Tracer:
    """The spans of one rank, timed by `clock` (nanoseconds; default time.perf_counter_ns)."""

    def __init__(self, enabled: bool = True, clock=time.perf_counter_ns):
        self.on = enabled
        self.clock = clock
        self.events: list[tuple] = []       # (name, cat, thread, t0_ns, t1_ns, args)

    def span(self, name: str, cat: str, **args):
        """A context manager timing its body as one span (a shared do-nothing one when off)."""
        return _Span(self.events, name, cat, args, self.clock) if self.on else _NOTHING

    def add(self, name: str, cat: str, t0_ns: int, t1_ns: int, **args) -> None:
        """A span measured by the caller (self.clock() at both ends)."""
        if self.on:
            self.events.append((name, cat, threading.current_thread().name, t0_ns, t1_ns, args))

    def write(self, comm, path, host: str = "") -> None:
        """Gather every rank's spans to rank 0 (collective over the mpi4py `comm`) and write
        one Chrome-trace JSON there."""
        offset = clock_offset(comm, clock=self.clock)
        mine = {"rank": comm.rank, "host": host, "offset_ns": offset, "events": self.events}
        every = comm.gather(mine, root=0)
        if comm.rank == 0:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps(chrome_trace(every)) + "\n")


OFF = Tracer(enabled=False)     # shared and never recording: nothing in it changes
_NOTHING = contextlib.nullcontext()


class _Span:
    __slots__ = ("events", "name", "cat", "args", "clock", "t0")

    def __init__(self, events: list, name: str, cat: str, args: dict, clock):
        self.events, self.name, self.cat, self.args, self.clock = events, name, cat, args, clock

    def __enter__(self):
        self.t0 = self.clock()
        return self

    def __exit__(self, *exc) -> None:
        self.events.append((self.name, self.cat, threading.current_thread().name, self.t0,
                            self.clock(), self.args))


def clock_offset(comm, rounds: int = 8, clock=time.perf_counter_ns) -> int:
    """This rank's clock offset to rank 0 in ns (add it to a local time of `clock` to get
    rank 0's time); collective over the mpi4py `comm` (or anything with its rank, size,
    send and recv)."""
    best, offset = None, 0
    for peer in range(1, comm.size):
        for _ in range(rounds):
            if comm.rank == peer:
                t1 = clock()
                comm.send(None, dest=0, tag=TAG)
                t0 = comm.recv(source=0, tag=TAG)
                t3 = clock()
                if best is None or t3 - t1 < best:
                    best, offset = t3 - t1, t0 - (t1 + t3) // 2
            elif comm.rank == 0:
                comm.recv(source=peer, tag=TAG)
                comm.send(clock(), dest=peer, tag=TAG)
    return offset


def chrome_trace(ranks: list[dict]) -> dict:
    """The Chrome trace-event format ("X" complete events, microseconds; pid = rank, tid =
    the recording thread), times shifted to rank 0's clock and to start at 0."""
    starts = [e[3] + r["offset_ns"] for r in ranks for e in r["events"]]
    zero = min(starts) if starts else 0
    events = []
    for r in ranks:
        rank = r["rank"]
        events.append({"ph": "M", "name": "process_name", "pid": rank,
                       "args": {"name": f"rank {rank}" + (f" ({r['host']})" if r["host"] else "")}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
        threads = list(dict.fromkeys(e[2] for e in r["events"]))
        for tid, thread in enumerate(threads):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": thread}})
        for name, cat, thread, t0, t1, args in r["events"]:
            events.append({"ph": "X", "name": name, "cat": cat, "pid": rank, "tid": threads.index(thread),
                           "ts": (t0 + r["offset_ns"] - zero) / 1e3, "dur": (t1 - t0) / 1e3, "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "psrt", "clock": "rank 0's perf_counter, offsets by ping-pong",
                          "offsets_ns": {str(r["rank"]): r["offset_ns"] for r in ranks}}}
