"""The pipelined staging path: a CUDA all-reduce through an MPI that cannot read GPU memory.

Staging the whole tensor (copy it down to the host, reduce, copy it up) leaves the copy
engines idle while MPI runs and MPI idle while they copy.  Here the tensor moves in chunks
through a pool of pinned host slots allocated once, and three stages overlap (the schedule
of MVAPICH2-GDR's and Open MPI's pipelined device-to-host transfers):

    copy chunk i+1 down  |  reduce chunk i across the ranks on the host  |  copy chunk i-1 up

The copies run on two streams of their own, one per direction, so both directions of the
PCIe link are busy at once; one event per chunk tells the host when its chunk has arrived
and tells the down stream when a slot's previous chunk has left it.  With three slots a slot
is written again only once the chunk that used it three chunks before has gone back up.  The
reduction of each chunk is the algorithm the call asked for, on the host: the copies are not
what limits a staged all-reduce (pinned copies run at tens of GB/s per direction; the host
reduction between ranks is the slow stage), so the pipelined time is about the largest of
the three stages plus one chunk's fill, the model `staged_time` states and the bench prints.

`run` takes its copy engine as `lanes`: `CudaLanes` on a GPU; the CPU suite drives the same
schedule with lanes whose copies run late, only when an event is waited for, so a missing
wait shows as a wrong sum (tests/unit/test_staged.py).
"""
from __future__ import annotations

import torch

CHUNK_BYTES = 4 << 20      # the ring's segment size: large enough for full-speed copies and MPI
SLOTS = 3                  # one chunk going down, one being reduced, one going up


def chunks(numel: int, chunk: int) -> list[tuple[int, int]]:
    """(start, length) of each chunk of a flat tensor of `numel` elements; the last may be
    shorter, and there are none for an empty tensor."""
    return [(s, min(chunk, numel - s)) for s in range(0, numel, chunk)]


def schedule(n: int) -> list[tuple[str, int]]:
    """The order in which the host issues the stages of n chunks: ('down', 0), then per chunk
    i the next chunk's copy down, chunk i's reduction, chunk i's copy up.  While chunk i is
    reduced, chunk i+1 goes down and chunk i-1 goes up."""
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

    @staticmethod
    def wait(event) -> None:
        event.synchronize()

    def finish(self, written: torch.Tensor) -> None:
        self.current.wait_stream(self.streams["up"])
        written.record_stream(self.streams["up"])   # made on the caller's stream, written on up


class Stager:
    """One communicator's staging: its pool of host slots and its lanes per GPU, both made on
    first use and kept (`lanes_for` may be replaced, as the CPU tests do)."""

    def __init__(self, pool: Pool | None = None, lanes_for=CudaLanes):
        self.pool = pool or Pool()
        self._lanes_for = lanes_for
        self._lanes: dict = {}

    def allreduce(self, src: torch.Tensor, dst: torch.Tensor, reduce_chunk) -> torch.Tensor:
        lanes = self._lanes.get(src.device)
        if lanes is None:
            lanes = self._lanes[src.device] = self._lanes_for(src.device)
        return run(src, dst, reduce_chunk, self.pool, lanes)


def run(src: torch.Tensor, dst: torch.Tensor, reduce_chunk, pool: Pool, lanes) -> torch.Tensor:
    """dst <- the all-reduce of src, both flat and contiguous on the device (dst may be src),
    through `pool`'s host slots: `reduce_chunk(host)` reduces one chunk across the ranks in
    place on the host.  Follows `schedule` exactly."""
    step = pool.elements(src.dtype)
    parts = chunks(src.numel(), step)
    arrived, left = {}, {}          # chunk -> event: its copy down done, its copy up done
    lanes.begin()
    for stage, i in schedule(len(parts)):
        start, n = parts[i]
        host = pool.view(i % SLOTS, src.dtype, n)
        if stage == "down":
            # the slot's chunk of three chunks ago must have gone up before it is written
            arrived[i] = lanes.copy("down", host, src[start:start + n], after=left.pop(i - SLOTS, None))
        elif stage == "reduce":
            lanes.wait(arrived.pop(i))
            reduce_chunk(host)
        else:
            left[i] = lanes.copy("up", dst[start:start + n], host)
    lanes.finish(dst)
    return dst
