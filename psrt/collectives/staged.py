"""The pipelined staging path: CUDA collectives through an MPI that cannot read GPU memory.

Staging the whole tensor (copy it down to the host, reduce, copy it up) leaves the copy
engines idle while MPI runs and MPI idle while they copy.  Here the tensor moves in pieces
through a pool of pinned host slots allocated once, and three stages overlap (the schedule
of MVAPICH2-GDR's and Open MPI's pipelined device-to-host transfers):

    copy piece i+1 down  |  piece i's MPI work across the ranks on the host  |  copy piece i-1 up

The copies run on two streams of their own, one per direction, so both directions of the
PCIe link are busy at once; one event per copy tells the host when its piece has arrived
and tells the down stream when a slot's previous piece has left it.  With three slots a slot
is written again only once the piece that used it three pieces before has gone back up.  The
MPI work of each piece is the algorithm the call asked for, on the host: the copies are not
what limits a staged all-reduce (pinned copies run at tens of GB/s per direction; the host
reduction between ranks is the slow stage), so the pipelined time is about the largest of
the three stages plus one piece's fill, the model `staged_time` states and the bench prints.

What a piece of each collective is (a chunk of an all-reduce, columns of every rank's
segment for a reduce-scatter, a block of an all-to-all) is in staged_plans.py; `pipeline`
runs any list of them.  It takes its copy engine as `lanes`: `CudaLanes` on a GPU; the CPU
suite drives the same schedule with lanes whose copies run late, only when an event is
waited for, so a missing wait shows as a wrong result (tests/unit/test_staged.py,
tests/mpi/ranks/staged_calls.py).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from psrt import env

CHUNK_BYTES = 4 << 20      # the ring's segment size: large enough for full-speed copies and MPI
SLOTS = 3                  # one chunk going down, one being reduced, one going up


def chunks(numel: int, chunk: int) -> list[tuple[int, int]]:
    """(start, length) of each chunk of a flat tensor of `numel` elements; the last may be
    shorter, and there are none for an empty tensor."""
    return [(s, min(chunk, numel - s)) for s in range(0, numel, chunk)]


def schedule(n: int) -> list[tuple[str, int]]:
    """The order in which the host issues the stages of n pieces: ('down', 0), then per piece
    i the next piece's copy down, piece i's MPI work ('reduce'), piece i's copy up.  While
    piece i is worked on, piece i+1 goes down and piece i-1 goes up."""
    order = [("down", 0)] if n else []
    for i in range(n):
        if i + 1 < n:
            order.append(("down", i + 1))
        order += [("reduce", i), ("up", i)]
    return order


def staged_time(nbytes: int, down_bps: float, up_bps: float, reduce_s, chunk_bytes: int = CHUNK_BYTES) -> float:
    """Predicted seconds of a pipelined staged all-reduce of `nbytes`: the slowest stage over
    the whole tensor, plus one chunk through the other two (the pipeline's fill and drain).
    `reduce_s(nbytes)` is the host all-reduce's time for that many bytes."""
    if nbytes == 0:
        return 0.0
    first = min(nbytes, chunk_bytes)
    whole = (nbytes / down_bps, reduce_s(nbytes), nbytes / up_bps)
    one = (first / down_bps, reduce_s(first), first / up_bps)
    slowest = max(range(3), key=whole.__getitem__)
    return whole[slowest] + sum(one) - one[slowest]


class Pool:
    """SLOTS pinned host slots of `chunk_bytes` each, allocated on first use and kept: a call
    never allocates host memory.  `view(slot, dtype, n)` is the first n elements of a slot."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES, pin: bool | None = None):
        self.chunk_bytes = chunk_bytes
        self._pin = torch.cuda.is_available() if pin is None else pin
        self._slots: list[torch.Tensor] = []

    def view(self, slot: int, dtype: torch.dtype, n: int) -> torch.Tensor:
        if not self._slots:
            self._slots = [torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=self._pin)
                           for _ in range(SLOTS)]
        return self._slots[slot].view(dtype)[:n]

    def elements(self, dtype: torch.dtype) -> int:
        return self.chunk_bytes // dtype.itemsize


class Slots:
    """Pinned host buffers of `chunk_bytes` for transfers that outlive the call that starts
    them (a pipeline's sends, pending until the peer takes them): a slot is taken, given
    back when its transfer is done, and reused.  A new one is made only while more are in
    flight than ever before, so a steady schedule allocates nothing after its first steps.
    A slot given back with an event (its copy up still running) is handed out again only
    once that event is done."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES, pin: bool | None = None):
        self.chunk_bytes = chunk_bytes
        self._pin = torch.cuda.is_available() if pin is None else pin
        self._free: list[tuple] = []        # (slot, event or None, lanes that made the event)
        self.made = 0

    def take(self) -> torch.Tensor:
        if not self._free:
            self.made += 1
            return torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=self._pin)
        slot, event, lanes = self._free.pop()
        if event is not None:
            lanes.wait(event)
        return slot

    def give(self, slot: torch.Tensor, event=None, lanes=None) -> None:
        self._free.append((slot, event, lanes))


class CudaLanes:
    """Copies on two CUDA streams of one device, down (device to host) and up (host to
    device), made once and reused.  `begin` orders them after the work already queued on the
    caller's stream (the input's producer; earlier calls' users of the result); `finish`
    makes the caller's stream wait for the last copy up, so what it runs next sees the result
    without the host waiting for it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.streams = {"down": torch.cuda.Stream(device), "up": torch.cuda.Stream(device)}
        self.current = None

    def begin(self) -> None:
        self.current = torch.cuda.current_stream(self.device)
        for s in self.streams.values():
            s.wait_stream(self.current)

    def copy(self, lane: str, dst: torch.Tensor, src: torch.Tensor, after=None):
        stream = self.streams[lane]
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def run(self, lane: str, work):
        """Queue `work` (kernels) on a lane after what is already there; its event."""
        stream = self.streams[lane]
        with torch.cuda.stream(stream):
            work()
            event = torch.cuda.Event()
            event.record(stream)
        return event

    @staticmethod
    def wait(event) -> None:
        event.synchronize()

    def finish(self, written: torch.Tensor | None) -> None:
        self.current.wait_stream(self.streams["up"])
        if written is not None:     # made on the caller's stream, written on up
            written.record_stream(self.streams["up"])


class Piece(NamedTuple):
    """One chunk of a staged collective: what is copied into its host slot (`down`: host
    offset, device tensor), the work done there across the ranks (`middle(slot)`, given the
    whole slot as a flat tensor of the call's dtype), and what is copied back out (`up`:
    device tensor, host offset).  Either copy list may be empty (a broadcast's non-roots copy
    nothing down, a reduce's non-roots nothing up).  `then`, if given, is device work queued
    on the up lane after the copies up (the GPU's share of a piece, such as summing what
    the ranks sent)."""
    down: list
    middle: Callable[[torch.Tensor], None]
    up: list
    then: Callable[[], None] | None = None


class Stager:
    """One communicator's staging: its pool of host slots and its lanes per GPU, both made on
    first use and kept (`lanes_for` may be replaced, as the CPU tests do)."""

    def __init__(self, pool: Pool | None = None, lanes_for=CudaLanes, reduce_on: str | None = None):
        self.pool = pool or Pool()
        self._lanes_for = lanes_for
        self._lanes: dict = {}
        self._scratch: dict = {}
        self.reduce_on = reduce_on or env.staged_reduce()     # PSRT_STAGED_REDUCE: host or gpu

    def lanes(self, device: torch.device):
        lanes = self._lanes.get(device)
        if lanes is None:
            lanes = self._lanes[device] = self._lanes_for(device)
        return lanes

    def scratch(self, device: torch.device, dtype: torch.dtype, slot: int) -> torch.Tensor:
        """Device memory the size of host slot `slot`, made once per device: where a piece's
        copies up land when the GPU works on them before they reach the result."""
        whole = self._scratch.get(device)
        if whole is None:
            whole = self._scratch[device] = torch.empty(SLOTS, self.pool.chunk_bytes, dtype=torch.uint8, device=device)
        return whole[slot].view(dtype)

    def run(self, pieces: list[Piece], dtype: torch.dtype, device: torch.device, written=None) -> None:
        pipeline(pieces, dtype, self.pool, self.lanes(device), written)


def pipeline(pieces: list[Piece], dtype: torch.dtype, pool: Pool, lanes, written=None) -> None:
    """Run `pieces` through `pool`'s slots, following `schedule` exactly: piece i+1's copies
    down and piece i-1's copies up are queued around piece i's middle.  `written` (a device
    tensor the copies up write, or None) is handed to `lanes.finish`."""
    whole = pool.elements(dtype)
    arrived, left = {}, {}          # piece -> event: its copies down done, its copies up done
    lanes.begin()
    for stage, i in schedule(len(pieces)):
        piece, host = pieces[i], pool.view(i % SLOTS, dtype, whole)
        if stage == "down":
            # the slot's piece of three pieces ago must have gone up before it is written
            event = left.pop(i - SLOTS, None)
            for k, (at, src) in enumerate(piece.down):
                event = lanes.copy("down", host[at:at + src.numel()], src, after=event if k == 0 else None)
            arrived[i] = event
        elif stage == "reduce":
            if arrived[i] is not None:
                lanes.wait(arrived[i])
            del arrived[i]
            piece.middle(host)
        else:
            event = None
            for dst, at in piece.up:
                event = lanes.copy("up", dst, host[at:at + dst.numel()])
            if piece.then is not None:
                event = lanes.run("up", piece.then)
            left[i] = event
    lanes.finish(written)
