"""Execute a pipeline schedule: this rank's stages, its action list, MPI between ranks.

F(s, i): take micro-batch i's input (from the data on stage 0, else from the previous
stage's rank), run stage s, send the output on (or compute the loss on the last stage) and
keep input and output for the backward.  B(s, i): receive the gradient of the output (or
start from the weighted loss on the last stage), back-propagate through stage s, send the
input's gradient back.  Parameter gradients accumulate over micro-batches in `.grad`; the
caller zeroes them and steps the optimizer.

The loss of micro-batch i is scaled by `weights[i]` before its backward (default 1/m), so
the accumulated gradient is that of the whole batch's loss, as in GPipe's synchronous
update (Huang et al. 2019, sec. 2.2): the pipeline computes exactly what one process
computes on the whole batch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from psrt.errors import PsrtError
from psrt.pp.p2p import P2P
from psrt.pp.schedule import Schedule
from psrt.trace import OFF, Tracer

ACT, GRAD = 0, 1


@dataclass
class PipelineStats:
    """What one pipeline step did on this rank."""

    loss: float | None = None            # the batch loss (same on every pipeline rank)
    total_s: float = 0.0                 # wall time of the step
    busy_s: float = 0.0                  # time in forward / backward compute
    wait_s: float = 0.0                  # time blocked receiving
    bytes_sent: int = 0
    peak_activation_bytes: int = 0       # inputs + tensors autograd saved (params excluded)
    peak_live_microbatches: int = 0      # micro-batches between their F and their B
    extra: dict = field(default_factory=dict)

    @property
    def bubble(self) -> float:
        """Idle share of this rank's own step time (from its start to its last send; the
        schedule's bubble over all ranks is 1 - sum(busy_s) / (p * max(total_s)))."""
        return 1.0 - self.busy_s / self.total_s if self.total_s > 0 else 0.0


class _SavedBytes:
    """Counts the bytes autograd saves for backward (distinct storages, parameters excluded)."""

    def __init__(self, params: set[int]):
        self.params = params
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.params:
            self.storages[ptr] = t.untyped_storage().nbytes()
        return t

    @staticmethod
    def unpack(t):
        return t

    def total(self) -> int:
        return sum(self.storages.values())


class PipelineRuntime:
    """Runs `schedule` for this pipeline rank.

    Args:
        stages: stage id -> module, exactly the stages `schedule` puts on this rank.
        schedule: a validated Schedule (psrt.pp.schedule.make_schedule).
        comm: mpi4py communicator over the pipeline ranks (Grid.pp_comm); its size must be
            the schedule's number of ranks and its rank this rank's pipeline rank.
        loss_fn: (last stage output, target) -> scalar mean loss of the micro-batch.
        device: where activations live ("cpu" or a CUDA device).
        timeout_s: how long a receive waits before raising PsrtError (default PSRT_TIMEOUT).
        tracer: a psrt.trace.Tracer: each micro-batch's forward and backward is a span.
    """

    def __init__(self, stages: dict[int, nn.Module], schedule: Schedule, comm,
                 loss_fn: Callable, device="cpu", timeout_s: float | None = None, tracer: Tracer | None = None):
        self.rank = comm.Get_rank()
        self.tracer = tracer or OFF
        if comm.Get_size() != schedule.num_ranks:
            raise PsrtError(f"pipeline: schedule {schedule.name} is for {schedule.num_ranks} "
                            f"ranks but the pipeline communicator has {comm.Get_size()}")
        mine = schedule.stages_of(self.rank)
        if sorted(stages) != mine:
            raise PsrtError(f"pipeline rank {self.rank}: got stages {sorted(stages)}, "
                            f"the schedule places stages {mine} here")
        self.stages, self.schedule, self.loss_fn = stages, schedule, loss_fn
        self.device = torch.device(device)
        self.last = schedule.num_stages - 1
        self.p2p = P2P(comm, timeout_s, tracer=self.tracer)
        self.comm = comm
        self._params = {p.untyped_storage().data_ptr() for m in stages.values() for p in m.parameters()}

    def _tag(self, stage: int, mb: int, kind: int) -> int:
        return (mb * self.schedule.num_stages + stage) * 2 + kind

    def parameters(self):
        for s in sorted(self.stages):
            yield from self.stages[s].parameters()

    def step(self, inputs: list | None, targets: list | None, weights: list | None = None) -> PipelineStats:
        """One pass of the schedule over m micro-batches.

        Args:
            inputs: micro-batch inputs (read on the rank of stage 0 only; may be None elsewhere).
            targets: micro-batch targets (read on the rank of the last stage only).
            weights: loss weight per micro-batch (default 1/m; see partition.split_batch).
        """
        m = self.schedule.num_microbatches
        weights = weights if weights is not None else [1.0 / m] * m
        for name, seq, where in (("inputs", inputs, 0), ("targets", targets, self.last)):
            if where in self.stages and (seq is None or len(seq) != m):
                raise PsrtError(f"pipeline rank {self.rank}: stage {where} needs {m} micro-batch "
                                f"{name}, got {None if seq is None else len(seq)}")
        stats = PipelineStats()
        stash: dict[tuple[int, int], tuple] = {}
        live = loss_sum = 0.0
        start = time.perf_counter()
        for action in self.schedule.actions[self.rank]:
            s, i = action.stage, action.microbatch
            if action.op == "F":
                x = inputs[i].to(self.device) if s == 0 else self._recv(s - 1, s, i, ACT, stats)
                if s > 0:
                    if not x.is_floating_point():
                        raise PsrtError(f"pipeline: stage {s} received a {x.dtype} activation; "
                                        "tensors between stages must be floating point")
                    x.requires_grad_()
                t0, t0_ns = time.perf_counter(), self.tracer.clock()
                saved = _SavedBytes(self._params)
                saved.pack(x)           # the input is held until B too (counted once)
                with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                    y = self.stages[s](x)
                    if s == self.last:
                        loss = self.loss_fn(y, targets[i].to(self.device))
                        loss_sum += float(loss.detach()) * weights[i]
                        y = loss * weights[i]
                stats.busy_s += time.perf_counter() - t0
                self.tracer.add("forward", "pipeline", t0_ns, self.tracer.clock(), stage=s, microbatch=i)
                if s < self.last:
                    self.p2p.isend(y, self.schedule.rank_of(s + 1), self._tag(s + 1, i, ACT))
                nbytes = saved.total()
                stash[(s, i)] = (x, y, nbytes)
                live += nbytes
                stats.peak_activation_bytes = max(stats.peak_activation_bytes, int(live))
                stats.peak_live_microbatches = max(stats.peak_live_microbatches, len(stash))
            else:
                x, y, nbytes = stash.pop((s, i))
                grad = None if s == self.last else self._recv(s + 1, s, i, GRAD, stats)
                t0, t0_ns = time.perf_counter(), self.tracer.clock()
                if y.requires_grad:
                    torch.autograd.backward(y, grad_tensors=grad)
                stats.busy_s += time.perf_counter() - t0
                self.tracer.add("backward", "pipeline", t0_ns, self.tracer.clock(), stage=s, microbatch=i)
                if s > 0:
                    g = x.grad if x.grad is not None else torch.zeros_like(x)
                    self.p2p.isend(g, self.schedule.rank_of(s - 1), self._tag(s - 1, i, GRAD))
                live -= nbytes
        self.p2p.wait_all()
        stats.total_s = time.perf_counter() - start
        stats.bytes_sent = self.p2p.bytes_sent
        self.p2p.bytes_sent = 0
        # Every pipeline rank returns the loss (only the last stage's rank computed it).
        stats.loss = self.comm.bcast(loss_sum if self.last in self.stages else None,
                                     root=self.schedule.rank_of(self.last))
        return stats

    def _recv(self, peer_stage: int, stage: int, mb: int, kind: int, stats: PipelineStats):
        what = (f"activation of micro-batch {mb} for stage {stage}" if kind == ACT else
                f"gradient of micro-batch {mb} for stage {stage}")
        t0 = time.perf_counter()
        t = self.p2p.recv(self.schedule.rank_of(peer_stage), self._tag(stage, mb, kind),
                          self.device, what)
        stats.wait_s += time.perf_counter() - t0
        return t
