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
from torch.distributed.constants import default_pg_timeout

from psrt.c10d.process_group import Options, ProcessGroupPsrt
from psrt.c10d.work import Work
from psrt.errors import PsrtError, make_options

BACKEND = "psrt"
_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


class Job:
    """The process's MPI world, and the watchdog over every psrt group carved out of it."""

    def __init__(self):
        from psrt.watchdog import init
        self.world = init(export_env=False)
        self.watchdog = None

    def watch(self, group) -> None:
        """Have the watchdog name a rank that stops calling `group` (a psrt Communicator).
        Its first call, for the default group, is collective: every rank makes it."""
        from psrt import env
        from psrt.watchdog import Watchdog
        if self.watchdog is None:
            # psrt.init's (which also watches every Communicator made on the world), unless
            # the world was made without one.
            self.watchdog = self.world.watchdog or Watchdog(self.world, timeout_s=env.timeout_s()).start()
        self.watchdog.watch(group)

    def stop(self) -> None:
        """Stop the watchdog (collective: the default group is shut down on every rank)."""
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None


@functools.lru_cache(maxsize=1)
def job() -> Job:
    """The process's Job (MPI starts on first use).  Cached: torch's backend registry calls a
    plain function per group, and every group is carved out of this one world."""
    return Job()


def job_world():
    """The process's psrt World."""
    return job().world


def launched_by_mpi() -> bool:
    """Whether an MPI launcher (mpirun, srun, horovodrun, Hydra) started this process: a script
    that also runs under torchrun can pick its backend with it."""
    from psrt.world import detect_launcher
    return detect_launcher() not in ("single", "torchrun")


def _publish_rendezvous() -> None:
    """Export RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/MASTER_PORT from MPI (rank 0 picks a
    free port) when the environment lacks them, so env:// needs nothing set by hand."""
    if all(k in os.environ for k in _RENDEZVOUS):
        return
    from psrt.world import export_torch_env
    export_torch_env(job_world())


def _create(common, options) -> ProcessGroupPsrt:
    """torch's factory for a group on this backend (`extended_api=True`)."""
    this = job()
    world = this.world
    # Checked before any communicator is made: every member raises alike.
    if isinstance(options, dict):
        options = make_options(Options, options, "psrt backend pg_options")
    elif options is not None and not isinstance(options, Options):
        # Dropping it would run the group on the default algorithm without a word.
        raise PsrtError(f"psrt backend: pg_options must be psrt.c10d.Options or a dict of its fields "
                        f"(algorithm, check), got {type(options).__name__}")
    ranks = list(common.global_ranks_in_group)
    if not ranks:
        # The default group (torch passes no ranks for it): torch's ranks must be MPI's.
        if (common.group_rank, common.group_size) != (world.rank, world.size):
            raise PsrtError(f"psrt backend: torch.distributed says rank {common.group_rank} of "
                            f"{common.group_size}, MPI says rank {world.rank} of {world.size}: "
                            "leave rank and world_size to MPI")
        comm = world.comm.Dup()
    else:
        # Any other group, all ranks or some, in torch's rank order (new_group(...,
        # sort_ranks=False) and DeviceMesh may order them differently from the world).
        every = world.comm.Get_group()
        members = every.Incl(ranks)
        comm = world.comm.Create_group(members)
        members.Free()
        every.Free()
        if comm.Get_rank() != common.group_rank:
            raise PsrtError(f"psrt backend: group {common.group_id}: MPI rank {comm.Get_rank()} "
                            f"differs from torch's group rank {common.group_rank}")
    # torch passes its default (30 min) when the program gave no timeout=: psrt's own
    # (PSRT_TIMEOUT) applies then, as everywhere else in psrt.
    timeout = None if common.timeout == default_pg_timeout else common.timeout
    pg = ProcessGroupPsrt(comm, options, timeout=timeout,
                          on_shutdown=this.stop if this.watchdog is None else None,
                          ranks=ranks or list(range(world.size)))
    this.watch(pg.group)
    return pg


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

__all__ = ["BACKEND", "Job", "Options", "ProcessGroupPsrt", "Work", "init_process_group", "job", "job_world",
           "launched_by_mpi", "register"]
