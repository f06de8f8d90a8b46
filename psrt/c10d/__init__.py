"""psrt as a torch.distributed backend: `init_process_group(backend="psrt")`.

    import psrt.c10d                      # registers "psrt"; under an MPI launcher, joins MPI
    import torch.distributed as dist
    dist.init_process_group(backend="psrt")
    model = torch.nn.parallel.DistributedDataParallel(model)   # DDP, FSDP2, DTensor, ... unchanged

Pip builds of PyTorch have no MPI backend (`dist.is_mpi_available()` is False).  This one takes
rank, world size and rendezvous from MPI, so a script written for torchrun runs unchanged under
mpirun, srun or horovodrun, and its collectives run psrt's algorithms: `PSRT_ALGORITHM=ps`
turns an unmodified DDP script into a parameter-server job, `ring` into Horovod's schedule.

Importing this module is collective under an MPI launcher: MPI starts (psrt.init) and rank 0
publishes MASTER_ADDR/MASTER_PORT for torch's env:// rendezvous unless they are set already.
The MPI world is the process's own; torch's global ranks must be MPI's (they are, unless a
rank or world size that disagrees is passed by hand: that is an error naming both).
"""
from __future__ import annotations

import functools
import os

import torch.distributed as dist

from psrt.c10d.process_group import Options, ProcessGroupPsrt
from psrt.c10d.work import Work
from psrt.errors import PsrtError

BACKEND = "psrt"
_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


@functools.lru_cache(maxsize=1)
def job_world():
    """The process's psrt World (MPI starts on first use).  Cached: torch's backend registry
    calls a plain function per group, and every group is carved out of this one world."""
    from psrt.world import init
    return init(export_env=False)


def _publish_rendezvous() -> None:
    """Export RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/MASTER_PORT from MPI (rank 0 picks a
    free port) when the environment lacks them, so env:// needs nothing set by hand."""
    if all(k in os.environ for k in _RENDEZVOUS):
        return
    from psrt.world import export_torch_env
    export_torch_env(job_world())


def _create(common, options) -> ProcessGroupPsrt:
    """torch's factory for a group on this backend (`extended_api=True`)."""
    world = job_world()
    ranks = list(common.global_ranks_in_group) or list(range(common.group_size))
    if len(ranks) == world.size:
        if (common.group_rank, common.group_size) != (world.rank, world.size):
            raise PsrtError(f"psrt backend: torch.distributed says rank {common.group_rank} of "
                            f"{common.group_size}, MPI says rank {world.rank} of {world.size}: "
                            "leave rank and world_size to MPI")
        comm = world.comm.Dup()
    else:
        comm = world.comm.Create_group(world.comm.Get_group().Incl(ranks))
        if comm.Get_rank() != common.group_rank:
            raise PsrtError(f"psrt backend: group {common.group_id}: MPI rank {comm.Get_rank()} "
                            f"differs from torch's group rank {common.group_rank}")
    if isinstance(options, dict):
        options = Options(**options)
    elif options is not None and not isinstance(options, Options):
        options = None     # torch passes its own empty options object when none were given
    return ProcessGroupPsrt(comm, options, timeout=common.timeout)


def register() -> None:
    """Make "psrt" a torch.distributed backend (idempotent)."""
    if BACKEND.upper() in dist.Backend._plugins:
        return
    devices = ["cpu", "cuda"]
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=devices)


def init_process_group(**kwargs):
    """`dist.init_process_group(backend="psrt", **kwargs)` and return the default group."""
    if not dist.is_initialized():
        dist.init_process_group(backend=BACKEND, **kwargs)
    return dist.group.WORLD


register()
_publish_rendezvous()

__all__ = ["BACKEND", "Options", "ProcessGroupPsrt", "Work", "init_process_group", "job_world", "register"]
