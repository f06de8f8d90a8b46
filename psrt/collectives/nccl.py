"""NCCL as a psrt algorithm ('nccl'): torch.distributed's NCCL on the ranks of a communicator,
for CUDA tensors where each rank owns its GPU.

The group is made on first use, after two checks every rank answers alike: the torch build
has NCCL, and no two ranks of the communicator use the same GPU (same host, same device).
NCCL refuses the latter itself, at its first call and in words about bus ids ("Duplicate GPU
detected"); psrt says it in one line before, and points to its own algorithms, which stage
CUDA tensors through host memory and so serve ranks that share a GPU.  The collectives are
those of the 'torch' algorithm (torch_backend.py) on that group.
"""
from __future__ import annotations

import socket

import torch

from psrt.collectives import torch_backend
from psrt.errors import PsrtError


def sharing(where: list) -> tuple[int, int] | None:
    """The first two ranks on one GPU, given each rank's (host, device index); else None."""
    first: dict = {}
    for rank, key in enumerate(where):
        if tuple(key) in first:
            return first[tuple(key)], rank
        first[tuple(key)] = rank
    return None


def gpus(comm) -> list:
    """Every rank's (host, GPU index or None) over `comm` (collective)."""
    gpu = torch.cuda.current_device() if torch.cuda.is_available() else None
    return comm.allgather((socket.gethostname(), gpu))


def group(comm):
    """torch.distributed's NCCL group over `comm`'s ranks (which must be the default group's);
    a one-line PsrtError on every rank where NCCL cannot serve them."""
    import torch.distributed as dist
    if not dist.is_nccl_available():
        raise PsrtError(f"algorithm 'nccl': this torch ({torch.__version__}) is built without NCCL; "
                        "use psrt's own algorithms (ring, native, ...)", everywhere=True)
    where = gpus(comm)
    if any(g is None for _, g in where):
        raise PsrtError(f"algorithm 'nccl': rank {next(r for r, (_, g) in enumerate(where) if g is None)} "
                        "sees no GPU; NCCL needs one GPU per rank", everywhere=True)
    pair = sharing(where)
    if pair is not None:
        host, gpu = where[pair[0]]
        raise PsrtError(f"algorithm 'nccl': ranks {pair[0]} and {pair[1]} share GPU {gpu} on {host}, and "
                        "NCCL needs one GPU per rank: start one rank per GPU, or use psrt's own "
                        "algorithms (ring, native, ...), which stage through host memory", everywhere=True)
    if not dist.is_initialized():
        raise PsrtError("algorithm 'nccl' runs on torch.distributed: call "
                        "psrt.init_torch_distributed(world) first", everywhere=True)
    if dist.get_world_size() != comm.Get_size():
        raise PsrtError(f"algorithm 'nccl' spans the default torch group ({dist.get_world_size()} ranks), "
                        f"not this communicator's {comm.Get_size()}", everywhere=True)
    return dist.new_group(backend="nccl")


def _cuda_only(fn):
    def run(group, buf: torch.Tensor, *args):
        if not buf.is_cuda:
            raise PsrtError("algorithm 'nccl' moves CUDA tensors only, and this one is on the "
                            f"{buf.device.type}: use another algorithm", everywhere=True)
        return fn(group, buf, *args)
    run.__name__ = fn.__name__
    return run


allreduce = _cuda_only(torch_backend.allreduce)
reduce = _cuda_only(torch_backend.reduce)
broadcast = _cuda_only(torch_backend.broadcast)
reduce_scatter = _cuda_only(torch_backend.reduce_scatter)
allgather = _cuda_only(torch_backend.allgather)
