"""Mixed precision for the data-parallel strategies: autocast compute, fp32 master weights, and
for fp16 dynamic loss scaling whose overflow decision every rank takes together.

`--precision bf16|fp16` runs the forward under `torch.autocast` in that dtype while the
parameters (the master weights the optimizer updates) stay fp32 (Micikevicius et al., "Mixed
Precision Training", ICLR 2018).  bf16 has fp32's exponent range and needs no scaling.  fp16
does: small gradients underflow, so the loss is multiplied by a scale S before backward and
the gradients divided by S before the update, with PyTorch GradScaler's rules: S starts at
2^16, doubles after 2000 steps in a row without overflow, halves on a step whose gradients
hold an inf or NaN, and that step is skipped.

Every rank must skip the same steps and keep the same scale, or the replicas diverge:

- ring, native, torch, zero1/2/3, horovod: every rank steps the optimizer.  zero1/2/3 check
  only their own shard, so each rank joins one MPI_Allreduce (MAX) of its finding before
  updating (ScaledOptimizer).
- ps, ps-sharded: the workers never step the optimizer; the servers decide.  An inf or NaN in
  any worker's gradient reaches the average of its slice, and a sum of finite values can
  overflow too, so each server checks its averaged slice, and several servers agree by one
  MPI_Allreduce among themselves: an overflow in one slice skips the step on every server.
  Each answer carries the decision and the new scale; every worker moves its own scale by
  the same rule and checks that it lands where the servers' did.  So every rank, servers
  included, skips the same steps and keeps one scale.
- ps-async: the one server decides per clock.  Each push carries the scale its gradient was
  computed with (a worker running ahead may still use an older one): the server brings the
  clock's gradients to the smallest of their scales (a power-of-two factor, exact), averages,
  checks and unscales.  A clock with an overflow is skipped (its update is the identity); the
  scale halves only if an overflowing gradient was computed at the present scale or a smaller
  one, so a stale push from before a halving does not halve it again.  The scale grows after
  2000 applied clocks in a row.  Each answer tells the worker the scale to compute its next
  clock with.  With staleness 0 every worker computes every clock at the same scale, and this
  is the synchronous rule exactly.

Strategies that do not call the optimizer they are given on every rank (the parameter servers,
Horovod, which wraps it) take the plain optimizer factory and the scaler apart with `split`.
"""
from __future__ import annotations

import torch

from psrt.errors import PsrtError

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def check(precision: str) -> None:
    if precision not in DTYPES:
        raise PsrtError(f"--precision {precision!r}: choose one of {', '.join(DTYPES)}", everywhere=True)


def overflowed(tensors) -> bool:
    """Whether any of `tensors` holds an inf or NaN (this rank's finding, not yet agreed)."""
    return any(not bool(torch.isfinite(t).all()) for t in tensors if t is not None)


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
        self.decided = None            # a step's decision taken ahead (decide), or None

    def __call__(self, loss: torch.Tensor) -> torch.Tensor:
        return _Scale.apply(loss, self.scale)

    def agree(self, found_inf: bool) -> bool:
        """True on every rank if any rank found an inf or NaN (a collective over comm)."""
        from mpi4py import MPI
        return bool(self.comm.allreduce(int(found_inf), op=MPI.MAX)) if self.comm is not None else found_inf

    def update(self, found_inf: bool, at_scale: float | None = None) -> None:
        """GradScaler's rule after a step.  `at_scale`: the smallest scale the overflowing
        gradients were computed with, where it can differ from this one (ps-async): an
        overflow computed at a larger scale than the present one was already answered by a
        halving since, and skips the step without halving again."""
        if found_inf:
            if at_scale is None or at_scale <= self.scale:
                self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped += 1
        else:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0

    def decide(self, found_inf: bool) -> None:
        """One decision for a step whose parameters several optimizers update (a model's
        dense and expert parameters over different groups): agreed now, from this rank's
        local gradients (an inf or NaN survives any reduction), followed by every
        ScaledOptimizer of the step, and applied once by `settle`."""
        self.decided = self.agree(found_inf)

    def settle(self) -> None:
        """Apply the decision `decide` took (GradScaler's rule, once)."""
        found, self.decided = self.decided, None
        self.update(found)

    def follow(self, scale: float, skipped: int) -> None:
        """Take the scale and the count of skipped steps decided elsewhere (a ps-async
        worker, whose server runs the rule)."""
        self.scale, self.skipped = scale, skipped

    def clone(self) -> "LossScaler":
        """The same settings and state, no communicator (a server's own copy)."""
        other = LossScaler(None, self.scale, self.growth_factor, self.backoff_factor, self.growth_interval)
        other.load_state_dict(self.state_dict())
        return other

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
        ahead = self.scaler.decided
        found = self.scaler.agree(overflowed(grads)) if ahead is None else ahead
        if not found:
            for g in grads:
                g.mul_(1.0 / self.scaler.scale)
            self.optimizer.step()
        if ahead is None:
            self.scaler.update(found)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])


class ScaledFactory:
    """`make_optimizer` whose optimizers unscale and skip with `scaler` (what a strategy is
    given); `make` and `scaler` stay readable for the strategies that split them (`split`)."""

    def __init__(self, make_optimizer, scaler: LossScaler):
        self.make, self.scaler = make_optimizer, scaler

    def __call__(self, params):
        return ScaledOptimizer(self.make(params), self.scaler)


def scaled_factory(make_optimizer, scaler: LossScaler) -> ScaledFactory:
    return ScaledFactory(make_optimizer, scaler)


def split(make_optimizer):
    """(the plain optimizer factory, its LossScaler or None): for a strategy that scales
    where its own protocol decides (the parameter servers, Horovod)."""
    if isinstance(make_optimizer, ScaledFactory):
        return make_optimizer.make, make_optimizer.scaler
    return make_optimizer, None
