"""Two-level collectives: inside each host first, then between hosts, then inside again.

A flat ring over 2 hosts of 4 ranks makes 14 sequential steps, most of them waiting for a
rank on a crowded host, and puts 2(N-1)/N = 1.75 x M through each host's link where
2(H-1)/H = 1 x M would do.  Production systems split the work by level: Horovod's
HOROVOD_HIERARCHICAL_ALLREDUCE (reduce-scatter inside the host, each local rank
all-reduces its 1/L shard across hosts, all-gather inside the host), Open MPI 5's coll/han,
NCCL's trees between nodes, BytePS's local aggregation (Jiang et al., OSDI 2020).  This is
the Horovod shape:

1. inside the host, psrt's ring reduce-scatter (through the MPI library's shared memory)
   leaves local rank j with the host's sum of its shards;
2. for each shard, the ranks holding it (one per host, in host order) run psrt's ring
   between hosts, so every host link carries 2(H-1)/H of the shard, the L shards at once;
3. inside the host, psrt's ring all-gather spreads the shards again.

Why shards and not one leader per host: both put 2(H-1)/H x M on each host link, but a
leader reduces and forwards everything alone, while shards spread the work over the host's
ranks.  Measured on 2 and 4 emulated hosts at 1 Gbit/s, 16 MiB, 8 ranks on this machine's 2
cores: leader 631 ms (2x4) and 419 ms (4x2), shards 326-363 ms and 359 ms.  Inside the host
psrt's ring is used rather than the MPI library's Reduce_scatter and Allgatherv: with 8 ranks
on 2 cores, Open MPI 4.1's Reduce_scatter of a 64 MiB buffer among a host's 4 ranks took
about three times as long as the ring, whichever of its algorithms was forced
(coll_tuned_reduce_scatter_algorithm), and its Allgatherv no less than the ring; the ring's
inside rounds are also what the two-level model charges (psrt.collectives.cost.rounds).  A pipelined variant (segment k between hosts while
segment k+1 is reduced inside them) measured no better on this 2-core machine and was left
out.

Ragged placements (3 ranks on one host, 2 on another, 1 alone) keep the same shape: there
are S = max(L_h) shards and local rank j of a host with L_h ranks holds shards j, j + L_h,
...; every host holds every shard, so each shard's ring spans all hosts.  A host holding
several shards lays them out by holder first (a copy where that order differs from the
buffer's), so step 1 stays one reduce-scatter.

reduce_scatter and allgather use the same three steps with the blocks of the result named
by rank: shard s is the blocks of the ranks with local rank s, in host order, so a block
ends on its own rank after step 2 (its holder on its host is itself) and step 2 is a ring
reduce-scatter (or all-gather) alone: (H-1)/H of a shard on each link.  broadcast sends
the root's buffer to its host's first rank, between the hosts' first ranks (MPI's Bcast),
then inside every host.

The host of a rank is its processor name (psrt.world.host_key), which PSRT_HOSTS can
subdivide to fake a placement on one machine.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from mpi4py import MPI

from psrt.collectives import native, recursive, ring
# Below LEADER_BYTES an all-reduce goes through one rank per host (the MPI library's reduce
# and broadcast inside each host, an all-reduce among the hosts' first ranks) instead of
# shards: per-call costs, not bytes, set the time of a DDP bucket of a small model.
from psrt.collectives.cost import LEADER_BYTES, LEADERS_RING_BYTES
from psrt.collectives.layout import even_counts, offsets
from psrt.transport import msg

TAG_HIER = 107


@dataclass(frozen=True)
class Placement:
    """Where each rank of a communicator runs: host_of[r] numbers hosts by their lowest
    rank; local_of[r] is r's rank among its host's ranks."""
    host_of: tuple

    @property
    def hosts(self) -> int:
        return max(self.host_of) + 1 if self.host_of else 0

    @property
    def sizes(self) -> tuple:
        return tuple(self.host_of.count(h) for h in range(self.hosts))

    @property
    def local_of(self) -> tuple:
        seen: dict = {}
        out = []
        for h in self.host_of:
            out.append(seen.get(h, 0))
            seen[h] = out[-1] + 1
        return tuple(out)

    @property
    def shards(self) -> int:
        return max(self.sizes, default=1)

    def rank_at(self, host: int, local: int) -> int | None:
        """The rank with local rank `local` on `host`, or None."""
        for r, (h, j) in enumerate(zip(self.host_of, self.local_of)):
            if h == host and j == local:
                return r
        return None

    @classmethod
    def from_keys(cls, keys: list) -> "Placement":
        order = list(dict.fromkeys(keys))
        return cls(tuple(order.index(k) for k in keys))


@dataclass
class Topology:
    """A communicator's placement (known at once: one allgather of host keys) and the
    sub-communicators of the two levels (made on first use, collectively, where the data
    calls run, so every rank makes them in the same order)."""
    comm: object
    placement: Placement
    crowd: float = 1.0      # ranks per core on the most crowded machine (world.crowding)
    _local: object = None
    _shard_comms: dict = field(default_factory=dict)

    @classmethod
    def of(cls, comm, meta=None) -> "Topology":
        import os

        from psrt.world import crowding, host_key, machine_key
        keys = (meta or comm).allgather((host_key(), machine_key(), os.cpu_count() or 1))
        return cls(comm, Placement.from_keys([k[0] for k in keys]),
                   crowd=crowding([k[1] for k in keys], [k[2] for k in keys]))

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    def _build(self) -> None:
        if self._local is not None:
            return
        p, me = self.placement, self.rank
        host, local = p.host_of[me], p.local_of[me]
        self._local = self.comm.Split(host, me)
        size = p.sizes[host]
        for s in range(p.shards):
            # Shard s's holder on each host is local rank s mod L_h; its ring runs in host order.
            held = s % size == local
            sub = self.comm.Split(s if held else MPI.UNDEFINED, host)
            if held:
                self._shard_comms[s] = sub

    @property
    def local(self):
        self._build()
        return self._local

    def shard_comm(self, s: int):
        self._build()
        return self._shard_comms[s]

    def comms(self) -> list:
        """The communicators made so far (none before the first hierarchical call)."""
        return [c for c in [self._local, *self._shard_comms.values()] if c is not None]

    def free(self) -> None:
        for c in [self._local, *self._shard_comms.values()]:
            if c is not None:
                c.Free()
        self._local, self._shard_comms = None, {}


def _plan(p: Placement, host: int, block: dict) -> tuple[list, list, dict]:
    """This host's order of blocks (s, g) (by holder, then shard, then host g), the local
    ranks' counts of step 1, and, per shard held here, where it starts in that order.
    `block[(s, g)]` is the size of shard s's part that host g's holder reduces last."""
    size, hosts = p.sizes[host], p.hosts
    order, counts, start = [], [], {}
    at = 0
    for j in range(size):
        n0 = at
        for s in range(j, p.shards, size):
            start[s] = at
            for g in range(hosts):
                order.append((s, g))
                at += block[(s, g)]
        counts.append(at - n0)
    return order, counts, start


def _moved(buf: torch.Tensor, order: list, src_off: dict, block: dict) -> torch.Tensor:
    """buf's blocks in `order` (buf itself where they already are in that order)."""
    at, pieces = 0, []
    for key in order:
        pieces.append(buf[src_off[key]:src_off[key] + block[key]])
        if src_off[key] != at:
            at = -1
        elif at >= 0:
            at += block[key]
    if at >= 0:
        return buf
    return torch.cat(pieces) if pieces else buf[:0]


def _put_back(buf: torch.Tensor, work: torch.Tensor, order: list, src_off: dict, block: dict) -> None:
    if work.data_ptr() == buf.data_ptr() and work.numel() == buf.numel():
        return
    at = 0
    for key in order:
        n = block[key]
        buf[src_off[key]:src_off[key] + n].copy_(work[at:at + n])
        at += n


def _even_blocks(p: Placement, total: int) -> tuple[dict, dict]:
    """All-reduce: the buffer cut into shards x hosts blocks, shard-major."""
    sizes = even_counts(total, p.shards * p.hosts)
    off = offsets(sizes)
    keys = [(s, g) for s in range(p.shards) for g in range(p.hosts)]
    return dict(zip(keys, sizes)), dict(zip(keys, off[:-1]))


def _rank_blocks(p: Placement, counts: list[int]) -> tuple[dict, dict]:
    """reduce_scatter / allgather: block (s, g) is the part of the rank with local rank s on
    host g (empty where host g has fewer ranks)."""
    off = offsets(counts)
    block, src = {}, {}
    for s in range(p.shards):
        for g in range(p.hosts):
            r = p.rank_at(g, s)
            block[(s, g)] = counts[r] if r is not None else 0
            src[(s, g)] = off[r] if r is not None else 0
    return block, src


def _two_level(topo: Topology, buf: torch.Tensor, block: dict, src: dict, op: str | None,
               cross, gather: bool = True, reduce: bool = True) -> None:
    """Steps 1-3 of the module docstring on blocks (s, g); `cross(comm, part, counts)` is
    step 2 on each shard this rank holds."""
    p, me = topo.placement, topo.rank
    host = p.host_of[me]
    order, counts, start = _plan(p, host, block)
    work = _moved(buf, order, src, block)
    local = topo.local
    if reduce and local.Get_size() > 1:
        ring.reduce_scatter(local, work, counts, op)
    mine = [s for s in range(p.shards) if s % p.sizes[host] == p.local_of[me]]
    for s in mine if p.hosts > 1 else ():
        sizes = [block[(s, g)] for g in range(p.hosts)]
        cross(topo.shard_comm(s), work[start[s]:start[s] + sum(sizes)], sizes)
    if gather and local.Get_size() > 1:
        ring.allgather(local, work, counts)
    _put_back(buf, work, order, src, block)


def allreduce(topo: Topology, buf: torch.Tensor, op: str) -> None:
    if buf.numel() * buf.element_size() < LEADER_BYTES:
        # Small: latency rules, so the fewest rounds: reduce to each host's first rank (the
        # MPI library's), an all-reduce among those (`_between_leaders`), a broadcast inside
        # each host (the MPI library's).
        p, local = topo.placement, topo.local
        native.reduce(local, buf, 0, op)
        if p.local_of[topo.rank] == 0 and p.hosts > 1:
            _between_leaders(topo.shard_comm(0), buf, op)
        native.broadcast(local, buf, 0)
        return
    block, src = _even_blocks(topo.placement, buf.numel())
    _two_level(topo, buf, block, src, op, lambda c, part, sizes: ring.allreduce(c, part, op, sizes))


def _between_leaders(comm, buf: torch.Tensor, op: str) -> None:
    """The all-reduce among the hosts' first ranks: psrt's recursive doubling below
    LEADERS_RING_BYTES, where its log2(H) rounds win, psrt's ring from there (both what the
    two-level model charges; psrt.collectives.cost says why)."""
    if buf.numel() * buf.element_size() < LEADERS_RING_BYTES:
        recursive.allreduce_doubling(comm, buf, op)
    else:
        ring.allreduce(comm, buf, op, even_counts(buf.numel(), comm.Get_size()))


def reduce_scatter(topo: Topology, buf: torch.Tensor, counts: list[int], op: str) -> None:
    """buf[off[r]:off[r+1]] of rank r holds the reduction of every rank's block r."""
    block, src = _rank_blocks(topo.placement, counts)
    _two_level(topo, buf, block, src, op, lambda c, part, sizes: ring.reduce_scatter(c, part, sizes, op),
               gather=False)


def allgather(topo: Topology, buf: torch.Tensor, counts: list[int]) -> None:
    """In place: rank r's block r reaches every rank."""
    block, src = _rank_blocks(topo.placement, counts)
    _two_level(topo, buf, block, src, None, lambda c, part, sizes: ring.allgather(c, part, sizes),
               reduce=False)


def broadcast(topo: Topology, buf: torch.Tensor, root: int) -> None:
    """root -> its host's first rank -> every host's first rank -> every rank of each host."""
    p, me = topo.placement, topo.rank
    host, first = p.host_of[root], p.rank_at(p.host_of[root], 0)
    local = topo.local
    if root != first and me in (root, first):
        if me == root:
            local.Send(msg(buf), 0, TAG_HIER)
        else:
            local.Recv(msg(buf), p.local_of[root], TAG_HIER)
    if p.local_of[me] == 0 and p.hosts > 1:
        native.broadcast(topo.shard_comm(0), buf, host)
    if local.Get_size() > 1:
        native.broadcast(local, buf, 0)
