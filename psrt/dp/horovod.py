"""`--dp horovod`: Horovod's DistributedOptimizer behind psrt's DataParallel contract.

Horovod (Sergeev & Del Balso, "Horovod: fast and easy distributed deep learning in
TensorFlow", 2018) all-reduces each gradient from a hook as soon as backward has produced
it; its background thread fuses the ready tensors into one buffer per cycle (tensor fusion)
and reduces them with the MPI library's MPI_Allreduce (or gloo's ring).  psrt's ring DDP is
the same design built from psrt's own collectives, so the two can be compared on one
training loop and checked by one equivalence test.

Horovod must be started on exactly the ranks of psrt's data-parallel communicator: it is
given that communicator (`hvd.init(comm=...)`; Horovod duplicates it), and a Horovod already
started by someone else is accepted only if its ranks match.  Build horovod with
scripts/install_horovod.sh.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from psrt.collectives.cost import wire_bytes
from psrt.dp.base import DataParallel, StepStats
from psrt.dp.common import check_compress
from psrt.dp.precision import ScaledOptimizer, split
from psrt.errors import PsrtError

INSTALL_HINT = "--dp horovod needs horovod: run scripts/install_horovod.sh"
COMPRESSIONS = ("none", "fp16")   # what horovod.torch.Compression offers besides none


def import_horovod():
    """`horovod.torch`, or a one-line PsrtError that says how to install it."""
    try:
        import horovod.torch as hvd
    except ImportError as err:
        raise PsrtError(f"{INSTALL_HINT} ({err})", everywhere=True) from err
    return hvd


def init_horovod(group):
    """Start Horovod on the ranks of `group` (a psrt.Communicator) and return `horovod.torch`.

    Under an MPI launcher Horovod gets psrt's own mpi4py communicator, so its rank i is
    psrt's rank i even when data parallelism runs on a sub-communicator of the world.  Under
    `horovodrun --gloo` Horovod has no MPI and joins through its own rendezvous.  Either way
    the sizes and ranks are checked, because averaging over the wrong set of ranks would
    train silently wrong.
    """
    hvd = import_horovod()
    if not hvd.is_initialized():
        use_gloo = os.environ.get("HOROVOD_CONTROLLER") == "gloo" or not hvd.mpi_built()
        hvd.init() if use_gloo else hvd.init(comm=group.comm)
    if hvd.size() != group.size or hvd.rank() != group.rank:
        raise PsrtError(f"horovod runs on {hvd.size()} ranks (this is its rank {hvd.rank()}) but the psrt "
                        f"communicator has {group.size} (rank {group.rank}): start horovod on the same ranks "
                        "(one launch, no hvd.init() on another communicator)")
    return hvd


@dataclass(frozen=True)
class HorovodOptions:
    """compress: "none" or "fp16": the dtype gradients travel in (hvd.Compression).  psrt's
    bucket_mb, overlap and algorithm do not apply: Horovod fuses and overlaps on its own
    (HOROVOD_FUSION_THRESHOLD, HOROVOD_CYCLE_TIME)."""

    compress: str = "none"

    def __post_init__(self):
        check_compress(self.compress, COMPRESSIONS, "horovod")


class HorovodStrategy(DataParallel):
    """Gradients averaged by hvd.DistributedOptimizer (op=Average), during backward."""

    name = "horovod"
    composes = False               # its protocol owns the whole step (psrt.dp.base)
    Options = HorovodOptions

    def __init__(self, model, make_optimizer, group, **options):
        super().__init__(model, make_optimizer, group, **options)
        compress = self.options.compress
        hvd = self.hvd = init_horovod(group)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise PsrtError("the model has no trainable parameters")
        # Every rank starts from rank 0's parameters and buffers.
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        # fp16: hvd.DistributedOptimizer rebuilds the optimizer's own class around its param
        # groups, so it wraps the plain optimizer; the loss scaling wraps it in turn and
        # unscales the gradients Horovod has averaged (scaled_step).
        make, self.scaler = split(make_optimizer)
        inner = make([p for _, p in named])
        # fp16: divide by N before the sum instead of after it, so a sum of N fp16 gradients
        # cannot overflow where their average would not (gradient_predivide_factor = N makes
        # prescale 1/N and postscale 1; horovod/torch/optimizer.py, _allreduce_grad_async).
        self.optimizer = hvd.DistributedOptimizer(
            inner, named_parameters=named, op=hvd.Average,
            compression=hvd.Compression.fp16 if compress == "fp16" else hvd.Compression.none,
            gradient_predivide_factor=float(group.size) if compress == "fp16" else 1.0)
        self._scaled = ScaledOptimizer(self.optimizer, self.scaler) if self.scaler is not None else None
        self._broadcast_optimizer_state()
        # Bytes of gradients one step all-reduces (fp16 compression halves fp32's).
        self._wire_bytes = sum(p.numel() * (2 if compress == "fp16" else p.element_size()) for _, p in named)

    def _broadcast_optimizer_state(self) -> None:
        """Rank 0's optimizer state to every rank, when there is any.

        A fresh optimizer has no state on any rank, so there is nothing to send; and
        hvd.broadcast_optimizer_state would create it by taking one optimizer step with zero
        gradients (horovod 0.28.1, horovod/torch/functions.py), which is not neutral: Adam's
        step count becomes 1 (so every later bias correction is off by a step) and weight
        decay moves the parameters.  After a checkpoint is loaded the state is non-empty on
        every rank and is broadcast (what Horovod's examples do on resume, horovod#936).
        """
        if self.optimizer.state_dict()["state"]:
            self.hvd.broadcast_optimizer_state(self.optimizer, root_rank=0)

    def step(self, loss_fn, microbatches: list) -> StepStats:
        if not microbatches:
            raise PsrtError("HorovodStrategy.step: no micro-batches")
        hvd, opt, n = self.hvd, self.optimizer, len(microbatches)
        start = time.perf_counter()
        opt.zero_grad()
        # Horovod all-reduces a gradient on the n-th backward pass that reaches it; the
        # earlier ones only accumulate into .grad (its backward_passes_per_step).
        if opt.backward_passes_per_step != n:
            opt.set_backward_passes_per_step(n)
        total, trace = 0.0, self.tracer
        for k, mb in enumerate(microbatches):
            with trace.span("forward", "compute", microbatch=k):
                loss = loss_fn(mb)
            total += loss.item()
            # Horovod sums the n passes without dividing: dividing each micro-batch's mean
            # loss by n gives the gradient of the mean over all of this rank's samples.
            with trace.span("backward", "compute", microbatch=k):
                (loss / n).backward()
        # The loss is averaged over ranks while the gradients are still in flight.
        loss_handle = hvd.allreduce_async(torch.tensor([total / n]), op=hvd.Average, name="psrt.loss")
        waited = time.perf_counter()
        # Horovod's own thread reduces the gradients (its timeline, HOROVOD_TIMELINE, splits
        # that time); this rank's timeline shows how long the step waits for it.
        with trace.span("wait for horovod", "wait"):
            opt.synchronize()
            loss = float(hvd.synchronize(loss_handle)[0])
        comm_s = time.perf_counter() - waited
        with trace.span("optimizer", "compute"), opt.skip_synchronize():
            # fp16: the averaged gradients are checked, every rank agreeing, and unscaled
            # before the step, or the step is skipped (psrt/dp/precision.py).
            (self._scaled or opt).step()
        elapsed = time.perf_counter() - start
        # Horovod's MPI_Allreduce (or gloo ring) on the fused gradients: counted as a ring.
        sent = wire_bytes("allreduce", "native", self._wire_bytes, self.group.size, self.group.rank)
        return StepStats(loss=loss, compute_s=elapsed - comm_s, comm_s=comm_s, bytes_sent=sent,
                         extra={"backward_passes_per_step": n})

    def state_dict(self) -> dict:
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        # Every rank loads its own copy; rank 0's wins, as at start-up.
        self.hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        self._broadcast_optimizer_state()
