"""The MPI library's own collectives behind psrt's interface (the 'native' algorithm).

Reductions of float16/bfloat16 use psrt's user-defined op (see transport.mpi_op), so the MPI
library still chooses its own algorithm and only the element-wise kernel is psrt's.
"""
from __future__ import annotations

import torch
from mpi4py import MPI

from psrt.collectives.layout import offsets
from psrt.transport import mpi_op, msg, np_view, sync_cuda


def _typed(buf: torch.Tensor, op: str):
    """(message spec, MPI op) for a reduction of buf."""
    mop, dtype = mpi_op(op, buf.dtype)
    if buf.is_cuda:
        sync_cuda(buf)
        return [buf.detach(), buf.numel(), dtype], mop     # DLPack refuses a tensor that requires grad
    return [np_view(buf), buf.numel(), dtype], mop


def allreduce(comm, buf: torch.Tensor, op: str) -> None:
    spec, mop = _typed(buf, op)
    comm.Allreduce(MPI.IN_PLACE, spec, mop)


def allreduce_into(comm, src: torch.Tensor, dst: torch.Tensor, op: str) -> None:
    """Out of place, contiguous CPU tensors of an MPI type: the library writes dst directly
    (no staging copy), which is what keeps small messages close to the bare MPI call."""
    mop, dtype = mpi_op(op, src.dtype)
    if src.data_ptr() == dst.data_ptr():
        comm.Allreduce(MPI.IN_PLACE, [np_view(dst), dtype], mop)
    else:
        comm.Allreduce([np_view(src), dtype], [np_view(dst), dtype], mop)


def reduce(comm, buf: torch.Tensor, root: int, op: str) -> None:
    spec, mop = _typed(buf, op)
    if comm.rank == root and buf.is_cuda:
        # device memory: the root sends a copy, not MPI_IN_PLACE (Intel MPI 2021.19's GPU
        # MPI_Reduce gave a wrong sum in place; its all-reduce in place is right)
        send, _ = _typed(buf.clone(), op)
        comm.Reduce(send, spec, mop, root)
    elif comm.rank == root:
        comm.Reduce(MPI.IN_PLACE, spec, mop, root)
    else:
        comm.Reduce(spec, None, mop, root)


def broadcast(comm, buf: torch.Tensor, root: int) -> None:
    comm.Bcast(msg(buf), root)


def reduce_scatter(comm, buf: torch.Tensor, counts: list[int], op: str) -> None:
    spec, mop = _typed(buf, op)
    off = offsets(counts)
    mine = buf[off[comm.rank]:off[comm.rank + 1]]
    out = torch.empty_like(mine)
    out_spec, _ = _typed(out, op)
    comm.Reduce_scatter(spec, out_spec, counts, mop)
    mine.copy_(out)


def allgather(comm, buf: torch.Tensor, counts: list[int]) -> None:
    spec, _ = _typed(buf, "sum")
    comm.Allgatherv(MPI.IN_PLACE, [spec[0], counts, offsets(counts)[:-1], spec[2]])


def gather(comm, send: torch.Tensor, recv: torch.Tensor | None, counts: list[int], root: int) -> None:
    sspec, _ = _typed(send, "sum")
    if comm.rank == root:
        rspec, _ = _typed(recv, "sum")
        comm.Gatherv(sspec, [rspec[0], counts, offsets(counts)[:-1], rspec[2]], root)
    else:
        comm.Gatherv(sspec, None, root)


def scatter(comm, send: torch.Tensor | None, recv: torch.Tensor, counts: list[int], root: int) -> None:
    rspec, _ = _typed(recv, "sum")
    if comm.rank == root:
        sspec, _ = _typed(send, "sum")
        comm.Scatterv([sspec[0], counts, offsets(counts)[:-1], sspec[2]], rspec, root)
    else:
        comm.Scatterv(None, rspec, root)


def alltoall(comm, send: torch.Tensor, recv: torch.Tensor) -> None:
    sspec, _ = _typed(send, "sum")
    rspec, _ = _typed(recv, "sum")
    n = comm.size
    k = send.numel() // n
    comm.Alltoall([sspec[0], k, sspec[2]], [rspec[0], k, rspec[2]])


def alltoallv(comm, send: torch.Tensor, send_counts: list[int], recv: torch.Tensor,
              recv_counts: list[int]) -> None:
    """Rank r sends send_counts[j] elements to rank j and receives recv_counts[j] from it."""
    sspec, _ = _typed(send, "sum")
    rspec, _ = _typed(recv, "sum")
    comm.Alltoallv([sspec[0], send_counts, offsets(send_counts)[:-1], sspec[2]],
                   [rspec[0], recv_counts, offsets(recv_counts)[:-1], rspec[2]])
