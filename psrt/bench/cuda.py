"""`psrt.bench collectives --device cuda`: CUDA all-reduces beside what bounds them.

In one run: the pinned copy bandwidth each way (device to host, host to device), every psrt
algorithm on CUDA tensors (staged through host memory, or handed to a CUDA-aware MPI), the
same algorithm on host tensors of the same size (rows `host:ALGO`: the staged path's middle
stage alone), torch.distributed's own (`torch`: NCCL where each rank has a GPU of its own,
else gloo) and `nccl` where it is allowed, and for each staged row the pipelined model
(collectives/staged.py `staged_time`: the slowest of copy down, host all-reduce and copy up,
plus one chunk through the other two), and each staged all-reduce again with its additions
on the other side (`gpu-reduce:ALGO`: all-gathered on the host, summed on the GPU; or
`host-reduce:ALGO` where PSRT_STAGED_REDUCE=gpu), which is what decides the setting.
Columns: x model = time over the model's, x torch = time over the torch row's (under 1:
psrt is faster).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from psrt.collectives.algorithms import THROUGH_TORCH

HOST = "host:"


def copy_bandwidth(device: torch.device, nbytes: int = 64 << 20, repeats: int = 5) -> tuple[float, float]:
    """(device-to-host, host-to-device) bytes/s of pinned copies of `nbytes`, medians of
    `repeats` timed with CUDA events after one untimed copy each way."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def rate(dst: torch.Tensor, src: torch.Tensor) -> float:
        seconds = []
        for _ in range(repeats + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        return nbytes / statistics.median(seconds[1:])
    return rate(host, dev), rate(dev, host)


@dataclass(frozen=True)
class Gpu:
    """The device of a run and what bounds a staged all-reduce there."""
    device: torch.device
    down_bps: float          # pinned copies, device to host
    up_bps: float            # and host to device
    staged: bool             # the MPI is not CUDA-aware: CUDA tensors are staged

    def heading(self) -> str:
        return (f"# {torch.cuda.get_device_name(self.device)}: pinned copies {self.down_bps / 1e9:.1f} GB/s "
                f"device to host, {self.up_bps / 1e9:.1f} GB/s host to device; the MPI is "
                + ("not CUDA-aware: CUDA tensors are staged" if self.staged else "CUDA-aware: no staging"))


def device_rows(names: list[str], own_gpu: bool) -> list[str]:
    """The rows to time on CUDA: psrt's algorithms, auto and torch's; nccl only where each
    rank has a GPU of its own (NCCL refuses two ranks on one GPU)."""
    return [a for a in names if a != "nccl" or own_gpu]


class OtherReduce:
    """A context in which `group`'s staged all-reduces add on the other side (the GPU where
    PSRT_STAGED_REDUCE is host, the default, else the host); it gives the rows' label,
    `gpu-reduce:` or `host-reduce:`."""

    def __init__(self, group):
        from psrt.collectives.staged import Stager
        self.group, self.own = group, group._stager
        side = "host" if self.own.reduce_on == "gpu" else "gpu"
        self.swapped, self.label = Stager(reduce_on=side), f"{side}-reduce:"

    def __enter__(self) -> str:
        self.group._stager = self.swapped
        return self.label

    def __exit__(self, *exc) -> None:
        self.group._stager = self.own


def other_reduce(group) -> OtherReduce | None:
    """The other side's additions for a staged run; None where nothing is staged."""
    return None if group._staging.direct_cuda else OtherReduce(group)


def host_rows(names: list[str]) -> list[str]:
    """psrt's algorithms again on host tensors: the middle stage of each staged row."""
    return [a for a in names if a not in THROUGH_TORCH and a != "auto"]


def synchronised(call):
    """A timed call that ends when the GPU has finished its work (the staged path returns
    with its last copies up queued on the caller's stream)."""
    def run():
        result = call()
        torch.cuda.synchronize()
        return result
    return run


def add_models(rows: list[dict], gpu: Gpu) -> None:
    """`model_us` and `vs_model` on each staged row (the host row of its collective, algorithm
    and size measured; one piece's host time taken as that row's time per byte: the same
    three-stage pipeline serves every collective), and `vs_torch` on every CUDA row beside
    the torch row of its collective and size."""
    from psrt.collectives.staged import staged_time
    def key(r, algorithm=None):
        return r.get("collective", "allreduce"), algorithm or r["algorithm"], r["nbytes"]
    host = {key(r, r["algorithm"][len(HOST):]): r["time_us"] / 1e6 for r in rows if r["algorithm"].startswith(HOST)}
    peer = {key(r): r["time_us"] for r in rows if r["algorithm"] == "torch"}
    for r in rows:
        if r["algorithm"].startswith(HOST):
            continue
        t_host = host.get(key(r))
        if gpu.staged and t_host is not None:
            per_byte = t_host / r["nbytes"]
            model = staged_time(r["nbytes"], gpu.down_bps, gpu.up_bps, lambda b: per_byte * b) * 1e6
            r["model_us"], r["vs_model"] = model, r["time_us"] / model
        if peer.get(key(r, "torch")):
            r["vs_torch"] = r["time_us"] / peer[key(r, "torch")]


COLUMNS = [("model_us", "model(us)", ".1f"), ("vs_model", "x model", ".2f"), ("vs_torch", "x torch", ".2f")]
