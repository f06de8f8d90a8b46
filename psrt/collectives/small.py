"""Small messages: psrt's all-reduce schedules over NumPy arrays, made ready once per buffer.

Below SMALL_BYTES a call costs Python more than bytes: a torch slice, a torch add and a tensor to
MPI-buffer conversion each take microseconds, while a message of a few bytes takes one or two.
So for small CPU tensors the Communicator runs the algorithms' schedules (ring.py,
recursive.py, tree.py, ps.py: each written once over a builder) on a NumPy view of the
tensor's memory, recorded once into a `Plan` (collectives/schedule.py, Recorder): a call is
then the loop over fixed steps, nothing sliced, allocated or looked up again, which is what a
buffer reduced every step (a loss, a gradient norm, a DDP bucket) pays.  The messages and the
order of reductions are the torch path's, because the schedule is the same one.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from psrt.collectives import ps, recursive, ring, tree
from psrt.collectives.p2p import TAG_PS, TAG_RD, TAG_RHD, TAG_RING, TAG_TREE
from psrt.collectives.schedule import Plan, Recorder

# Up to 4 MiB a call's cost is set by Python between MPI calls (a torch slice, a torch add, a
# tensor to MPI-buffer conversion: tens of microseconds per step), and with more ranks than
# cores every microsecond a rank spends there holds up the ranks waiting on it.  Measured with
# `bench collectives` (ring vs mpi4py-ring): at N = 2, 80 KiB-1 MiB, the torch path took
# 1.4-4x the NumPy one and 1.1x at 4 MiB; at N = 4 on 2 cores 2-4.5x.  At 16 MiB the torch
# ring's cache-sized segments win (0.8x), so larger tensors take that path.
SMALL_BYTES = 4 << 20


def takes(algo: str, nbytes: int) -> bool:
    """Whether an all-reduce of nbytes with `algo` runs here: up to SMALL_BYTES, and for the
    parameter server up to one pipeline segment (a plan of one segment is what pays)."""
    return nbytes <= (ps.PIPELINE_BYTES if algo == "ps" else SMALL_BYTES)


UFUNCS = {"sum": np.add, "avg": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum,
          "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}
# dtypes whose NumPy arithmetic is torch's (16-bit floats and bool travel as raw words)
DTYPES = frozenset({torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8, torch.int8})


def _native(b: Recorder, n: int, r: int) -> None:
    """The MPI library's own all-reduce, in place (not psrt's schedule: a fast path)."""
    from mpi4py import MPI
    b.steps.append((b.comm.Allreduce, (MPI.IN_PLACE, b.a, _mpi_op(b.ufunc))))


@functools.lru_cache(maxsize=None)
def _mpi_op(ufunc):
    from mpi4py import MPI
    return {np.add: MPI.SUM, np.multiply: MPI.PROD, np.maximum: MPI.MAX, np.minimum: MPI.MIN,
            np.bitwise_and: MPI.BAND, np.bitwise_or: MPI.BOR, np.bitwise_xor: MPI.BXOR}[ufunc]


# psrt's own schedules, and their tags (those the torch path runs them with)
ALLREDUCE = {"ring": (ring.schedule_allreduce, TAG_RING), "doubling": (recursive.schedule_doubling, TAG_RD),
             "halving-doubling": (recursive.schedule_halving_doubling, TAG_RHD),
             "tree": (tree.schedule_allreduce, TAG_TREE), "ps": (ps.schedule_allreduce, TAG_PS)}
# ... and the MPI library's call, for the Communicator's ready-made calls
FAST = dict(ALLREDUCE, native=(_native, 0))


def plan(algo: str, comm, a: np.ndarray, ufunc, persistent: bool = False) -> Plan:
    """The all-reduce `algo` of the flat array `a` over `comm` with `ufunc`, made ready."""
    build, tag = FAST[algo]
    b = Recorder(comm, a, ufunc, tag, persistent and algo != "native")
    build(b, comm.Get_size(), comm.Get_rank())
    return b.plan()


def allreduce(algo: str, comm, a: np.ndarray, ufunc) -> None:
    """One all-reduce of `a` in place, for a buffer that is not reduced again."""
    plan(algo, comm, a, ufunc)()
