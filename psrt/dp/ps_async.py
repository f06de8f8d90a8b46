"""`--dp ps-async`: a parameter server with bounded staleness (stale-synchronous parallel).

Workers push gradients and pull parameters without a global barrier.  Each worker has a
clock (gradients pushed so far); a worker about to compute clock t may proceed only while the
slowest worker is at clock >= t - s (Ho et al., "More Effective Distributed ML via a Stale
Synchronous Parallel Parameter Server", NIPS 2013).  The server applies one optimizer step per
clock, with the average of that clock's gradients summed in worker-rank order, as soon as
every worker still training has pushed it; a worker's pull is answered when the SSP condition
lets it go on.  So s = 0 is exactly `--dp ps --servers 1` (bitwise), and s > 0 lets fast
workers run up to s clocks ahead on parameters that miss at most the last s clocks.

Consistency (docs/explanation/parameter_server.md): a worker computing clock t sees every update of clocks
< t - s, and never part of a clock; it does not see its own gradients of clocks that are still
incomplete (Ho et al.'s read-my-writes is traded for an update that is one optimizer step per
clock, which is what makes s = 0 equal to synchronous training for any optimizer).

The server is a dedicated rank (the last one), not a thread on rank 0: a Python server thread
would share the GIL with rank 0's forward/backward and every pull would wait for it; with its
own rank the server answers at once, its cost shows on its own link, and the protocol stays
single-threaded (no MPI_THREAD_MULTIPLE locking on the training path).

fp16 (a psrt.dp.precision.ScaledFactory as make_optimizer): the server runs the scale rule
per clock.  Each push carries the scale its gradient was computed with; the server checks
each gradient, brings the clock's to one scale before averaging, skips a clock that overflowed
(the update is the identity, the clock still counts), halves the scale only for an overflow
computed at the present scale or below (a stale push from before a halving does not halve it
again), and every answer tells the worker the scale to compute with next.  With staleness 0
this is the synchronous rule exactly (psrt/dp/precision.py).

Options: see AsyncPSOptions.
"""
from __future__ import annotations

from dataclasses import dataclass

from psrt.dp.base import DataParallel, StepStats
from psrt.dp.common import optimizer_state_bytes
from psrt.dp.precision import overflowed, split
from psrt.dp.ps_protocol import (ASYNC_HEADER, SCALE, TAG_DONE, TAG_FINAL, TAG_PULL, TAG_PUSH,
                                 FlatParams, ModelShard, Wire, average_in_order, broadcast_initial,
                                 fill_push, local_backward, now, probe_any, timeout_option, wait_all)
from psrt.dp.roles import async_layout
from psrt.errors import PsrtError


class SSPTable:
    """The server's clock bookkeeping, free of MPI so it can be tested in one process.

    clock[w]: gradients pushed by worker w.  applied: clocks whose update is in the
    parameters.  A clock is complete when every active worker has pushed it; workers that
    sent DONE no longer hold anyone back."""

    def __init__(self, workers: list[int], staleness: int):
        self.staleness = staleness
        self.clock = {w: 0 for w in workers}
        self.active = set(workers)
        self.applied = 0
        self.pending: dict[int, dict[int, object]] = {}   # clock -> worker -> gradient
        self.waiting: set[int] = set()                    # workers waiting for parameters

    def push(self, w: int, clock: int, grad) -> None:
        self._check(w, clock, "a gradient")
        self.pending.setdefault(clock, {})[w] = grad
        self.clock[w] += 1
        self.waiting.add(w)

    def retire(self, w: int, clock: int) -> None:
        self._check(w, clock, "DONE")
        self.active.discard(w)

    def _check(self, w: int, clock: int, what: str) -> None:
        if w not in self.active:
            raise PsrtError(f"--dp ps-async server: {what} from rank {w}, which is not an active worker")
        if clock != self.clock[w]:
            raise PsrtError(f"--dp ps-async server: {what} from rank {w} at clock {clock}, "
                            f"expected clock {self.clock[w]}")

    def min_clock(self) -> int:
        return min((self.clock[w] for w in self.active), default=self.applied)

    def complete(self) -> list[tuple[int, list]]:
        """Clocks that just became complete, in order, each with its gradients in rank order."""
        out = []
        while self.applied in self.pending and all(self.clock[w] > self.applied for w in self.active):
            grads = self.pending.pop(self.applied)
            out.append((self.applied, [grads[w] for w in sorted(grads)]))
            self.applied += 1
        return out

    def releasable(self) -> list[int]:
        """Waiting workers SSP lets proceed: one about to compute clock t may read parameters
        holding `applied` clocks when t - applied <= s.  After `complete()`, applied is the
        slowest active worker's clock, so this is Ho et al.'s condition."""
        ready = sorted(w for w in self.waiting if self.clock[w] - self.applied <= self.staleness)
        self.waiting.difference_update(ready)
        return ready

    def finished(self) -> bool:
        return not self.active and not self.pending


@dataclass(frozen=True)
class AsyncPSOptions:
    """servers: None or 1 (the one dedicated server).  staleness: s >= 0 (default 0).
    timeout_s: as in `--dp ps` (default PSRT_TIMEOUT).  record_clocks: keep a per-pull log on
    the server (for tests)."""

    servers: int | None = None
    staleness: int | None = None
    timeout_s: float | None = None
    record_clocks: bool = False


class AsyncParameterServer(DataParallel):
    name = "ps-async"
    composes = False               # its protocol owns the whole step (psrt.dp.base)
    Options = AsyncPSOptions

    def __init__(self, model, make_optimizer, group, **options):
        super().__init__(model, make_optimizer, group, **options)
        self.make_optimizer, self.scaler = split(make_optimizer)   # fp16: the server runs the rule
        options = self.options
        parent = group.comm
        self.rank, self.size = parent.Get_rank(), parent.Get_size()
        (self.server_rank,), self.worker_ranks = async_layout(self.size, options.servers)
        staleness = options.staleness or 0
        if int(staleness) != staleness or staleness < 0:
            raise PsrtError(f"--dp ps-async: --staleness must be an integer >= 0, got {staleness}",
                            everywhere=True)
        self.staleness = int(staleness)
        self.timeout_s = timeout_option(options.timeout_s, self.name)
        self.is_worker = self.rank != self.server_rank
        self.flat = FlatParams(model)
        self.pcomm = parent.Dup()                 # private channel for the PS protocol
        self._finished = False
        self._final_sent = False
        self._clock = 0
        self.init_bytes = broadcast_initial(self.pcomm, self.flat, self.timeout_s, self.name)
        m, dtype = self.flat.numel, self.flat.dtype
        if self.is_worker:
            self._push, self._pull = Wire(m, dtype), Wire(m, dtype, ASYNC_HEADER)
        else:
            self.holder = ModelShard(self.flat, self.make_optimizer)
            self.table = SSPTable(self.worker_ranks, self.staleness)
            self._out = Wire(m, dtype, ASYNC_HEADER)
            self._acc = self._out.data.clone()
            self._spare: list[Wire] = []          # gradient buffers of applied clocks, reused
            self._head = Wire(0, dtype)
            self._last_loss = float("nan")        # mean loss of the last applied clock
            self.clock_log: list[tuple] | None = [] if options.record_clocks else None
            self.server_totals = {"clocks_applied": 0, "bytes_sent": 0, "bytes_received": 0,
                                  "update_s": 0.0, "max_lead": 0, "pulls": 0}

    @property
    def num_workers(self) -> int:
        return len(self.worker_ranks)

    @property
    def worker_rank(self) -> int:
        return self.rank if self.is_worker else -1

    def memory(self) -> dict:
        held = super().memory()
        held["optimizer"] = self.holder.optimizer if not self.is_worker else []
        return held

    def optimizer_state_bytes(self) -> int:
        return 0 if self.is_worker else optimizer_state_bytes(self.holder.optimizer)

    def optimizer_state_numel(self) -> int:
        return 0 if self.is_worker else self.holder.state_numel()

    def _fail(self, what: str):
        return lambda pending: f"--dp ps-async rank {self.rank}: {what} within {self.timeout_s:.0f} s"

    # ------------------------------------------------------------ worker side
    def step(self, loss_fn, microbatches) -> StepStats:
        if not self.is_worker:
            raise PsrtError(f"--dp ps-async: rank {self.rank} is the dedicated server; call serve()")
        if self._finished:
            raise PsrtError(f"--dp ps-async: rank {self.rank} called step() after finish()")
        trace = self.tracer
        t0 = now()
        loss = local_backward(self.model, loss_fn, microbatches, trace)
        t1 = now()
        self.flat.grads_into(self._push.data)
        fill_push(self._push, self._clock, loss, self.scaler)
        # The pull is posted first: the push doubles as the request for parameters.
        with trace.span("push and pull", "comm", bytes=self._push.nbytes, clock=self._clock):
            reqs = [self.pcomm.Irecv(self._pull.msg(), self.server_rank, TAG_PULL),
                    self.pcomm.Isend(self._push.msg(), self.server_rank, TAG_PUSH)]
            wait_all(reqs, self.timeout_s, self._fail(f"no parameters for clock {self._clock + 1}"))
        clock, version, slowest = (int(v) for v in self._pull.head[:3])
        clock_loss = float(self._pull.head[3])
        if clock != self._clock + 1:
            raise PsrtError(f"--dp ps-async worker rank {self.rank}: the server answered clock "
                            f"{clock}, expected {self._clock + 1}")
        with trace.span("load parameters", "compute", version=version):
            self.flat.load(self._pull.data)
        self._follow()
        self._clock = clock
        total = now() - t0
        # version: clocks applied in the parameters this worker now holds; it computes clock
        # `clock` next, so its next gradient is `clock - version` clocks stale (<= s).
        extra = {"clock": clock, "version": version, "slowest_clock": slowest, "local_loss": loss}
        if version == clock:
            loss = clock_loss          # this step's clock is applied: its mean over all workers
        else:
            extra["loss_scope"] = "local"
        return StepStats(loss=loss, compute_s=t1 - t0, comm_s=total - (t1 - t0),
                         bytes_sent=self._push.nbytes, extra=extra)

    def _follow(self) -> None:
        """fp16 on a worker: the scale to compute the next clock with, and the clocks skipped
        so far, as the server's answer says."""
        if self.scaler is not None:
            self.scaler.follow(float(self._pull.head[4]), int(self._pull.head[5]))

    def finish(self) -> None:
        """Workers: send DONE and receive the final parameters (the same on every worker once
        all have finished).  Server: serve until then.  Idempotent."""
        if self._finished:
            return
        self._finished = True
        if self.is_worker:
            self._push.head[0] = self._clock
            reqs = [self.pcomm.Irecv(self._pull.msg(), self.server_rank, TAG_FINAL),
                    self.pcomm.Isend(self._push.head_msg(), self.server_rank, TAG_DONE)]
            wait_all(reqs, self.timeout_s, self._fail("no final parameters (other workers still "
                                                      "training or gone?)"))
            self.flat.load(self._pull.data)
            self._follow()
        else:
            self.serve()
        self.pcomm.Free()

    # ------------------------------------------------------------ server side
    def serve(self, rounds: int | None = None) -> bool:
        """Answer pushes, apply complete clocks, release the pulls SSP allows, until every
        worker has sent DONE (then send everyone the final parameters), or until `rounds`
        more clocks were applied (so the server can checkpoint between calls).
        Returns True once every worker has finished."""
        if self.is_worker:
            return True
        table = self.table
        target = None if rounds is None else table.applied + rounds
        while not table.finished() and (target is None or table.applied < target):
            self._handle_one()
        if table.finished() and not self._final_sent:
            self._final_sent = True
            out = self._out
            out.head[:3] = out.head.new_tensor([-1, table.applied, table.applied])
            out.head[4:] = out.head.new_tensor(self._scale_now())
            for w in self.worker_ranks:
                self.pcomm.Send(out.msg(), w, TAG_FINAL)
                self.server_totals["bytes_sent"] += out.nbytes
        return table.finished()

    def _handle_one(self) -> None:
        """Receive one message (push or DONE), apply what became complete, answer pulls."""
        table, totals, trace = self.table, self.server_totals, self.tracer
        with trace.span("server: wait for pushes", "wait", workers=len(table.active)):
            st = probe_any(self.pcomm, self.timeout_s, lambda: (
                f"--dp ps-async server rank {self.rank}: no message for {self.timeout_s:.0f} s from "
                f"active workers {sorted(table.active)} (clocks "
                f"{ {w: table.clock[w] for w in sorted(table.active)} })"))
            src, tag = st.Get_source(), st.Get_tag()
            if tag == TAG_PUSH:
                wire = self._spare.pop() if self._spare else Wire(self.flat.numel, self.flat.dtype)
                self.pcomm.Recv(wire.msg(), src, TAG_PUSH)
                totals["bytes_received"] += wire.nbytes
                table.push(src, int(wire.head[0]), wire)
            elif tag == TAG_DONE:
                self.pcomm.Recv(self._head.head_msg(), src, TAG_DONE)
                table.retire(src, int(self._head.head[0]))
            else:
                raise PsrtError(f"--dp ps-async server rank {self.rank}: unexpected tag {tag} from rank {src}")
        for _clock, wires in table.complete():
            t0 = now()
            self._apply_clock(wires)
            self._last_loss = sum(float(w.head[1]) for w in wires) / len(wires)
            totals["update_s"] += now() - t0
            totals["clocks_applied"] += 1
            self._spare.extend(wires)
        slowest = table.min_clock()
        released = table.releasable()
        if released:
            with trace.span("server: send parameters", "server", workers=released):
                self._release(released, slowest)

    def _release(self, workers: list[int], slowest: int) -> None:
        """Send the current parameters to each worker SSP lets go on."""
        table, out, totals = self.table, self._out, self.server_totals
        for w in workers:
            lead = table.clock[w] - slowest
            totals["max_lead"] = max(totals["max_lead"], lead)
            totals["pulls"] += 1
            if self.clock_log is not None:
                self.clock_log.append((w, table.clock[w], slowest, table.applied))
            out.head[:] = out.head.new_tensor([table.clock[w], table.applied, slowest, self._last_loss,
                                               *self._scale_now()])
            # Blocking send: w posted this receive before pushing, so it matches at once, and
            # `out` may be rewritten as soon as Send returns.
            self.pcomm.Send(out.msg(), w, TAG_PULL)
            totals["bytes_sent"] += out.nbytes

    def _apply_clock(self, wires: list[Wire]) -> None:
        """One clock's update from its gradients (in worker-rank order) into the parameters
        and the answer buffer.  Under fp16 the gradients are brought to the smallest scale
        among them (a power-of-two factor: exact), averaged, checked and unscaled, so a clock
        computed at one scale is averaged exactly as the synchronous servers do; a clock that
        overflowed is skipped (module docstring)."""
        scaler, out, trace = self.scaler, self._out.data, self.tracer
        if scaler is None:
            with trace.span("server: reduce", "server", workers=len(wires)):
                avg = average_in_order([w.data for w in wires], self._acc)
            with trace.span("optimizer", "server"):
                self.holder.apply(avg, out)
            return
        with trace.span("server: reduce", "server", workers=len(wires)):
            scales = [float(w.head[SCALE]) for w in wires]
            flagged = [scale for w, scale in zip(wires, scales) if overflowed([w.data])]
            low = min(scales)
            for w, scale in zip(wires, scales):
                if scale != low:
                    w.data.mul_(low / scale)
            avg = average_in_order([w.data for w in wires], self._acc)
            skip = bool(flagged) or overflowed([avg])
        with trace.span("optimizer", "server", skipped=skip):
            if skip:
                self.holder.current(out)
            else:
                self.holder.apply(avg.mul_(1.0 / low), out)
        scaler.update(skip, at_scale=min(flagged) if flagged else low)

    def _scale_now(self) -> list[float]:
        """The answer's last two slots: the scale to compute with, clocks skipped so far."""
        return [self.scaler.scale, self.scaler.skipped] if self.scaler is not None else [1.0, 0]

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        ps = {"clock": self._clock}
        if not self.is_worker:
            ps["server"] = self.holder.state_dict()
            ps["clocks_applied"] = self.table.applied
        state = {"model": self.model.state_dict(), "ps": ps}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()    # the server's rule, a worker's copy of it
        return state

    def load_state_dict(self, state: dict) -> None:
        """Model and (on the server) optimizer state.  Clocks restart at 0: they count pushes
        since this strategy was built and only their differences matter."""
        self.model.load_state_dict(state["model"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        ps = state.get("ps", {})
        if not self.is_worker:
            where = f"--dp ps-async server rank {self.rank}"
            if "server" not in ps:
                raise PsrtError(f"{where}: the checkpoint has no server state (optimizer); load "
                                "each rank's own state_dict")
            self.holder.load_state_dict(ps["server"], where)
