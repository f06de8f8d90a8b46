"""What each collective's pieces are when its CUDA tensors are staged (collectives/staged.py).

A piece is what fits one host slot.  An all-reduce, broadcast or reduce cuts the flat tensor
into consecutive chunks and runs the call's algorithm on each.  A reduce-scatter or
all-gather cuts every rank's segment into columns instead: piece p holds columns
[p*c, (p+1)*c) of each rank's segment side by side (c = a slot's elements / N), so the call's
own algorithm runs on each piece with per-rank counts that still add up, and the result of
each piece lands in the right columns of the output.  An all-to-all (`alltoall`, and
`alltoallv` with the pairwise algorithm; `native` stays MPI_Alltoallv on one whole copy, the
peer the pipelined exchange is measured against) runs the pairwise exchange
(collectives/alltoall.py), one piece per block or part of a block: the block for
rank r+k goes down into the first half of the slot, the block from rank r-k arrives in the
second half and goes up, while the next block goes down.  Every rank computes the same
pieces from arguments the ranks have agreed on, so their calls match piece by piece.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from psrt.collectives.layout import offsets
from psrt.collectives.p2p import TAG_A2A
from psrt.collectives.schedule import transfer
from psrt.collectives.staged import SLOTS, Piece, chunks
from psrt.transport import reduce_


def allreduce(src: torch.Tensor, dst: torch.Tensor, per: int, reduce_chunk: Callable) -> list[Piece]:
    """dst <- the all-reduce of src (flat, contiguous; dst may be src): `reduce_chunk(host)`
    reduces a chunk in place across the ranks."""
    return [Piece([(0, src[s:s + n])], lambda h, n=n: reduce_chunk(h[:n]), [(dst[s:s + n], 0)])
            for s, n in chunks(src.numel(), per)]


def allreduce_on_gpu(src: torch.Tensor, dst: torch.Tensor, per: int, rank: int, size: int, op: str,
                     gather: Callable, scratch: Callable) -> list[Piece]:
    """dst <- the all-reduce of src with the arithmetic on the device: each piece holds a chunk
    of every rank side by side, all-gathered on the host (`gather(host, counts)` in place:
    data movement only), copied up into device memory (`scratch(slot)`, as big as a host
    slot) and reduced there in rank order into dst, on the up lane.  The host never adds;
    each rank receives (N-1) chunks where a ring receives 2(N-1)/N, the same at N = 2."""
    width = max(1, per // size)
    pieces = []
    for i, (s, n) in enumerate(chunks(src.numel(), width)):
        room = scratch(i % SLOTS)[:size * n]
        pieces.append(Piece([(rank * n, src[s:s + n])], lambda h, n=n: gather(h[:size * n], [n] * size),
                            [(room, 0)], partial(_reduce_rows, room.view(size, n), dst[s:s + n], op)))
    return pieces


def _reduce_rows(rows: torch.Tensor, out: torch.Tensor, op: str) -> None:
    """out <- rows[0] (op) rows[1] (op) ..., in row order; 'avg' divides by the rows."""
    out.copy_(rows[0])
    for row in rows[1:]:
        reduce_(out, row, op)
    if op == "avg":
        out.div_(rows.shape[0])


def broadcast(buf: torch.Tensor, root: int, rank: int, per: int, fn: Callable) -> list[Piece]:
    """buf <- root's buf, chunk by chunk: `fn(host, root)` broadcasts a chunk in place."""
    return [Piece([(0, buf[s:s + n])] if rank == root else [],
                  lambda h, n=n: fn(h[:n], root),
                  [(buf[s:s + n], 0)] if rank != root else [])
            for s, n in chunks(buf.numel(), per)]


def reduce(src: torch.Tensor, dst: torch.Tensor | None, root: int, rank: int, per: int,
           reduce_chunk: Callable) -> list[Piece]:
    """dst <- the reduction of src onto root (dst: None off the root): `reduce_chunk(host)`
    reduces a chunk in place onto the root."""
    return [Piece([(0, src[s:s + n])], lambda h, n=n: reduce_chunk(h[:n]),
                  [(dst[s:s + n], 0)] if dst is not None else [])
            for s, n in chunks(src.numel(), per)]


def columns(elems: list[int], per: int) -> list[tuple[int, list[int]]]:
    """(first column, elements of each rank's segment) of every piece of a reduce-scatter or
    all-gather whose segments hold `elems`, `per` elements a slot."""
    width = max(1, per // len(elems))
    longest = max(elems, default=0)
    return [(col, [max(0, min(width, e - col)) for e in elems]) for col in range(0, longest, width)]


def reduce_scatter(src: torch.Tensor, elems: list[int], rank: int, dst: torch.Tensor, per: int,
                   fn: Callable) -> list[Piece]:
    """dst <- this rank's segment of the reduction of src (segments of `elems` elements):
    `fn(host, counts)` reduce-scatters a piece in place, leaving each rank's part where it was."""
    off = offsets(elems)
    pieces = []
    for col, counts in columns(elems, per):
        at = offsets(counts)
        down = [(at[j], src[off[j] + col:off[j] + col + n]) for j, n in enumerate(counts) if n]
        mine = counts[rank]
        pieces.append(Piece(down, lambda h, counts=counts: fn(h[:sum(counts)], counts),
                            [(dst[col:col + mine], at[rank])] if mine else []))
    return pieces


def allgather(src: torch.Tensor, elems: list[int], rank: int, dst: torch.Tensor, per: int,
              fn: Callable) -> list[Piece]:
    """dst <- every rank's src in rank order (segments of `elems` elements): `fn(host,
    counts)` all-gathers a piece in place, each rank's part already at its place."""
    off = offsets(elems)
    pieces = []
    for col, counts in columns(elems, per):
        at = offsets(counts)
        mine = counts[rank]
        up = [(dst[off[j] + col:off[j] + col + n], at[j]) for j, n in enumerate(counts) if n]
        pieces.append(Piece([(at[rank], src[col:col + mine])] if mine else [],
                            lambda h, counts=counts: fn(h[:sum(counts)], counts), up))
    return pieces


def alltoallv(comm, send: torch.Tensor, send_elems: list[int], recv: torch.Tensor,
              recv_elems: list[int], per: int) -> list[Piece]:
    """The pairwise exchange of `send` into `recv` (flat; blocks of the given sizes in rank
    order), except this rank's own block, which the caller copies on the device.  A block
    larger than half a slot travels as several messages, as many as its receiver expects
    from its size."""
    n, r, half = comm.size, comm.rank, max(1, per // 2)
    so, ro = offsets(send_elems), offsets(recv_elems)
    pieces = []
    for k in range(1, n):
        to, frm = (r + k) % n, (r - k) % n
        out, into = send_elems[to], recv_elems[frm]
        for col in range(0, max(out, into), half):
            s, g = max(0, min(half, out - col)), max(0, min(half, into - col))
            down = [(0, send[so[to] + col:so[to] + col + s])] if s else []
            up = [(recv[ro[frm] + col:ro[frm] + col + g], half)] if g else []
            pieces.append(Piece(down, Exchange(comm, half, to, s, frm, g), up))
    return pieces


@dataclass(frozen=True)
class Exchange:
    """The middle of an all-to-all piece: send the slot's first `s` elements to rank `to` and
    receive `g` from rank `frm` into its second half (from `half`).  A side with nothing to
    move posts no message: its partner expects none."""
    comm: object
    half: int
    to: int
    s: int
    frm: int
    g: int

    def __call__(self, host: torch.Tensor) -> None:
        # a large send posted before the receive, as in every two-way step of psrt's (why:
        # collectives/schedule.post)
        sends = [(host[:self.s], self.to)] if self.s else []
        recvs = [(host[self.half:self.half + self.g], self.frm)] if self.g else []
        transfer(self.comm, sends, recvs, TAG_A2A)


# ------------------------------------------------------------ the Communicator's staged calls
# Each takes the Communicator (`group`) and a collective's checked arguments, and returns what
# the collective returns; `fn` is the call's algorithm bound to its communicator.
def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1)


def _result(out: torch.Tensor | None, shape, t: torch.Tensor) -> torch.Tensor:
    """Where the copies up write: `out` when they can write it directly, else a new tensor."""
    if out is not None and out.is_contiguous():
        return out
    return torch.empty(shape, dtype=t.dtype, device=t.device)


def _into(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return result if out is None or out is result else out.copy_(result)


def reduce_scatter_call(group, t, elems, shape, op: str, fn, out):
    result, rank = _result(out, shape, t), group.rank

    def piece(host, counts):
        fn(host, counts, op)
        if op == "avg":
            start = sum(counts[:rank])
            host[start:start + counts[rank]].div_(group.size)
    per = group._stager.pool.elements(t.dtype)
    group._stager.run(reduce_scatter(_flat(t), elems, rank, result.view(-1), per, piece), t.dtype, t.device, result)
    return _into(result, out)


def allgather_call(group, t, elems, shape, fn, out):
    result = _result(out, shape, t)
    per = group._stager.pool.elements(t.dtype)
    group._stager.run(allgather(_flat(t), elems, group.rank, result.view(-1), per, fn), t.dtype, t.device, result)
    return _into(result, out)


def broadcast_call(group, t, root: int, fn):
    buf = t if t.is_contiguous() else t.contiguous()
    per = group._stager.pool.elements(t.dtype)
    group._stager.run(broadcast(buf.view(-1), root, group.rank, per, fn), t.dtype, t.device, buf)
    return _into(buf, t)


def reduce_call(group, t, root: int, op: str, fn, out):
    at_root = group.rank == root
    result = _result(out, t.shape, t) if at_root else None

    def piece(host):
        fn(host, root, op)
        if op == "avg" and at_root:
            host.div_(group.size)
    per = group._stager.pool.elements(t.dtype)
    flat = result.view(-1) if at_root else None
    group._stager.run(reduce(_flat(t), flat, root, group.rank, per, piece), t.dtype, t.device, result)
    return _into(result, out) if at_root else None


def alltoallv_call(group, t, send_elems, recv_elems, shape, out):
    send, result, r = _flat(t), _result(out, shape, t), group.rank
    recv, so, ro = result.view(-1), offsets(send_elems), offsets(recv_elems)
    recv[ro[r]:ro[r + 1]].copy_(send[so[r]:so[r + 1]])       # this rank's own block, on the device
    per = group._stager.pool.elements(t.dtype)
    group._stager.run(alltoallv(group.comm, send, send_elems, recv, recv_elems, per), t.dtype, t.device, result)
    return _into(result, out)
