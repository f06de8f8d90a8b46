"""Sharded optimizer state and gradients: ZeRO stages 1 and 2 (Rajbhandari et al., "ZeRO:
Memory Optimizations Toward Training Trillion Parameter Models", SC 2020, sections 5.1-5.2).
Stage 3, which shards the parameters too, is psrt/dp/zero3.py.

Every rank keeps the whole model for forward and backward, but only 1/N of the optimizer.
The trainable parameters are laid end to end in one flat vector and cut into units split
over the ranks (psrt.dp.shards.ShardMap); rank r owns part r of every unit.  A step is

    backward -> reduce-scatter(gradients, avg)   rank r receives the averaged gradient of its parts
             -> optimizer.step() on the shard    momentum / Adam moments exist for the shard only
             -> all-gather(shards)               every rank gets every updated parameter

zero1 reduce-scatters the whole gradient after backward (one unit); zero2 cuts the vector
into gradient buckets, reduce-scatters each as soon as backward has produced it and drops
the parameters' .grad, so a rank never holds more than its gradient shard and two buckets in
flight (section 5.2: 4 + 12/N bytes per parameter with fp32 Adam instead of 8 + 8/N).

Reduce-scatter + all-gather move the same bytes as one ring all-reduce (which is exactly
those two phases), so the memory saving costs no extra communication.  Optimizers that
work element by element (SGD, Adam) give the same update on a shard as on whole tensors;
norm-based ones (LAMB, gradient clipping) would need a global norm first.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from psrt.collectives import ALGORITHMS
from psrt.collectives.algorithms import THROUGH_TORCH
from psrt.collectives.cost import wire_bytes
from psrt.dp.base import DataParallel, StepStats
from psrt.dp.common import COMPRESS, Then, check_compress, flatten, group_by_bytes, join_torch
from psrt.dp.shards import ShardMap, reshard_optimizer
from psrt.errors import PsrtError

@dataclass(frozen=True)
class ZeroOptions:
    """algorithm: reduce-scatter / all-gather algorithm (default "ring").
    compress: "none", "fp16" or "bf16": the dtype gradients travel in (parameters are always
        gathered in full precision).
    offload_optimizer: keep the optimizer's master copy of this rank's parts and its state
        in host memory and step there (ZeRO-Offload; see HostOptimizer)."""

    algorithm: str | None = None
    compress: str = "none"
    offload_optimizer: bool = False

    def __post_init__(self):
        check_compress(self.compress)


@dataclass(frozen=True)
class Zero2Options(ZeroOptions):
    """bucket_mb: gradient bucket size in MiB: each bucket is reduce-scattered as soon as
    backward has produced it; at most two are in flight.  Default: 25 (DDP's) or an eighth
    of the gradient, whichever is smaller, so that the two buffers in flight hold at most a
    quarter of it and zero2 never holds more gradient than zero1 (1/4 + 1/N < 1 for N >= 2)."""

    bucket_mb: float | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.bucket_mb is not None and not self.bucket_mb > 0:
            raise PsrtError(f"--bucket-mb {self.bucket_mb}: must be positive", everywhere=True)


def check_algorithm(name: str, algorithm: str) -> None:
    usable = [a for a in ALGORITHMS["reduce_scatter"] if a in ALGORITHMS["allgather"]]
    if algorithm not in usable + ["auto"]:
        raise PsrtError(f"--algorithm {algorithm}: --dp {name} needs a reduce-scatter and all-gather "
                        f"algorithm: one of auto, {', '.join(usable)}", everywhere=True)


def prepare(strategy, model: torch.nn.Module, group) -> list[torch.nn.Parameter]:
    """What every ZeRO stage does first: its algorithm and wire dtype from the options, rank
    0's values on every rank; returns the parameters it updates (at least one, one dtype)."""
    strategy.algorithm = strategy.options.algorithm or "ring"
    check_algorithm(strategy.name, strategy.algorithm)
    if strategy.algorithm in THROUGH_TORCH:
        join_torch(group, model)
    strategy.wire_dtype = COMPRESS[strategy.options.compress]
    strategy.broadcast_initial()
    params = strategy.params
    if not params:
        raise PsrtError("the model has no trainable parameters")
    if len({p.dtype for p in params}) != 1:
        raise PsrtError(f"--dp {strategy.name} needs every trainable parameter in one dtype")
    return params


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
    return out.copy_(t.detach())


class HostOptimizer:
    """ZeRO-Offload's split (Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model
    Training", USENIX ATC 2021, sec. 4): the optimizer's fp32 master copy of this rank's parts
    and all its state live in host memory and the update runs on the CPU; the reduced gradient
    parts go down to the host, the updated parts come back up.  On a CUDA model that frees
    the device of K + d bytes per owned parameter for two transfers of d per step; on a CPU
    model the copies stay on the host and only the bookkeeping remains (what the CPU tests
    check)."""

    def __init__(self, parts: list[torch.Tensor], make_optimizer):
        self.parts = parts                                   # the device tensors the model reads
        self.masters = [torch.nn.Parameter(_host_copy(p)) for p in parts]
        self.grads = [torch.zeros_like(m) for m in self.masters]
        self.optimizer = make_optimizer(self.masters)

    @torch.no_grad()
    def step(self, grad_parts: list[torch.Tensor]) -> None:
        for m, host, g in zip(self.masters, self.grads, grad_parts):
            host.copy_(g)
            m.grad = host
        self.optimizer.step()
        for p, m in zip(self.parts, self.masters):
            p.copy_(m, non_blocking=p.is_cuda)               # ordered on the current stream

    @torch.no_grad()
    def pull(self) -> None:
        """Masters <- the device parts (after a checkpoint wrote the parameters)."""
        for p, m in zip(self.parts, self.masters):
            m.copy_(p)

    def tensors(self) -> list[torch.Tensor]:
        from psrt.dp.memory import optimizer_tensors
        return optimizer_tensors(self.optimizer) + self.masters + self.grads


def make_shard_optimizer(strategy, parts: list[torch.Tensor], make_optimizer) -> list:
    """The optimizer of this rank's parts: over Parameters that are views of them, or with
    offload_optimizer over host copies (HostOptimizer).  Sets strategy.optimizer and .host;
    returns the master parameters."""
    strategy.host = HostOptimizer(parts, make_optimizer) if strategy.options.offload_optimizer else None
    if strategy.host is not None:
        strategy.optimizer = strategy.host.optimizer
        return strategy.host.masters
    masters = [torch.nn.Parameter(p) for p in parts]
    strategy.optimizer = make_optimizer(masters)
    return masters


def step_shard(strategy, grad_parts: list[torch.Tensor]) -> None:
    """The optimizer step on this rank's parts, on the device or on the host."""
    with strategy.tracer.span("optimizer", "compute"):
        if strategy.host is not None:
            strategy.host.step(grad_parts)
            return
        for m, g in zip(strategy.masters, grad_parts):
            m.grad = g
        strategy.optimizer.step()


def flat_views(params: list, flat: torch.Tensor) -> None:
    """Make every parameter a view of its slice of `flat` (which holds their values), so the
    model, the optimizer's shard and the all-gather all work on one buffer (PyTorch FSDP's
    FlatParameter): no copy of the parameters exists besides it."""
    at = 0
    for p in params:
        p.data = flat[at:at + p.numel()].view_as(p)
        at += p.numel()


class ZeroOptimizer(DataParallel):
    """ZeRO stage 1: data parallelism with the optimizer state sharded over ranks."""

    name = "zero1"
    Options = ZeroOptions

    def __init__(self, model, make_optimizer, group, params=None, **options):
        super().__init__(model, make_optimizer, group, params=params, **options)
        self.params = self._order(prepare(self, model, group))
        n, r = group.size, group.rank
        self.map = ShardMap(self._unit_sizes(), n)
        self.total = self.map.numel
        self.flat = flatten(self.params)
        flat_views(self.params, self.flat)
        # This rank's part of each unit, a view of the flat parameters: the optimizer updates
        # them in place, so the all-gather only has to bring the other ranks' parts.
        self.owned = self.map.owned(r)
        self.parts = [self.flat[lo:hi] for lo, hi in self.owned]
        self.masters = make_shard_optimizer(self, self.parts, make_optimizer)
        self.shard = sum(m.numel() for m in self.masters)
        self._setup()

    # The flat order and its cut into units; zero2 overrides both.
    def _order(self, params: list) -> list:
        return params

    def _unit_sizes(self) -> list[int]:
        return [sum(p.numel() for p in self.params)]

    def _setup(self) -> None:
        # The full gradient, reduce-scattered in place: this rank's averaged part lands in its
        # own slice, which is the master's .grad.
        self.flat_grad = torch.zeros_like(self.flat)
        lo, hi = self.owned[0]
        self.grad_parts = [self.flat_grad[lo:hi]]

    def _sent(self, collective: str, numel: int, dtype: torch.dtype) -> int:
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        return wire_bytes(collective, self.algorithm, nbytes, self.group.size, self.group.rank)

    def _reduce_gradients(self) -> tuple[float, int]:
        """After every backward: one reduce-scatter of the whole gradient; (seconds in
        communication, bytes sent)."""
        flatten([p.grad for p in self.params], like=self.params, out=self.flat_grad)
        for p in self.params:
            p.grad = None                    # the flat gradient holds them now
        t0 = time.perf_counter()
        reduce_scatter_into(self.group, self.flat_grad, self.map.units[0].counts, self.grad_parts[0],
                            wire_dtype=self.wire_dtype, algorithm=self.algorithm)
        sent = self._sent("reduce_scatter", self.total, self.wire_dtype or self.flat.dtype)
        return time.perf_counter() - t0, sent

    def complete(self, loss: float) -> StepStats:
        comm_s, sent = self._reduce_gradients()
        step_shard(self, self.grad_parts)
        t0 = time.perf_counter()
        # Each unit's updated parts, gathered into the flat parameters where they belong, and
        # the mean loss over ranks (one element) behind them.
        handles = [self.group.allgather(part, out=self.flat[u.lo:u.hi], counts=list(u.counts),
                                        algorithm=self.algorithm, async_op=True)
                   for u, part in zip(self.map.units, self.parts) if u.numel]
        losses = self.group.allreduce(self.flat.new_tensor([loss]), op="avg", algorithm=self.algorithm)
        for h in handles:
            h.wait()
        comm_s += time.perf_counter() - t0
        sent += self._sent("allgather", self.total, self.flat.dtype)
        return StepStats(loss=float(losses[0]), comm_s=comm_s, bytes_sent=sent,
                         extra={"shard_elements": self.shard})

    def memory(self) -> dict:
        return {"params": [self.flat], "grads": [self.flat_grad], "optimizer": self._optimizer_held()}

    def _optimizer_held(self):
        return self.host.tensors() if self.host is not None else self.optimizer

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "shard": [self.group.rank, self.group.size, self.shard],
                "units": [u.numel for u in self.map.units]}

    reshardable = True

    def load_resharded(self, states: list[dict]) -> None:
        """Resume from the states of a run on another number of ranks: the parameters are
        whole in every state; the optimizer's parts are reassembled and cut for this map."""
        old = ShardMap(states[0]["units"], len(states))
        if old.numel != self.total:
            raise PsrtError(f"--resume: the checkpoint's {self.name} state covers {old.numel} parameters, "
                            f"this model has {self.total}", everywhere=True)
        self.model.load_state_dict(states[0]["model"])
        if self.host is not None:
            self.host.pull()
        self.optimizer.load_state_dict(reshard_optimizer([s["optimizer"] for s in states], old, self.map,
                                                         self.group.rank))

    def load_state_dict(self, state: dict) -> None:
        rank, size, shard = state["shard"]
        if (size, shard) != (self.group.size, self.shard):
            raise PsrtError(f"--resume: this {self.name} checkpoint holds {size} optimizer shards of {shard} "
                            f"elements; this run has {self.group.size} of {self.shard} (resume on "
                            f"{size} ranks)", everywhere=True)
        self.model.load_state_dict(state["model"])       # writes into the flat parameters
        if self.host is not None:
            self.host.pull()
        self.optimizer.load_state_dict(state["optimizer"])


def reduce_scatter_into(group, flat: torch.Tensor, counts, out: torch.Tensor, *, accumulate: bool = False,
                        wire_dtype=None, algorithm: str = "ring", async_op: bool = False):
    """Average `flat` over the ranks of `group` into this rank's part `out` (added to it with
    `accumulate`, for a later micro-batch).  With a wire dtype (--compress) the values are
    divided by N *before* the cast and summed, so an fp16 sum cannot overflow where the
    average would not (see ddp.CompressedReducer)."""
    counts = list(counts)
    if wire_dtype is None and not accumulate:
        return group.reduce_scatter(flat, op="avg", out=out, counts=counts, algorithm=algorithm,
                                    async_op=async_op)
    src, op = (flat, "avg") if wire_dtype is None else ((flat / group.size).to(wire_dtype), "sum")
    handle = group.reduce_scatter(src, op=op, counts=counts, algorithm=algorithm, async_op=True)
    done = Then(handle, out.add_ if accumulate else out.copy_)
    return done if async_op else done.wait()


class Zero2(ZeroOptimizer):
    """ZeRO stage 2: gradients reduce-scattered bucket by bucket during backward, too."""

    name = "zero2"
    Options = Zero2Options
    IN_FLIGHT = 2      # bucket buffers: one being filled while the other is reduced
    DEFAULT_BUCKETS = 8  # without --bucket-mb, at least this many buckets (see Zero2Options)

    def _order(self, params: list) -> list:
        return list(reversed(params))       # backward produces gradients roughly in this order

    def _unit_sizes(self) -> list[int]:
        mb = self.options.bucket_mb
        whole = sum(p.numel() * p.element_size() for p in self.params)
        nbytes = int(mb * 2 ** 20) if mb is not None else min(25 * 2 ** 20, -(-whole // self.DEFAULT_BUCKETS))
        self.buckets = group_by_bytes(self.params, nbytes)
        return [sum(self.params[i].numel() for i in b) for b in self.buckets]

    def _setup(self) -> None:
        # On the parameters' device (new_zeros): the gradients are copied in there, and the
        # shard's parts become the .grad of the parameters the optimizer steps.
        biggest = max(u.numel for u in self.map.units)
        self.pool = [self.flat.new_zeros(biggest) for _ in range(min(self.IN_FLIGHT, len(self.buckets)))]
        # This rank's averaged gradient parts, end to end: all the gradient it ever holds.
        self.grad_shard = self.flat.new_zeros(self.shard)
        at = self.map.shard_offsets(self.group.rank)
        self.grad_parts = [self.grad_shard[a:b] for a, b in zip(at, at[1:])]
        self.where = {}                    # parameter index -> bucket
        for b, idx in enumerate(self.buckets):
            self.where.update((i, b) for i in idx)
        self._syncing = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)]

    def _hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            if self._syncing:
                self._left[self.where[i]] -= 1
                self._launch_ready()
        return hook

    def _launch_ready(self) -> None:
        """Launch complete buckets strictly in index order (every rank starts collectives in
        the same order, MPI 4.1 sec. 6.14), each from a free pool buffer."""
        while self._next < len(self.buckets) and self._left[self._next] == 0:
            b = self._next
            slot = b % len(self.pool)
            if self._handles[slot] is not None:
                self._handles[slot].wait()
                self._handles[slot] = None
            unit = self.map.units[b]
            buf = self.pool[slot][:unit.numel]
            at = 0
            for i in self.buckets[b]:
                p = self.params[i]
                k = p.numel()
                if p.grad is None:                 # no gradient on this rank: it counts as zero
                    buf[at:at + k].zero_()
                else:
                    buf[at:at + k].copy_(p.grad.reshape(-1))
                p.grad = None                      # the whole gradient is never held
                at += k
            self._handles[slot] = reduce_scatter_into(
                self.group, buf, unit.counts, self.grad_parts[b], accumulate=self._accumulate,
                wire_dtype=self.wire_dtype, algorithm=self.algorithm, async_op=True)
            self._next += 1

    # Per micro-batch, where the layout runs them one after another: backward launches each
    # bucket's reduce-scatter as it completes; the parts of later micro-batches are added to
    # the first's (DeepSpeed's stage 2 reduces every micro-batch too: holding the accumulated
    # full gradient is what stage 2 avoids).  A pipeline schedule interleaves the
    # micro-batches' backwards, so there the gradients accumulate in .grad and every bucket
    # is reduce-scattered once, in complete().
    frees_grads = True

    def begin(self, microbatches: int) -> None:
        super().begin(microbatches)
        self._comm_s, self._reduced = 0.0, 0
        self._arm(accumulate=False)

    def _arm(self, accumulate: bool) -> None:
        self._accumulate = accumulate
        self._left = [len(b) for b in self.buckets]
        self._next = 0
        self._handles = [None] * len(self.pool)

    @contextlib.contextmanager
    def microbatch(self, k: int):
        self._arm(accumulate=k > 0)       # later micro-batches add to the first's parts
        try:
            yield
        finally:
            self._syncing = False
        self._drain()

    def before_backward(self, k: int, loss: float) -> None:
        self._syncing = True

    def _drain(self) -> None:
        """Launch the buckets left (parameters without a gradient count as zero) and wait
        for every reduce-scatter in flight."""
        self._left = [0] * len(self.buckets)
        self._launch_ready()
        t0 = time.perf_counter()
        with self.tracer.span("wait for buckets", "wait", buckets=len(self.buckets)):
            for h in self._handles:
                if h is not None:
                    h.wait()
        self._comm_s += time.perf_counter() - t0
        self._reduced += 1

    def _reduce_gradients(self) -> tuple[float, int]:
        if not self._reduced:                # a pipeline schedule: reduce the whole step once
            self._arm(accumulate=False)
            self._drain()
        sent = self._reduced * self._sent("reduce_scatter", self.total, self.wire_dtype or self.flat.dtype)
        return self._comm_s, sent

    def memory(self) -> dict:
        return {"params": [self.flat], "grads": [self.grad_shard], "optimizer": self._optimizer_held(),
                "buffers": self.pool}

    def finish(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


class ZeroAlias(ZeroOptimizer):
    """`--dp zero`: zero1 under its earlier name."""
    name = "zero"
