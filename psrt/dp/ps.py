"""`--dp ps`: the synchronous parameter server (the old nn.DataParallel / ps-lite shape).

Every step each worker pushes its flattened gradient to the server; the server sums the
workers' gradients in rank order, averages them, runs the optimizer and sends the new
parameters back to every worker.  Built from MPI point-to-point on purpose, so the server's
link really carries (N-1) x M in and (N-1) x M out per step, the cost that sharding
(ps_sharded.py) and the ring all-reduce remove (Li et al., OSDI 2014; docs/explanation/parameter_server.md).

Options: see PSOptions.

The protocol engine here serves one or several shards, so ps-sharded is this class with
another layout and a flat-shard optimizer (see ShardedParameterServer).

fp16 (a psrt.dp.precision.ScaledFactory as make_optimizer): every push carries the scale its
gradient was computed with; the servers check the averaged gradient, decide together and
answer whether the step was skipped, so every rank skips the same steps and keeps one scale
(psrt/dp/precision.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from psrt.dp.base import DataParallel, StepStats
from psrt.dp.common import optimizer_state_bytes
from psrt.dp.precision import overflowed, split
from psrt.dp.ps_protocol import (FOUND, SCALE, TAG_DONE, TAG_PULL, TAG_PUSH, FlatParams, ModelShard, Wire,
                                 average_in_order, broadcast_initial, check_staleness, fill_push,
                                 first_pushes, now, shard_ranges, timeout_option, wait_all)
from psrt.dp.roles import Layout, ps_layout
from psrt.errors import PsrtError


@dataclass(frozen=True)
class PSOptions:
    """servers: 0 or None (default): rank 0 is the server and also a worker; 1: the last rank
        is a dedicated server (no forward/backward; it calls `serve()`).
    staleness: must be 0 or None (use ps-async for bounded staleness).
    timeout_s: how long any wait may last before it becomes an error naming the missing ranks
        (default PSRT_TIMEOUT); the normal exit of every receive loop is the DONE sentinel.
    local_aggregation: the workers of each host first sum their gradients on the host's first
        rank, which alone pushes to the server and hands the parameters on (BytePS's local
        aggregation, Jiang et al., OSDI 2020): the server's link carries (hosts - 1) x M
        each way instead of (N - 1) x M.  One server, rank 0 (--servers 0).
    backup_workers: b > 0: each step the server (rank 0, the one server) takes its own and the
        first N - 1 - b other workers' gradients and leaves out the b that come last, whose
        pushes it drops when they arrive; every worker gets the new parameters (Chen et al.,
        "Revisiting Distributed Synchronous SGD", 2016).  A straggler no longer sets the pace;
        which gradients are left out depends on timing, so runs are not reproducible."""

    servers: int | None = None
    staleness: int | None = None
    timeout_s: float | None = None
    local_aggregation: bool = False
    backup_workers: int = 0


class ParameterServer(DataParallel):
    name = "ps"
    Options = PSOptions

    def __init__(self, model, make_optimizer, group, params=None, **options):
        super().__init__(model, make_optimizer, group, params=params, **options)
        # fp16: the servers' optimizer is the plain one; unscaling and skipping happen in
        # the protocol, which every rank takes part in (the scaler's comm is not used).
        self.make_optimizer, self.scaler = split(make_optimizer)
        check_staleness(self.options.staleness, self.name)
        self.timeout_s = timeout_option(self.options.timeout_s, self.name)
        parent = group.comm
        self.rank, self.size = parent.Get_rank(), parent.Get_size()
        self.server_ranks, self.worker_ranks = self._layout(self.size, self.options)
        self.flat = FlatParams(self.params if self.subset else model)
        self.ranges = shard_ranges(self.flat.numel, len(self.server_ranks))
        self.is_worker = self.rank in self.worker_ranks
        self.shard = self.server_ranks.index(self.rank) if self.rank in self.server_ranks else None
        # The PS protocol runs on its own communicator: its tags cannot match anything else.
        self.pcomm = parent.Dup()
        # Several servers agree on fp16 overflow among themselves (a collective over them).
        scaled_shards = self.scaler is not None and len(self.server_ranks) > 1
        self.scomm = self.pcomm.Split(0 if self.shard is not None else MPI.UNDEFINED, self.rank) \
            if scaled_shards else MPI.COMM_NULL
        self._step = 0
        self._finished = False
        self.host = LocalAggregation(self.pcomm, self.server_ranks, self.name) \
            if getattr(self.options, "local_aggregation", False) else None
        self.backup = self._backup_workers()
        self._posted: dict = {}       # backup workers: receives kept across rounds
        self.init_bytes = broadcast_initial(self.pcomm, self.flat, self.timeout_s, self.name)
        dtype = self.flat.dtype
        self.server_scaler = None
        if self.is_worker:
            self._push = [Wire(hi - lo, dtype) for lo, hi in self.ranges]
            self._pull = [Wire(hi - lo, dtype) for lo, hi in self.ranges]
        if self.shard is not None:
            lo, hi = self.ranges[self.shard]
            self.holder = self._make_holder(lo, hi)    # after the sync: starts from rank 0's model
            # remote workers, or with local aggregation the other hosts' first ranks
            self._active = {w for w in (self.host.leaders if self.host else self.worker_ranks) if w != self.rank}
            self._inbox = {w: Wire(hi - lo, dtype) for w in self._active}
            self._out = Wire(hi - lo, dtype)
            self._acc = self._out.data.clone()
            self.server_totals = {"rounds": 0, "bytes_sent": 0, "bytes_received": 0,
                                  "update_s": 0.0, "left_out": 0}
            # A co-located server keeps its own copy of the scale rule's state, so that its
            # worker's update of the shared scaler is not applied twice; each answer lets
            # the workers check that they agree with it.
            self.server_scaler = None if self.scaler is None else (
                self.scaler.clone() if self.is_worker else self.scaler)

    # ------------------------------------------------------------ layout (overridden by ps-sharded)
    def _layout(self, size: int, options: PSOptions) -> Layout:
        """(server ranks, worker ranks), the same on every rank (psrt.dp.roles)."""
        return ps_layout(size, options.servers)

    def _make_holder(self, lo: int, hi: int):
        return ModelShard(self.flat, self.make_optimizer)

    @property
    def num_workers(self) -> int:
        return len(self.worker_ranks)

    @property
    def worker_rank(self) -> int:
        """This rank's index among the workers (for splitting data), -1 on a dedicated server."""
        return self.worker_ranks.index(self.rank) if self.is_worker else -1

    def memory(self) -> dict:
        held = super().memory()
        held["optimizer"] = self.holder.optimizer if self.shard is not None else []
        return held

    def optimizer_state_bytes(self) -> int:
        return 0 if self.shard is None else optimizer_state_bytes(self.holder.optimizer)

    def optimizer_state_numel(self) -> int:
        """Elements of optimizer state on this rank (0 on a rank that serves nothing)."""
        return 0 if self.shard is None else self.holder.state_numel()

    # ------------------------------------------------------------ protocol
    def begin(self, microbatches: int) -> None:
        if not self.is_worker:
            raise PsrtError(f"--dp {self.name}: rank {self.rank} is a dedicated server; call serve()")
        if self._finished:
            raise PsrtError(f"--dp {self.name}: rank {self.rank} called step() after finish()")
        for p in self.flat.params:
            p.grad = None

    def complete(self, loss: float) -> StepStats:
        """Push this rank's gradient to every server, serve its own shard's round where it
        is a server too, pull the new parameters."""
        trace = self.tracer
        t0 = t1 = now()
        pushes, sent = [], 0
        for s, srv in enumerate(self.server_ranks):
            wire = self._push[s]
            self.flat.grads_into(wire.data, *self.ranges[s])
            fill_push(wire, self._step, loss, self.scaler)
            if self.host is not None:
                sent += self.host.gather(wire)
                if not self.host.leader:
                    break
            if srv != self.rank:
                pushes.append((s, self.pcomm.Isend(wire.msg(), srv, TAG_PUSH)))
                sent += wire.nbytes
        update_s, send_reqs = 0.0, []
        if self.shard is not None:
            send_reqs, nbytes, update_s = self._serve_round(own=self._push[self.shard])
            sent += nbytes
        # The receives for the answers are posted after this rank's own sends (its pushes,
        # and its server's answers), as schedule.post orders a ring's step.  Posted earlier,
        # the go-ahead for a peer server's answer left as soon as that answer's header came,
        # on the one connection between the two ranks, behind whatever this rank's server
        # was already sending that peer: where two ranks serve each other (ps-sharded), the
        # later of their two answers waited for the earlier one to drain.  Measured with
        # VGG-16's profile on 4 emulated hosts of 4 ranks, a step of 4.3-4.7 s before,
        # 3.55-3.6 s after (the step model: 3.72 s).
        reqs, peers = [], []         # peers: the server each request waits for (None: this rank's own answers)
        for s, push in pushes:
            srv = self.server_ranks[s]
            reqs += [self.pcomm.Irecv(self._pull[s].msg(), srv, TAG_PULL), push]
            peers += [srv, srv]
        reqs += send_reqs
        peers += [None] * len(send_reqs)
        with trace.span("push and pull", "comm", bytes=sent):
            wait_all(reqs, self.timeout_s, lambda p: f"--dp {self.name} worker rank {self.rank}: no "
                     f"parameters from server rank(s) {sorted({peers[i] for i in p} - {None})} for step "
                     f"{self._step} after {self.timeout_s:.0f} s",
                     peers=peers, comm=self.pcomm, who=f"--dp {self.name} worker rank {self.rank}")
        answers = [self._out if srv == self.rank else self._pull[s] for s, srv in enumerate(self.server_ranks)]
        if self.host is not None:
            self.host.spread(answers[0])
        with trace.span("load parameters", "compute"):
            for s, (srv, src) in enumerate(zip(self.server_ranks, answers)):
                if int(src.head[0]) != self._step:
                    raise PsrtError(f"--dp {self.name} worker rank {self.rank}: server rank {srv} answered "
                                    f"step {int(src.head[0])} while this rank is at step {self._step}")
                self.flat.load(src.data, *self.ranges[s])
        if self.scaler is not None:
            self._follow(answers)
        # Every server averaged the same workers' losses; shard 0's answer is the global loss.
        global_loss = float(answers[0].head[1])
        self._step += 1
        total = now() - t0
        compute = (t1 - t0) + update_s
        return StepStats(loss=global_loss, compute_s=compute, comm_s=max(0.0, total - compute),
                         bytes_sent=sent, extra={"step": self._step, "local_loss": loss})

    def _follow(self, answers: list[Wire]) -> None:
        """fp16 on a worker: the servers' decision (skipped or not) moves this rank's scale by
        the same rule, which must land where theirs did."""
        decisions = {(float(a.head[FOUND]), float(a.head[SCALE])) for a in answers}
        if len(decisions) != 1:
            raise PsrtError(f"--dp {self.name} worker rank {self.rank}: the servers disagree on step "
                            f"{self._step}'s overflow decision and loss scale {sorted(decisions)}")
        found, scale = decisions.pop()
        self.scaler.update(bool(found))
        if self.scaler.scale != scale:
            raise PsrtError(f"--dp {self.name} worker rank {self.rank}: loss scale {self.scaler.scale} after "
                            f"step {self._step}, the servers have {scale}")

    def _serve_round(self, own: Wire | None = None) -> tuple[list, int, float]:
        """Receive one message from every active worker, average the gradients in rank order,
        update this server's shard and start sending it back.

        Returns (send requests, bytes they carry, seconds spent in the update).  A DONE
        sentinel instead of a gradient retires that worker; `own` is this rank's gradient
        when the server is also a worker."""
        remote = sorted(self._active)
        inbox = self._inbox
        with self.tracer.span("server: wait for pushes", "wait", workers=len(remote)):
            tags = self._receive_pushes(remote)
        parts, steps, losses, contributors, heads = [], {}, [], [], []
        for w in sorted(remote + ([self.rank] if own is not None else [])):
            if w == self.rank:
                wire = own
            elif w not in tags:               # a backup worker's push, left out this step
                continue
            elif tags[w] == TAG_DONE:
                self._active.discard(w)
                continue
            elif tags[w] != TAG_PUSH:
                raise PsrtError(f"--dp {self.name} server rank {self.rank}: unexpected tag "
                                f"{tags[w]} from rank {w}")
            else:
                wire = inbox[w]
                self.server_totals["bytes_received"] += wire.nbytes
            parts.append(wire.data)
            heads.append(wire.head)
            steps[w] = int(wire.head[0])
            losses.append(float(wire.head[1]))
            contributors.append(w)
        if not parts:
            return [], 0, 0.0
        if len(set(steps.values())) > 1:
            listing = ", ".join(f"rank {w} at step {s}" for w, s in steps.items())
            raise PsrtError(f"--dp {self.name} server rank {self.rank}: workers disagree on the "
                            f"step number ({listing}); did they resume from different checkpoints?")
        t0 = now()
        with self.tracer.span("server: reduce", "server", workers=len(parts)):
            avg = average_in_order(parts, self._acc)
            if self.host is not None:          # parts are hosts' sums: the mean is over workers
                avg.mul_(len(parts) / self.num_workers)
            skip = self._unscale(avg, heads)
        with self.tracer.span("optimizer", "server", skipped=bool(skip)):
            if skip:
                self.holder.current(self._out.data)
            else:
                self.holder.apply(avg, self._out.data)
        update_s = now() - t0
        self._out.head[0] = next(iter(steps.values()))
        self._out.head[1] = sum(losses) / (self.num_workers if self.host else len(losses))   # rank order
        self._out.head[FOUND] = float(skip)
        self._out.head[SCALE] = self.server_scaler.scale if self.server_scaler else 1.0
        # with backup workers the ones left out get the parameters too
        answered = [w for w in remote if w in self._active] if self.backup else contributors
        send = [self.pcomm.Isend(self._out.msg(), w, TAG_PULL) for w in answered if w != self.rank]
        nbytes = len(send) * self._out.nbytes
        totals = self.server_totals
        totals["left_out"] += len([w for w in answered if w != self.rank]) - len([w for w in contributors
                                                                                if w != self.rank])
        totals["rounds"] += 1
        totals["bytes_sent"] += nbytes
        totals["update_s"] += update_s
        return send, nbytes, update_s

    def _receive_pushes(self, remote: list[int]) -> dict[int, int]:
        """{worker: tag} of this round's pushes (or DONE): all of them, or with backup workers
        the first len(remote) - b."""
        def what(pending):
            return (f"--dp {self.name} server rank {self.rank}: no gradient or DONE from worker rank(s) "
                    f"{pending} after {self.timeout_s:.0f} s (a worker stopped without calling finish()?)")
        if self.backup:
            return first_pushes(self.pcomm, self._inbox, self._posted, remote, max(1, len(remote) - self.backup),
                                self._step, self.timeout_s, what)
        reqs = [self.pcomm.Irecv(self._inbox[w].msg(), w, MPI.ANY_TAG) for w in remote]
        statuses = wait_all(reqs, self.timeout_s, lambda p: what([remote[i] for i in p]), peers=remote,
                            comm=self.pcomm, who=f"--dp {self.name} server rank {self.rank}")
        return {w: st.Get_tag() for w, st in zip(remote, statuses)}

    def _backup_workers(self) -> int:
        b = int(getattr(self.options, "backup_workers", 0) or 0)
        if b and (b < 0 or b >= self.num_workers or len(self.server_ranks) != 1 or self.server_ranks[0] != 0
                  or 0 not in self.worker_ranks or self.host is not None):
            raise PsrtError(f"--dp {self.name} --backup-workers {b}: needs rank 0 as the one server, "
                            f"training too (--servers 0), no --local-aggregation, and fewer than the "
                            f"{self.num_workers} workers", everywhere=True)
        return b

    def _unscale(self, avg, heads: list) -> bool:
        """fp16 on a server: whether every server skips this step; if not, the average is
        unscaled in place.  An inf or NaN in any worker's gradient reaches the average of
        its slice, and a sum of finite values may overflow too, so each server checks its
        average and several servers agree by one all-reduce among them: an overflow in one
        slice skips the step on every server.  The scale moves by GradScaler's rule."""
        scaler = self.server_scaler
        if scaler is None:
            return False
        scales = {float(h[SCALE]) for h in heads}
        if scales != {scaler.scale}:
            raise PsrtError(f"--dp {self.name} server rank {self.rank}: workers computed step "
                            f"{int(heads[0][0])} with loss scale(s) {sorted(scales)}, this server is at {scaler.scale}")
        skip = overflowed([avg])
        if self.scomm != MPI.COMM_NULL:
            mine, every = np.array([int(skip)], dtype=np.int32), np.zeros(1, dtype=np.int32)
            req = self.scomm.Iallreduce(mine, every, op=MPI.MAX)
            wait_all([req], self.timeout_s, lambda p: f"--dp {self.name} server rank {self.rank}: the other "
                     f"servers did not share their overflow check within {self.timeout_s:.0f} s")
            skip = bool(every[0])
        if not skip:
            avg.mul_(1.0 / scaler.scale)        # as GradScaler: unscale the averaged gradient
        scaler.update(skip)
        return skip

    def serve(self, rounds: int | None = None) -> bool:
        """Dedicated servers: answer rounds until every worker has sent its DONE sentinel, or
        until `rounds` updates were made (so a server can checkpoint between calls).
        Returns True once every worker has finished."""
        if self.shard is None:
            return True
        if self.is_worker and not self._finished:
            raise PsrtError(f"--dp {self.name}: rank {self.rank} is a worker; it serves inside "
                            "step() and finish(), not serve()")
        done = 0
        while self._active and (rounds is None or done < rounds):
            send, _, _ = self._serve_round()
            done += bool(send)
            wait_all(send, self.timeout_s, lambda p: f"--dp {self.name} server rank {self.rank}: "
                     f"workers did not take their parameters within {self.timeout_s:.0f} s")
        return not self._active

    def finish(self) -> None:
        """Workers send DONE to every server; a server keeps serving until all workers are done."""
        if self._finished:
            return
        self._finished = True
        if self.is_worker:
            reqs = []
            for s, srv in enumerate(self.server_ranks):
                if srv != self.rank and (self.host is None or self.host.leader):
                    self._push[s].head[0] = self._step
                    reqs.append(self.pcomm.Isend(self._push[s].head_msg(), srv, TAG_DONE))
            wait_all(reqs, self.timeout_s, lambda p: f"--dp {self.name} worker rank {self.rank}: "
                     f"servers did not take the DONE sentinel within {self.timeout_s:.0f} s")
        self.serve()
        if self.host is not None:
            self.host.free()
        if self.scomm != MPI.COMM_NULL:
            self.scomm.Free()
        self.pcomm.Free()

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """This rank's part: the model, the step, and on a server its optimizer (shard)."""
        ps = {"step": self._step}
        if self.shard is not None:
            ps["server"] = self.holder.state_dict()
        state = {"model": self.model.state_dict(), "ps": ps}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        if self.server_scaler is not None:
            ps["server_scaler"] = self.server_scaler.state_dict()
        return state

    def load_scaler(self, state: dict) -> None:
        """fp16: the scale and its counters from a checkpoint (a rank's own, or any rank's:
        every rank keeps the same)."""
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
            if self.server_scaler is not None:
                self.server_scaler.load_state_dict(state["ps"].get("server_scaler", state["scaler"]))

    # A run on another number of ranks continues when its servers split the parameters the
    # same way (one server, or --servers unchanged): each server takes its old shard's state.
    # ps-sharded's servers reshard their key ranges (ps_sharded.py).
    reshardable = True

    def load_resharded(self, states: list[dict]) -> None:
        servers = sorted((s for s in states if "server" in s["ps"]), key=lambda s: s["ps"]["server"]["lo"])
        if [(s["ps"]["server"]["lo"], s["ps"]["server"]["hi"]) for s in servers] != [tuple(r) for r in self.ranges]:
            raise PsrtError(f"--resume: the checkpoint's {len(servers)} parameter server(s) split the "
                            f"parameters otherwise than this run's {len(self.ranges)}: keep --servers, "
                            "or use --dp ps-sharded, whose servers reshard", everywhere=True)
        self.load_state_dict(servers[self.shard] if self.shard is not None else states[0])

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.load_scaler(state)
        ps = state.get("ps", {})
        self._step = int(ps.get("step", 0))
        if self.shard is not None:
            where = f"--dp {self.name} server rank {self.rank}"
            if "server" not in ps:
                raise PsrtError(f"{where}: the checkpoint has no server state (optimizer); load "
                                "each rank's own state_dict")
            self.holder.load_state_dict(ps["server"], where)


class LocalAggregation:
    """The ranks of this rank's host (psrt.world.host_key) within the strategy's group: its
    first rank sums their pushes and hands the server's answer back to them."""

    def __init__(self, comm, server_ranks: list[int], name: str):
        from psrt.collectives.hierarchical import Placement
        from psrt.world import host_key
        if server_ranks != [0]:
            raise PsrtError(f"--dp {name} --local-aggregation: needs rank 0 as the one server "
                            f"(--servers 0), not ranks {server_ranks}", everywhere=True)
        placement = Placement.from_keys(comm.allgather(host_key()))
        rank = comm.Get_rank()
        self.leaders = [r for r, j in enumerate(placement.local_of) if j == 0]
        self.comm = comm.Split(placement.host_of[rank], rank)
        self.leader = self.comm.Get_rank() == 0

    def gather(self, wire) -> int:
        """Sum the host's gradients and losses into the first rank's wire (other header
        fields are equal on every worker); returns the bytes this rank sent."""
        from psrt.collectives import native
        if self.comm.Get_size() == 1:
            return 0
        native.reduce(self.comm, wire.data, 0, "sum")
        losses = self.comm.reduce(float(wire.head[1]), op=MPI.SUM, root=0)
        if self.leader:
            wire.head[1] = losses
            return 0
        return wire.data.numel() * wire.data.element_size()

    def spread(self, answer) -> None:
        """The server's answer (parameters and header) from the first rank to the others."""
        if self.comm.Get_size() > 1:
            self.comm.Bcast(answer.msg(), 0)

    def free(self) -> None:
        self.comm.Free()
