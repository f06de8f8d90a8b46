"""psrt: an MPI runtime for distributed PyTorch training.

    import psrt
    world = psrt.init()                       # rank, local rank, node rank, a private comm
    comm = psrt.Communicator(world, algorithm="ring")
    total = comm.allreduce(torch.ones(4))     # == world.size everywhere
"""
from psrt.collectives import ALGORITHMS, ALL_ALGORITHMS, Communicator, Handle
from psrt.errors import CollectiveMismatch, PsrtError
from psrt.world import World, init, init_torch_distributed

__version__ = "0.1.0"
__all__ = ["init", "World", "init_torch_distributed", "Communicator", "Handle", "ALGORITHMS",
           "ALL_ALGORITHMS", "PsrtError", "CollectiveMismatch"]
