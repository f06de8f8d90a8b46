"""Bucketed all-reduce data parallelism: the PyTorch DDP / Horovod shape on psrt's collectives.

Every rank holds the whole model.  Gradients are grouped into buckets of about `bucket_mb`
in reverse parameter order, because backward produces them roughly in that order, and a
bucket is all-reduced (averaged) as soon as its last gradient is accumulated, on the
Communicator's worker thread, while backward goes on computing the next ones (Li et al.,
"PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020,
sections 3.2.2-3.2.3; Sergeev & Del Balso, "Horovod", 2018, call it tensor fusion).

Buckets are launched strictly in index order, whatever order their gradients arrive in,
because MPI needs every rank to start collectives on a communicator in the same order
(MPI 4.1 sec. 6.14) and two ranks may finish their gradients in different orders.

RingDDP, NativeDDP and TorchDDP differ only in the reducer's algorithm.  Reducers are
interchangeable behind one signature, `reducer(flat) -> waitable`, leaving the average of
`flat` over ranks in `flat` after `wait()` (the shape of torch's ddp_comm_hooks).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from psrt.collectives.algorithms import THROUGH_TORCH
from psrt.collectives.cost import wire_bytes
from psrt.dp import DEFAULT_BUCKET_MB
from psrt.dp.base import DataParallel, StepStats
from psrt.dp.common import COMPRESS, Then, check_compress, group_by_bytes, join_torch
from psrt.errors import PsrtError


class AllreduceReducer:
    """Average over ranks with `group.allreduce(op="avg")` and a fixed algorithm."""

    def __init__(self, group, algorithm: str):
        self.group, self.algorithm = group, algorithm

    def __call__(self, flat: torch.Tensor):
        return self.group.allreduce(flat, op="avg", out=flat, algorithm=self.algorithm, async_op=True)

    def wire_bytes(self, flat: torch.Tensor) -> int:
        nbytes = flat.numel() * flat.element_size()
        algo = self.group.pick("allreduce", nbytes, self.algorithm)
        return wire_bytes("allreduce", algo, nbytes, self.group.size, self.group.rank)


class CompressedReducer(AllreduceReducer):
    """Send gradients as fp16 or bf16: half the bytes, about 3 (fp16) or 2 (bf16) digits.

    The bucket is divided by N *before* the cast and summed on the wire, instead of summed
    and then divided, so the sum of N fp16 values cannot overflow where the average would
    not (the reasoning of torch's fp16_compress_hook)."""

    def __init__(self, group, algorithm: str, dtype: torch.dtype):
        super().__init__(group, algorithm)
        self.dtype = dtype
        self._wire: dict[int, torch.Tensor] = {}

    def __call__(self, flat: torch.Tensor):
        wire = self._wire.get(id(flat))
        if wire is None or wire.numel() != flat.numel():
            wire = self._wire[id(flat)] = torch.empty(flat.numel(), dtype=self.dtype, device=flat.device)
        wire.copy_(flat.div_(self.group.size))
        handle = self.group.allreduce(wire, op="sum", out=wire, algorithm=self.algorithm, async_op=True)
        return Then(handle, lambda _: flat.copy_(wire))

    def wire_bytes(self, flat: torch.Tensor) -> int:
        return super().wire_bytes(flat) * torch.empty(0, dtype=self.dtype).element_size() // flat.element_size()


class _Bucket:
    def __init__(self, params: list):
        self.params = params
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        # One spare element at the end of every bucket: the last one carries the loss.
        self.flat = torch.zeros(self.offsets[-1] + 1, dtype=params[0].dtype, device=params[0].device)
        self.seen = [False] * len(params)
        self.left = len(params)
        self.handle = None

    def slot(self, i: int) -> torch.Tensor:
        return self.flat[self.offsets[i]:self.offsets[i + 1]]

    def reset(self) -> None:
        self.seen = [False] * len(self.params)
        self.left = len(self.params)
        self.handle = None


def make_buckets(params: list, bucket_bytes: int) -> list[_Bucket]:
    """Group `params` in reverse order into buckets of at least `bucket_bytes` (the last may
    be smaller); a change of dtype or device starts a new bucket."""
    backward = list(reversed(params))
    return [_Bucket([backward[i] for i in idx]) for idx in group_by_bytes(backward, bucket_bytes)]


@dataclass(frozen=True)
class DDPOptions:
    """Options of the bucketed all-reduce strategies (ring, native, torch).

    bucket_mb: bucket size in MiB (default 25, PyTorch DDP's bucket_cap_mb: fewer, larger
        collectives pay less latency; smaller buckets start earlier in backward).
    overlap: launch each bucket as soon as it is ready (default True); False reduces all
        buckets after backward, the baseline for measuring overlap.
    compress: "none", "fp16" or "bf16": the dtype gradients travel in.
    algorithm: the all-reduce algorithm (default: the strategy's own).
    """

    bucket_mb: float = DEFAULT_BUCKET_MB
    overlap: bool = True
    compress: str = "none"
    algorithm: str | None = None

    def __post_init__(self):
        check_compress(self.compress)
        if not self.bucket_mb > 0:
            raise PsrtError(f"--bucket-mb {self.bucket_mb}: must be positive", everywhere=True)


class DDP(DataParallel):
    """Data parallelism by all-reducing gradient buckets during backward (see DDPOptions)."""

    name = "ddp"
    default_algorithm = "ring"
    Options = DDPOptions

    def __init__(self, model, make_optimizer, group, params=None, **options):
        super().__init__(model, make_optimizer, group, params=params, **options)
        opts = self.options
        self.algorithm = opts.algorithm or self.default_algorithm
        self.overlap = opts.overlap
        wire = COMPRESS[opts.compress]
        self.reducer = (CompressedReducer(group, self.algorithm, wire) if wire
                        else AllreduceReducer(group, self.algorithm))
        self._prepare_backend()
        self.broadcast_initial()
        params = self.params
        if not params:
            raise PsrtError("the model has no trainable parameters")
        self.optimizer = make_optimizer(params)
        self.buckets = make_buckets(params, int(opts.bucket_mb * 2 ** 20))
        self._syncing = False
        self._next = 0                 # index of the next bucket to launch
        self._launched_in_backward = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(b, i))
                       for b, bucket in enumerate(self.buckets) for i, p in enumerate(bucket.params)]

    def _prepare_backend(self) -> None:
        if self.algorithm in THROUGH_TORCH:
            join_torch(self.group, self.model)

    # ------------------------------------------------------------------ gradient sync
    def _hook(self, b: int, i: int):
        def hook(p: torch.Tensor) -> None:
            if not self._syncing:
                return
            bucket = self.buckets[b]
            if not bucket.seen[i]:
                bucket.seen[i] = True
                bucket.left -= 1
                bucket.slot(i).copy_(p.grad.reshape(-1))
            if self.overlap:
                self._launch_ready(in_backward=True)
        return hook

    def _launch(self, bucket: _Bucket) -> None:
        bucket.handle = self.reducer(bucket.flat)

    def _launch_ready(self, in_backward: bool) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].left == 0:
            self._launch(self.buckets[self._next])
            self._launched_in_backward += in_backward
            self._next += 1

    def _flush(self) -> None:
        """After backward: launch what is left, in order.  A parameter that got no gradient
        on this rank contributes zeros (or what earlier micro-batches accumulated), so every
        rank still reduces every bucket (torch DDP's find_unused_parameters, simplified)."""
        for bucket in self.buckets[self._next:]:
            for i, p in enumerate(bucket.params):
                if not bucket.seen[i]:
                    slot = bucket.slot(i)
                    slot.copy_(p.grad.reshape(-1)) if p.grad is not None else slot.zero_()
                    bucket.seen[i] = True
            bucket.left = 0
        self._launch_ready(in_backward=False)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate into .grad; the next synced one reduces all."""
        old, self._syncing = self._syncing, False
        try:
            yield
        finally:
            self._syncing = old

    # ------------------------------------------------------------------ the component contract
    def begin(self, microbatches: int) -> None:
        super().begin(microbatches)
        for bucket in self.buckets:
            bucket.reset()
        self._next = self._launched_in_backward = 0
        self._loss_placed = False

    @contextlib.contextmanager
    def microbatch(self, k: int):
        try:
            yield
        finally:
            self._syncing = False

    def before_backward(self, k: int, loss: float) -> None:
        """The last micro-batch's backward reduces: its buckets launch as they fill."""
        if k == self.microbatches - 1:
            self._place_loss(loss)
            self._syncing = True

    def _place_loss(self, loss: float) -> None:
        self.buckets[-1].flat[-1] = loss        # the loss travels with the last bucket
        self._loss_placed = True

    def complete(self, loss: float) -> StepStats:
        if not self._loss_placed:               # a pipeline schedule: nothing launched yet
            self._place_loss(loss)
        self._flush()
        waited = time.perf_counter()
        with self.tracer.span("wait for buckets", "wait", buckets=len(self.buckets)):
            for bucket in self.buckets:
                bucket.handle.wait()
        comm_s = time.perf_counter() - waited
        # The optimizer reads the averaged gradients where they landed, in the buckets
        # (PyTorch DDP's gradient_as_bucket_view), instead of a copy.  The next step's
        # begin() detaches them again before backward writes.
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                p.grad = bucket.slot(i).view_as(p)
        with self.tracer.span("optimizer", "compute"):
            self.optimizer.step()
        sent = sum(self.reducer.wire_bytes(b.flat) for b in self.buckets)
        return StepStats(loss=float(self.buckets[-1].flat[-1]), comm_s=comm_s,
                         bytes_sent=sent, extra={"buckets": len(self.buckets),
                                                 "launched_in_backward": self._launched_in_backward})

    def finish(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    # Every replica holds the same model and optimizer state (the all-reduce keeps them so):
    # a run on any number of ranks continues from any one of them.
    reshardable = True

    def load_resharded(self, states: list[dict]) -> None:
        self.load_state_dict(states[0])



class RingDDP(DDP):
    """Buckets all-reduced by psrt's ring (reduce-scatter + all-gather)."""
    name, default_algorithm = "ring", "ring"


class NativeDDP(DDP):
    """Buckets all-reduced by the MPI library's own MPI_Allreduce."""
    name, default_algorithm = "native", "native"


class TorchDDP(DDP):
    """Buckets all-reduced by torch.distributed (gloo on CPU, nccl on GPU)."""
    name, default_algorithm = "torch", "torch"

