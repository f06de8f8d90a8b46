"""`--dp ps-sharded`: the parameter vector split over S servers (ps-lite's key ranges).

The flat parameter vector is cut into S size-balanced contiguous ranges (Li et al., "Scaling
Distributed Machine Learning with the Parameter Server", OSDI 2014, sec. 4.3); server s keeps
range s and the optimizer state of that range only.  Each step every worker pushes slice s of
its gradient to server s and pulls slice s of the parameters back, so a server moves
~2 (N-1) M / S per step instead of 2 (N-1) M (docs/explanation/parameter_server.md).  The protocol is
ps.py's synchronous engine run once per shard: each server averages its slice in worker-rank
order, so the parameters match `--dp ps` to rounding and the single-process run to tolerance.

Options: see ShardedPSOptions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from psrt.dp.ps import ParameterServer
from psrt.dp.ps_protocol import FlatShard
from psrt.dp.roles import Layout, sharded_layout
from psrt.dp.shards import ShardMap, assemble, reshard_optimizer
from psrt.errors import PsrtError


@dataclass(frozen=True)
class ShardedPSOptions:
    """servers: number of DEDICATED server ranks, as in `--dp ps`.  S > 0: the last S ranks
        hold one shard each and do no forward/backward (they call `serve()`); ranks 0..N-S-1
        are the workers.  0 or None (default): no dedicated servers, see shards.
    shards: with servers = 0 only: ranks 0..shards-1 hold one shard each and also work
        (default: every rank holds a shard, the co-located ps-lite layout).
    staleness, timeout_s, local_aggregation: as in `--dp ps`.
    No backup_workers: leaving a worker out needs the one server of `--dp ps` (PSOptions),
    so the option is not offered here, and `--backup-workers` says it is ps's."""

    servers: int | None = None
    staleness: int | None = None
    timeout_s: float | None = None
    local_aggregation: bool = False
    shards: int | None = None


class ShardedParameterServer(ParameterServer):
    name = "ps-sharded"
    Options = ShardedPSOptions

    def _layout(self, size: int, options: ShardedPSOptions) -> Layout:
        return sharded_layout(size, options.servers, options.shards)

    def _make_holder(self, lo: int, hi: int):
        return FlatShard(self.flat, lo, hi, self.make_optimizer)

    reshardable = True

    def load_resharded(self, states: list[dict]) -> None:
        """Resume from a run with another number of shards: the old servers' slices of the
        parameters and of the optimizer state are reassembled (the same key ranges as
        ShardMap's one-unit map) and this server takes its new range; an fp16 run's loss
        scale carries over."""
        self.model.load_state_dict(states[0]["model"])
        self.load_scaler(states[0])           # rank 0 trains in every layout; all ranks keep one scale
        self._step = int(states[0]["ps"]["step"])
        servers = sorted((s["ps"]["server"] for s in states if "server" in s["ps"]), key=lambda s: s["lo"])
        old = ShardMap([self.flat.numel], len(servers))
        if [(s["lo"], s["hi"]) for s in servers] != old.ranges():
            raise PsrtError("--resume: the checkpoint's ps-sharded server ranges do not cover this "
                            "model's parameters", everywhere=True)
        if self.shard is None:
            return
        new = ShardMap([self.flat.numel], len(self.server_ranks))
        lo, hi = self.ranges[self.shard]
        whole = assemble(old, [[s["param"]] for s in servers])
        with torch.no_grad():
            self.holder.param.copy_(whole[lo:hi])
        self.holder.optimizer.load_state_dict(
            reshard_optimizer([s["optimizer"] for s in servers], old, new, self.shard))

    @property
    def shard_range(self) -> tuple[int, int] | None:
        """[lo, hi) of the flat parameter vector this rank serves, None if it serves none."""
        return None if self.shard is None else self.ranges[self.shard]
