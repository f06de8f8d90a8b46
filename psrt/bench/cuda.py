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
    attribute = "_stager"

    def __init__(self, group):
        from psrt.collectives.staged import Stager
        self.group, self.own = group, group._stager
        side = "host" if self.own.reduce_on == "gpu" else "gpu"
        self.swapped, self.label = Stager(reduce_on=side), f"{side}-reduce:"

    @staticmethod
    def applies(collective: str) -> bool:
        return collective == "allreduce"

    def differences(self, call, names, nbytes, dtype, device) -> dict:
        return {}

    def __enter__(self) -> str:
        setattr(self.group, self.attribute, self.swapped)
        return self.label

    def __exit__(self, *exc) -> None:
        setattr(self.group, self.attribute, self.own)


class ForceStaged(OtherReduce):
    """On a CUDA-aware MPI: a context in which `group`'s CUDA tensors are staged through
    pinned host memory all the same (rows `staged:ALGO`), the direct path's peer in the same
    run, for every collective."""
    attribute = "_staging"

    def __init__(self, group):
        from psrt.transport import Staging
        self.group, self.own = group, group._staging
        self.swapped, self.label = Staging(cuda_aware_mpi=False), "staged:"

    @staticmethod
    def applies(collective: str) -> bool:
        return True

    def differences(self, call, names, nbytes, dtype, device) -> dict:
        """{algorithm: elements whose result differs between the direct and the staged path,
        summed over ranks} for `call(algorithm, x)` on the same random input (seeded by
        rank).  Both paths add in the same order, so the results must be bitwise equal."""
        comm = self.group.comm
        gen = torch.Generator().manual_seed(1234 + comm.rank)
        x = torch.randn(max(nbytes // dtype.itemsize, 1), generator=gen).to(dtype)
        out = {}
        for name in names:
            direct = call(name, x.to(device))
            direct = None if direct is None else direct.clone()
            with self:
                staged = call(name, x.to(device))
            if staged is not None and staged.is_cuda:
                torch.cuda.synchronize()
            out[name] = comm.allreduce(0 if direct is None else int((direct != staged).sum()))
        return out


def other_path(group) -> OtherReduce:
    """The rows beside the CUDA rows: where the MPI is CUDA-aware, the same calls staged;
    where it is not, the staged all-reduces adding on the other side."""
    return ForceStaged(group) if group._staging.direct_cuda else OtherReduce(group)


def chunk_size(sizes: list[int]) -> int | None:
    """The staged pipeline's chunk, where a host row at that size is wanted for the model
    (some tensor is larger than one chunk, and no row is at the chunk's size already)."""
    from psrt.collectives.staged import CHUNK_BYTES
    return CHUNK_BYTES if max(sizes) > CHUNK_BYTES and CHUNK_BYTES not in sizes else None


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
    """`model_us` and `vs_model` on each staged row, and `vs_torch` on every CUDA row beside
    the torch row of its collective and size.  The model's host stage: the pipeline hands the
    host one chunk (CHUNK_BYTES) at a time, so a tensor of several chunks is reduced at the
    rate of the host row at the chunk's size (`chunk_rows` measures it), a smaller one in the
    time of the host row at its own size; the same three-stage pipeline serves every
    collective."""
    from psrt.collectives.staged import CHUNK_BYTES, staged_time
    def key(r, algorithm=None):
        return r.get("collective", "allreduce"), algorithm or r["algorithm"], r["nbytes"]
    host = {key(r, r["algorithm"][len(HOST):]): r["time_us"] / 1e6 for r in rows if r["algorithm"].startswith(HOST)}
    peer = {key(r): r["time_us"] for r in rows if r["algorithm"] == "torch"}
    for r in rows:
        if r["algorithm"].startswith(HOST):
            continue
        t_host = host.get(key(r))
        if gpu.staged and t_host is not None:
            coll, algo, n = key(r)
            t_chunk = host.get((coll, algo, CHUNK_BYTES)) if n > CHUNK_BYTES else None
            per_byte = t_chunk / CHUNK_BYTES if t_chunk else t_host / n
            model = staged_time(r["nbytes"], gpu.down_bps, gpu.up_bps, lambda b: per_byte * b) * 1e6
            r["model_us"], r["vs_model"] = model, r["time_us"] / model
        if peer.get(key(r, "torch")):
            r["vs_torch"] = r["time_us"] / peer[key(r, "torch")]


COLUMNS = [("model_us", "model(us)", ".1f"), ("vs_model", "x model", ".2f"), ("vs_torch", "x torch", ".2f")]
# on a CUDA-aware MPI, the staged rows' elements that differ from the direct path's
DIFFER = ("differ", "#differ from direct", "d")
