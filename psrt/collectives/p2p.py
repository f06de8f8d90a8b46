"""Point-to-point helpers shared by psrt's own algorithms.

Every algorithm works in place on a flat, contiguous tensor `buf` and moves slices of it with
MPI point-to-point calls; reductions run as torch kernels (`transport.reduce_`), so the same
code serves CPU tensors, CUDA tensors on a CUDA-aware MPI, and 16-bit floats MPI cannot add.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from psrt.errors import PeerTimeout
from psrt.transport import msg

# One tag per algorithm keeps a mistaken mix of two algorithms from matching silently.
TAG_RING, TAG_RD, TAG_RHD, TAG_TREE, TAG_PS, TAG_A2A = 101, 102, 103, 104, 105, 106


def send(comm, t: torch.Tensor, dest: int, tag: int) -> None:
    comm.Send(msg(t), dest, tag)


def recv(comm, t: torch.Tensor, source: int, tag: int) -> None:
    comm.Recv(msg(t), source, tag)


def scratch(buf: torch.Tensor, n: int) -> torch.Tensor:
    """A receive buffer of n elements like buf (same dtype and device)."""
    return torch.empty(n, dtype=buf.dtype, device=buf.device)


# Waiting with a deadline: spin first (a reply often lands within microseconds), then sleep
# with a doubling pause of at most 1 ms, so that on a shared or oversubscribed CPU a waiting
# rank gives its core to the neighbour it is waiting for.
SPINS = 200
FIRST_PAUSE_S, MAX_PAUSE_S = 2e-6, 1e-3


def poll(ready: Callable[[], object], timeout_s: float, fail: Callable[[], str]):
    """Call `ready()` until it returns something true and return that; after `timeout_s`
    raise PeerTimeout(fail()) instead of waiting for ever.  The one wait loop of psrt's
    point-to-point protocols (parameter server, pipeline)."""
    deadline = time.monotonic() + timeout_s
    spins, pause = 0, FIRST_PAUSE_S
    while True:
        result = ready()
        if result:
            return result
        if time.monotonic() > deadline:
            raise PeerTimeout(fail())
        spins += 1
        if spins > SPINS:
            time.sleep(pause)
            pause = min(MAX_PAUSE_S, pause * 2)


def barrier(comm, timeout_s: float, what: str) -> None:
    """MPI_Barrier on `comm`, waited on by `poll`: for joins where the ranks come at different
    times because one of them had work of its own (the lead worker's evaluation, the files it
    writes), so that the early ones sleep instead of polling inside MPI for as long.  After
    `timeout_s` it raises PeerTimeout naming `what` (a rank that is alive but never comes is
    not one the watchdog sees: it waits in no collective)."""
    request = comm.Ibarrier()
    poll(request.Test, timeout_s,
         lambda: f"{what}: not every rank of {comm.size} came within {timeout_s:g} s (PSRT_TIMEOUT)")
