"""psrt's own variable-size all-to-all: pairwise exchange over point-to-point.

At step k = 1..N-1 rank r sends its block for rank (r+k) mod N and receives the block of
rank (r-k) mod N (collectives/schedule.transfer: one MPI_Sendrecv for small blocks, the send
posted before the receive for large ones, so that the two directions of a two-rank step flow
at once); its own block is a local copy.  Every rank talks to one partner at a time, so each
link carries one transfer per step, and a step costs alpha + beta x (that pair's bytes)
(Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in
MPICH", IJHPCA 19(1), 2005, sec. 3.5).  Blocks of any size, zero included, come straight
from and go straight into the caller's buffers.
"""
from __future__ import annotations

import torch

from psrt.collectives.layout import offsets
from psrt.collectives.p2p import TAG_A2A
from psrt.collectives.schedule import transfer


def pairwise(comm, send: torch.Tensor, send_counts: list[int], recv: torch.Tensor,
             recv_counts: list[int]) -> None:
    """Rank r sends send_counts[j] elements of the flat `send` to rank j and receives
    recv_counts[j] into the flat `recv`, blocks in rank order."""
    r = comm.rank
    so, ro = offsets(send_counts), offsets(recv_counts)
    recv[ro[r]:ro[r + 1]].copy_(send[so[r]:so[r + 1]])
    for k in range(1, comm.size):
        step(comm, k, send, so, recv, ro)


def step(comm, k: int, send: torch.Tensor, send_offsets: list[int], recv: torch.Tensor,
         recv_offsets: list[int]) -> None:
    """Step k of the exchange: the block for rank (r+k) mod N out, the one of (r-k) mod N in
    (blocks at the given offsets).  One step alone is what the benchmark times to see where
    the exchange spends its time."""
    n, r = comm.size, comm.rank
    dst, src = (r + k) % n, (r - k) % n
    transfer(comm, [(send[send_offsets[dst]:send_offsets[dst + 1]], dst)],
             [(recv[recv_offsets[src]:recv_offsets[src + 1]], src)], TAG_A2A)
