"""psrt: an MPI runtime for distributed PyTorch training.

    import psrt
    world = psrt.init()                       # rank, local rank, node rank, a private comm
    group = psrt.Communicator(world.comm, algorithm="ring")
    total = group.allreduce(torch.ones(4))     # == world.size everywhere

    psrt.init_process_group()                 # torch.distributed on psrt's collectives (psrt.c10d)

Names are imported on first use (PEP 562), so tools that need no torch (mpi_launch,
python -m psrt.cluster, python -m psrt.info) start without importing it.
"""
import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "init": "psrt.watchdog", "World": "psrt.world", "init_torch_distributed": "psrt.world",
    "Communicator": "psrt.collectives", "Handle": "psrt.collectives",
    "ALGORITHMS": "psrt.collectives", "ALL_ALGORITHMS": "psrt.collectives",
    "init_process_group": "psrt.c10d",
    "data_parallel": "psrt.dp.driver",
    "PsrtError": "psrt.errors", "CollectiveMismatch": "psrt.errors",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'psrt' has no attribute {name!r}")
