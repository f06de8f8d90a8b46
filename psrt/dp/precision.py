"""Mixed precision for the data-parallel strategies: autocast compute, fp32 master weights, and
for fp16 dynamic loss scaling whose overflow decision every rank takes together.

`--precision bf16|fp16` runs the forward under `torch.autocast` in that dtype while the
parameters (the master weights the optimizer updates) stay fp32 (Micikevicius et al., "Mixed
Precision Training", ICLR 2018).  bf16 has fp32's exponent range and needs no scaling.  fp16
does: small gradients underflow, so the loss is multiplied by a scale S before backward and
the gradients divided by S before the update, with PyTorch GradScaler's rules: S starts at
2^16, doubles after 2000 steps in a row without overflow, halves on a step whose gradients
hold an inf or NaN, and that step is skipped.

Sharded strategies (zero1/2/3) check only their own shard of the gradients, so one rank may
see an overflow the others do not.  Every rank that steps takes part in one MPI_Allreduce
(MAX) of its finding before updating, so all of them skip the same steps and keep the same
scale: no rank diverges.  The parameter servers, whose workers never call the optimizer,
and Horovod, whose optimizer reduces inside step(), are not offered fp16 (bf16 works there).
"""
from __future__ import annotations

import torch

from psrt.errors import PsrtError

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
SCALED = ("ring", "native", "torch", "zero", "zero1", "zero2", "zero3")


def check(precision: str, dp: str) -> None:
    if precision not in DTYPES:
        raise PsrtError(f"--precision {precision!r}: choose one of {', '.join(DTYPES)}", everywhere=True)
    if precision == "fp16" and dp not in SCALED:
        raise PsrtError(f"--precision fp16 with --dp {dp}: loss scaling needs every rank to take the "
                        f"optimizer step together; use one of {', '.join(SCALED)}, or --precision bf16",
                        everywhere=True)


class _Scale(torch.autograd.Function):
    """The identity forward, gradient times `scale` backward: the loss keeps its value for
    reporting while backward produces gradients of scale x loss."""

    @staticmethod
    def forward(ctx, loss, scale: float):
        ctx.scale = scale
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class LossScaler:
    """Dynamic loss scaling with GradScaler's defaults, agreed over `comm` (mpi4py)."""

    def __init__(self, comm, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        self.comm = comm
        self.scale = init_scale
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.skipped = 0

    def __call__(self, loss: torch.Tensor) -> torch.Tensor:
        return _Scale.apply(loss, self.scale)

    def agree(self, found_inf: bool) -> bool:
        """True on every rank if any rank found an inf or NaN (a collective over comm)."""
        from mpi4py import MPI
        return bool(self.comm.allreduce(int(found_inf), op=MPI.MAX)) if self.comm is not None else found_inf

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped += 1
        else:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps, self.skipped = state["scale"], state["good_steps"], state["skipped"]


class ScaledOptimizer:
    """Wraps the optimizer a strategy steps: unscale its gradients, skip the step on every
    rank if any rank's gradients overflowed, update the scale."""

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: LossScaler):
        self.optimizer, self.scaler = optimizer, scaler

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]

    @torch.no_grad()
    def step(self, closure=None):
        grads = self._grads()
        found = any(not bool(torch.isfinite(g).all()) for g in grads)
        found = self.scaler.agree(found)
        if not found:
            for g in grads:
                g.mul_(1.0 / self.scaler.scale)
            self.optimizer.step()
        self.scaler.update(found)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])


def scaled_factory(make_optimizer, scaler: LossScaler):
    """`make_optimizer` whose optimizers unscale and skip with `scaler` (what a strategy is given)."""
    def make(params):
        return ScaledOptimizer(make_optimizer(params), scaler)
    return make
