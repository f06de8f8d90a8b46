"""Sharded optimizer state: ZeRO stage 1-2 (Rajbhandari et al., "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", SC 2020, section 5).

Every rank keeps the whole model for forward and backward, but only 1/N of the optimizer:
all parameters are laid end to end in one flat vector, padded to a multiple of N, and rank
r owns elements [r*S, (r+1)*S) with S = padded/N.  A step is

    backward -> reduce-scatter(gradients, avg)   rank r receives the averaged gradient of its shard
             -> optimizer.step() on the shard    momentum / Adam moments exist for the shard only
             -> all-gather(shards)               every rank gets every updated parameter

Reduce-scatter + all-gather move the same bytes as one ring all-reduce (which is exactly
those two phases), so the memory saving costs no extra communication.  Optimizers that
work element by element (SGD, Adam) give the same update on a shard as on whole tensors;
norm-based ones (LAMB, gradient clipping) would need a global norm first.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from psrt.collectives import ALGORITHMS
from psrt.collectives.cost import wire_bytes
from psrt.dp.base import DataParallel, StepStats
from psrt.dp.common import COMPRESS, broadcast_model, check_compress, copy_back, flatten, join_torch
from psrt.errors import PsrtError


@dataclass(frozen=True)
class ZeroOptions:
    """algorithm: reduce-scatter / all-gather algorithm (default "ring").
    compress: "none", "fp16" or "bf16": the dtype gradients travel in (parameters are always
        gathered in full precision)."""

    algorithm: str | None = None
    compress: str = "none"

    def __post_init__(self):
        check_compress(self.compress)


class ZeroOptimizer(DataParallel):
    """Data parallelism with the optimizer state sharded over ranks (see ZeroOptions)."""

    name = "zero"
    Options = ZeroOptions

    def __init__(self, model, make_optimizer, group, **options):
        super().__init__(model, make_optimizer, group, **options)
        self.algorithm = self.options.algorithm or "ring"
        usable = [a for a in ALGORITHMS["reduce_scatter"] if a in ALGORITHMS["allgather"]]
        if self.algorithm not in usable + ["auto"]:
            raise PsrtError(f"--algorithm {self.algorithm}: --dp zero needs a reduce-scatter and "
                            f"all-gather algorithm: one of auto, {', '.join(usable)}", everywhere=True)
        if self.algorithm == "torch":
            join_torch(group, model)
        self.wire_dtype = COMPRESS[self.options.compress]
        broadcast_model(model, group)
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise PsrtError("the model has no trainable parameters")
        if len({p.dtype for p in self.params}) != 1:
            raise PsrtError("--dp zero needs every trainable parameter in one dtype")
        n, r = group.size, group.rank
        self.total = sum(p.numel() for p in self.params)
        self.shard = -(-self.total // n)                 # ceil: pad so N parts are equal
        like = self.params[0]
        self.flat_grad = torch.zeros(self.shard * n, dtype=like.dtype, device=like.device)
        # Gather buffer: each rank's shard followed by its local loss, so the mean loss over
        # ranks arrives with the parameters at no extra message.
        self.gathered = torch.zeros(n * (self.shard + 1), dtype=like.dtype, device=like.device)
        flat = flatten(self.params)
        mine = torch.zeros(self.shard, dtype=like.dtype, device=like.device)
        lo, hi = r * self.shard, min((r + 1) * self.shard, self.total)
        if hi > lo:
            mine[:hi - lo] = flat[lo:hi]
        # The master copy of this rank's shard: the only tensor the optimizer ever sees.
        self.master = torch.nn.Parameter(mine)
        self.optimizer = make_optimizer([self.master])
        self.grad_shard = torch.zeros(self.shard, dtype=like.dtype, device=like.device)

    def _reduce_scatter(self) -> int:
        """flat_grad -> averaged gradient of this rank's shard in grad_shard; returns bytes sent."""
        n = self.group.size
        counts = [self.shard] * n
        if self.wire_dtype is None:
            self.group.reduce_scatter(self.flat_grad, op="avg", out=self.grad_shard, counts=counts,
                                     algorithm=self.algorithm)
            sent = self.flat_grad.numel() * self.flat_grad.element_size()
        else:
            # Divide before the cast so the fp16 sum cannot overflow (see ddp.CompressedReducer).
            wire = (self.flat_grad / n).to(self.wire_dtype)
            self.grad_shard.copy_(self.group.reduce_scatter(wire, op="sum", counts=counts,
                                                           algorithm=self.algorithm))
            sent = wire.numel() * wire.element_size()
        return wire_bytes("reduce_scatter", self.algorithm, sent, n, self.group.rank)

    def step(self, loss_fn, microbatches: list) -> StepStats:
        start = time.perf_counter()
        for p in self.params:
            p.grad = None
        n_mb, total = len(microbatches), 0.0
        for mb in microbatches:
            loss = loss_fn(mb)
            total += loss.item()
            (loss / n_mb).backward()     # mean over this rank's samples, as in ddp.DDP.step
        flatten([p.grad for p in self.params], like=self.params, out=self.flat_grad)
        t0 = time.perf_counter()
        sent = self._reduce_scatter()
        comm_s = time.perf_counter() - t0
        self.master.grad = self.grad_shard
        self.optimizer.step()
        n, k = self.group.size, self.shard
        send = torch.cat([self.master.detach(), self.master.new_tensor([total / n_mb])])
        t0 = time.perf_counter()
        self.group.allgather(send, out=self.gathered, counts=[k + 1] * n, algorithm=self.algorithm)
        comm_s += time.perf_counter() - t0
        sent += wire_bytes("allgather", self.algorithm, self.gathered.numel() * self.gathered.element_size(),
                           n, self.group.rank)
        table = self.gathered.view(n, k + 1)
        copy_back(table[:, :k].reshape(-1), self.params)
        elapsed = time.perf_counter() - start
        return StepStats(loss=float(table[:, k].mean()), compute_s=elapsed - comm_s, comm_s=comm_s,
                         bytes_sent=sent, extra={"shard_elements": k})

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "master": self.master.detach().clone(), "shard": [self.group.rank, self.group.size, self.shard]}

    def load_state_dict(self, state: dict) -> None:
        rank, size, shard = state["shard"]
        if (size, shard) != (self.group.size, self.shard):
            raise PsrtError(f"--resume: this zero checkpoint holds {size} optimizer shards of {shard} "
                            f"elements; this run has {self.group.size} of {self.shard} (resume on "
                            f"{size} ranks)", everywhere=True)
        self.model.load_state_dict(state["model"])
        with torch.no_grad():
            self.master.copy_(state["master"])
        self.optimizer.load_state_dict(state["optimizer"])
