"""ZeRO stage 3, fully sharded data parallelism (Rajbhandari et al., SC 2020, sec. 5.3; PyTorch
FSDP, Zhao et al., VLDB 2023): parameters, gradients and optimizer state all sharded.

The model is cut into units by an FSDP-style wrap policy (psrt.dp.zero3.wrap_units: each
transformer block, each layer of a Sequential, each other child holding parameters); what
no unit holds forms a root unit.  Rank r keeps part r of every unit (psrt.dp.shards) and
nothing else of the parameters.  A step, per micro-batch:

    forward   unit k: all-gather its parameters (the next unit's gather already started:
              prefetch), run it, free them again
    backward  unit k: gather again (unit k-1's gather prefetched), backward, reduce-scatter
              its gradients (averaged) into this rank's part, free parameters and gradients
    then      the optimizer updates the rank's parts; nothing else moves

So each step all-gathers the parameters twice and reduce-scatters once: 3(N-1)/N x Phi
elements per rank, 1.5x the ring all-reduce of DDP, for 16 Phi/N bytes of model state
instead of 16 Phi (fp32 Adam).

Freeing a unit's parameters between its forward and its backward needs autograd not to
keep them alive: tensors that autograd saves for backward and that live in a gathered unit
are packed as a reference (unit, shape, strides, offset) by saved-tensor hooks and unpacked
from the regathered unit (the mechanism torch.autograd.graph.saved_tensors_hooks exists
for).  The parameters' own tensors are swapped with `.data`, as DeepSpeed's stage 3 does.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from psrt.collectives.cost import wire_bytes
from psrt.dp.base import DataParallel, StepStats
from psrt.dp.common import flatten
from psrt.dp.shards import ShardMap, assemble, reshard_optimizer
from psrt.dp.zero import ZeroOptions, make_shard_optimizer, prepare, reduce_scatter_into, step_shard
from psrt.errors import PsrtError


@dataclass(frozen=True)
class Zero3Options(ZeroOptions):
    """algorithm, compress: as zero1's.
    overlap: prefetch, i.e. start the next unit's all-gather before the current unit computes
        (default True); False gathers each unit only when it is needed, the baseline."""

    overlap: bool = True


def wrap_units(model: nn.Module) -> list[nn.Module]:
    """The modules that become units, in the order forward is expected to call them: each
    child holding parameters, looking inside ModuleList and Sequential containers."""
    units = []

    def visit(module):
        for child in module.children():
            if isinstance(child, (nn.ModuleList, nn.Sequential)):
                visit(child)
            elif any(p.requires_grad for p in child.parameters()):
                units.append(child)
    visit(model)
    return units


class _Ref:
    """What autograd keeps of a saved tensor that lives in a gathered unit."""
    __slots__ = ("unit", "size", "stride", "offset")

    def __init__(self, unit, t: torch.Tensor):
        self.unit, self.size, self.stride, self.offset = unit, t.size(), t.stride(), t.storage_offset()


class _Unit:
    def __init__(self, index: int, module: nn.Module | None, params: list, part: torch.Tensor, counts):
        self.index, self.module, self.params = index, module, params
        self.shapes = [p.shape for p in params]       # kept: a released parameter is empty
        self.sizes = [p.numel() for p in params]
        self.numel = sum(self.sizes)
        self.part = part                      # this rank's elements, a view of the shard
        self.counts = list(counts)
        self.full: torch.Tensor | None = None
        self.pending = None                   # an all-gather in flight: (handle, buffer)
        self.left = 0                         # gradients still to come in this backward
        self.reduced = False


class Zero3(DataParallel):
    """ZeRO stage 3: parameters, gradients and optimizer state sharded (see the module)."""

    name = "zero3"
    Options = Zero3Options
    IN_FLIGHT = 2                             # gradient reduce-scatters in flight at once

    def __init__(self, model, make_optimizer, group, params=None, **options):
        super().__init__(model, make_optimizer, group, params=params, **options)
        params = prepare(self, model, group)
        modules, owned, seen = wrap_units(model), [], {}
        for m in modules:
            mine = [p for p in m.parameters() if p.requires_grad]
            owned.append(mine)
            for p in mine:
                seen[p] = seen.get(p, 0) + 1
        # A parameter two units share (tied weights) must stay whole: it goes to the root.
        owned = [[p for p in mine if seen[p] == 1] for mine in owned]
        in_units = {p for mine in owned for p in mine}
        root = [p for p in params if p not in in_units]
        groups = [(m, mine) for m, mine in zip(modules, owned) if mine] + [(None, root)]
        n, r = group.size, group.rank
        self.map = ShardMap([sum(p.numel() for p in mine) for _, mine in groups], n)
        flat = flatten([p for _, mine in groups for p in mine])
        # The only copy of the parameters a rank keeps: its part of every unit, end to end.
        self.shard = torch.cat([flat[lo:hi] for lo, hi in self.map.owned(r)])
        at = self.map.shard_offsets(r)
        self.units = [_Unit(i, m, mine, self.shard[at[i]:at[i + 1]], u.counts)
                      for i, ((m, mine), u) in enumerate(zip(groups, self.map.units))]
        del flat
        self.masters = make_shard_optimizer(self, [u.part for u in self.units], make_optimizer)
        self.grad_shard = torch.zeros_like(self.shard)
        at = self.map.shard_offsets(group.rank)
        self._grad_parts = [self.grad_shard[a:b] for a, b in zip(at, at[1:])]
        self._empty = self.shard.new_empty(0)
        self._by_storage: dict[int, _Unit] = {}
        self._inflight: list = []
        self._sent, self._comm_s = 0, 0.0
        self._finished = False
        # On CUDA the gathers run on a side stream, so a prefetched unit's copies overlap the
        # compute queued on the current stream (what FSDP's all-gather stream does).
        self._side = torch.cuda.Stream(self.shard.device) if self.shard.is_cuda else None
        for u in self.units:
            self._release(u)
        self._hooks = []
        order = [u for u in self.units if u.module is not None]
        for k, u in enumerate(order):
            after = order[k + 1] if k + 1 < len(order) else None
            before = order[k - 1] if k else None
            self._hooks.append(u.module.register_forward_pre_hook(self._pre_forward(u, after)))
            self._hooks.append(u.module.register_forward_hook(self._post_forward(u, before)))
        for u in self.units:
            for p in u.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready(u)))
        self._syncing = False

    # ------------------------------------------------------------ gather and free
    def _gather(self, u: _Unit) -> None:
        """Start the all-gather of u's parameters (nothing if gathered or on the way)."""
        if u.full is None and u.pending is None and u.numel:
            if self._side is None:
                buf = self.shard.new_empty(u.numel)
                handle = self.group.allgather(u.part, out=buf, counts=u.counts, algorithm=self.algorithm,
                                              async_op=True)
            else:
                # The part may just have been written by the optimizer on the current stream.
                self._side.wait_stream(torch.cuda.current_stream(self.shard.device))
                with torch.cuda.stream(self._side):       # the buffer and the collective's copies
                    buf = self.shard.new_empty(u.numel)
                    handle = self.group.allgather(u.part, out=buf, counts=u.counts, algorithm=self.algorithm,
                                                  async_op=True)
            self._sent += self._wire("allgather", u.numel, buf.dtype)
            u.pending = (handle, buf)

    def _use(self, u: _Unit) -> None:
        """u's parameters whole, as views of the gathered buffer."""
        self._gather(u)
        if u.pending is not None:
            handle, buf = u.pending
            t0 = time.perf_counter()
            with self.tracer.span("wait for gather", "wait", unit=u.index):
                handle.wait()
            if self._side is not None:
                current = torch.cuda.current_stream(buf.device)
                current.wait_stream(self._side)
                # Allocated on the side stream, used on this one: the caching allocator must not
                # hand its memory out again before this stream's work on it is done.
                buf.record_stream(current)
            self._comm_s += time.perf_counter() - t0
            u.full, u.pending = buf, None
            self._by_storage[buf.untyped_storage().data_ptr()] = u
            at = 0
            for p, shape, n in zip(u.params, u.shapes, u.sizes):
                p.data = buf[at:at + n].view(shape)
                at += n

    def _release(self, u: _Unit) -> None:
        """Drop u's gathered parameters: each becomes an empty tensor of its dtype again."""
        if u.full is not None:
            self._by_storage.pop(u.full.untyped_storage().data_ptr(), None)
        u.full = None
        for p in u.params:
            p.data = self._empty

    # ------------------------------------------------------------ hooks
    def _pre_forward(self, u: _Unit, after: _Unit | None):
        def hook(module, args):
            self._use(u)
            if after is not None and self.options.overlap:
                self._gather(after)
        return hook

    def _post_forward(self, u: _Unit, before: _Unit | None):
        def hook(module, args, output):
            self._release(u)
            if torch.is_grad_enabled() and self._syncing:
                # Backward reaches this unit when the gradient of its output is known: gather
                # it then, and start the gather of the unit before it (backward's next).
                def pre_backward(grad):
                    self._use(u)
                    if before is not None and self.options.overlap:
                        self._gather(before)
                    return grad
                outs = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
                if outs:
                    outs[0].register_hook(pre_backward)
            return output
        return hook

    def _pack(self, t: torch.Tensor):
        u = self._by_storage.get(t.untyped_storage().data_ptr()) if t.numel() else None
        return _Ref(u, t) if u is not None else t

    def _unpack(self, saved):
        if not isinstance(saved, _Ref):
            return saved
        self._use(saved.unit)              # gathered already, unless a node needs it late
        return saved.unit.full.as_strided(saved.size, saved.stride, saved.offset)

    def _grad_ready(self, u: _Unit):
        def hook(p):
            if self._syncing:
                u.left -= 1
                self._reduce_ready()
        return hook

    # ------------------------------------------------------------ gradients
    def _reduce_ready(self, flush: bool = False) -> None:
        """Reduce-scatter the units whose gradients are complete, in backward order (the
        reverse of the units' order, the root last), the same order on every rank."""
        while self._next < len(self._order):
            u = self._order[self._next]
            if u.left and not flush:
                return
            self._next += 1
            if not u.numel:
                continue
            while len(self._inflight) >= self.IN_FLIGHT:
                self._inflight.pop(0).wait()
            grads = self.shard.new_zeros(u.numel)     # a parameter without a gradient adds zeros
            at = 0
            for p, n in zip(u.params, u.sizes):
                if p.grad is not None:
                    grads[at:at + n].copy_(p.grad.reshape(-1))
                p.grad = None
                at += n
            self._release(u)
            self._inflight.append(self._reduce_scatter(grads, u))

    def _reduce_scatter(self, grads: torch.Tensor, u: _Unit):
        """Average `grads` over ranks into this rank's part of u's gradient."""
        self._sent += self._wire("reduce_scatter", u.numel, self.wire_dtype or grads.dtype)
        return reduce_scatter_into(self.group, grads, u.counts, self._grad_parts[u.index],
                                   accumulate=self._accumulate, wire_dtype=self.wire_dtype,
                                   algorithm=self.algorithm, async_op=True)

    def _wire(self, collective: str, numel: int, dtype) -> int:
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        return wire_bytes(collective, self.algorithm, nbytes, self.group.size, self.group.rank)

    # ------------------------------------------------------------ the step
    # The units are gathered in forward and freed after it, so micro-batches must run one
    # after another: a pipeline schedule's interleaving is refused (psrt.train.layout).
    frees_grads = True
    interleaved_ok = False

    def begin(self, microbatches: int) -> None:
        super().begin(microbatches)
        self._comm_s, self._sent = 0.0, 0

    @contextlib.contextmanager
    def microbatch(self, k: int):
        root = self.units[-1]
        self._accumulate = k > 0              # later micro-batches add to the first's parts
        self._order = [u for u in reversed(self.units[:-1])] + [root]
        self._next = 0
        for u in self.units:
            u.left = len(u.params)
        self._use(root)                          # the root stays whole for the whole pass
        self._syncing = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._syncing = False
        self._reduce_ready(flush=True)           # units with parameters that got no gradient
        t0 = time.perf_counter()
        with self.tracer.span("wait for gradients", "wait"):
            while self._inflight:
                self._inflight.pop(0).wait()
        self._comm_s += time.perf_counter() - t0
        for u in self.units:                     # a unit forward skipped was never gathered
            if u.pending is not None:
                self._use(u)
            self._release(u)

    def complete(self, loss: float) -> StepStats:
        step_shard(self, self._grad_parts)
        t0 = time.perf_counter()
        losses = self.group.allreduce(self.shard.new_tensor([loss]), op="avg", algorithm=self.algorithm)
        self._comm_s += time.perf_counter() - t0
        return StepStats(loss=float(losses[0]), comm_s=self._comm_s,
                         bytes_sent=self._sent, extra={"shard_elements": self.shard.numel(),
                                                       "units": len(self.units),
                                                       "prefetch_stream": "none" if self._side is None else "side"})

    def memory(self) -> dict:
        held = self.host.tensors() if self.host is not None else self.optimizer
        return {"params": [self.shard], "grads": [self.grad_shard], "optimizer": held}

    def full_parameters(self) -> None:
        """Gather every unit and leave the model whole, with hooks removed (for evaluation
        and saving after training; the strategy takes no more steps)."""
        if self._finished:
            return
        self._finished = True
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for u in self.units:
            self._use(u)
            for p in u.params:
                p.data = p.data.clone()
            self._release_keep(u)

    def _release_keep(self, u: _Unit) -> None:
        if u.full is not None:
            self._by_storage.pop(u.full.untyped_storage().data_ptr(), None)
        u.full = None

    def finish(self) -> None:
        self.full_parameters()

    def state_dict(self) -> dict:
        buffers = {k: v.clone() for k, v in self.model.named_buffers()}
        return {"buffers": buffers, "optimizer": self.optimizer.state_dict(), "shard": self.shard.clone(),
                "map": [self.group.rank, self.group.size, self.shard.numel()],
                "units": [u.numel for u in self.units]}

    reshardable = True

    def load_resharded(self, states: list[dict]) -> None:
        """Resume from the states of a run on another number of ranks: every old rank's parts
        of the parameters and of the optimizer state are reassembled and cut for this map."""
        old = ShardMap(states[0]["units"], len(states))
        if old.units and [u.numel for u in old.units] != [u.numel for u in self.map.units]:
            raise PsrtError("--resume: the checkpoint's zero3 units do not match this model's", everywhere=True)
        parts = []
        for q, st in enumerate(states):
            at = old.shard_offsets(q)
            parts.append([st["shard"][a:b] for a, b in zip(at, at[1:])])
        flat = assemble(old, parts)
        with torch.no_grad():
            self.shard.copy_(torch.cat([flat[lo:hi] for lo, hi in self.map.owned(self.group.rank)]))
        if self.host is not None:
            self.host.pull()
        self.model.load_state_dict(states[0]["buffers"], strict=False)
        self.optimizer.load_state_dict(reshard_optimizer([s["optimizer"] for s in states], old, self.map,
                                                         self.group.rank))

    def load_state_dict(self, state: dict) -> None:
        rank, size, shard = state["map"]
        if (size, shard) != (self.group.size, self.shard.numel()):
            raise PsrtError(f"--resume: this zero3 checkpoint holds {size} shards of {shard} elements; this "
                            f"run has {self.group.size} of {self.shard.numel()} (resume on {size} ranks)",
                            everywhere=True)
        with torch.no_grad():
            self.shard.copy_(state["shard"])
        if self.host is not None:
            self.host.pull()
        self.model.load_state_dict(state["buffers"], strict=False)
        self.optimizer.load_state_dict(state["optimizer"])

