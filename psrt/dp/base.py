"""The contract every data-parallel strategy keeps.

A strategy is a component attached to parameters and their optimizer: it owns the path from
local gradients to updated parameters, and nothing before it.  Whoever built the model runs
the forward and backward passes (psrt.dp.passes: the plain loop over micro-batches, a
pipeline schedule, a model with experts) and calls the component around them:

    begin(n)                      a step of n micro-batches starts: gradients cleared
    with microbatch(k):           around micro-batch k's forward and backward, where the
        forward                   layout runs micro-batches one after another (zero3 gathers
        before_backward(k, loss)  its units here; ddp and zero2 arm their bucket hooks so the
        backward                  reductions overlap with backward)
    complete(loss) -> StepStats   reduce what is left, update, gather

A layout that interleaves micro-batches (a pipeline schedule) calls only `begin` and
`complete`; a strategy then reduces everything in `complete` (Megatron-LM's
finalize_model_grads after the schedule).  `step(loss_fn, microbatches)` is the plain loop
(psrt.dp.passes.local) around these calls: what psrt.data_parallel's users call.  The
strategies whose protocol owns the whole step (ps-async, horovod) override `step` and set
`composes = False`: they train on the world alone.

The component synchronises `params` (default: the model's trainable parameters), over
`group`, so one model can carry several components: dense parameters over the data-parallel
group and experts over the expert-data-parallel group (psrt.train.layout).

Equivalence promise (tested for every strategy): with global batch B split over N ranks,
k calls of `step` leave the same parameters as one process training on the whole batch.
Each rank's loss is the mean over its own samples, so gradients are averaged over ranks
(and over accumulated micro-batches) to give the gradient of the global mean loss.
"""
from __future__ import annotations

import abc
import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from psrt.dp.common import optimizer_state_bytes
from psrt.dp.stats import StepStats  # noqa: F401  (where the strategies take it from)
from psrt.errors import make_options
from psrt.trace import OFF


@dataclass(frozen=True)
class NoOptions:
    """A strategy without options."""


def option_names(strategy_cls) -> tuple[str, ...]:
    """The keyword options a strategy class accepts."""
    return tuple(f.name for f in dataclasses.fields(strategy_cls.Options))


class DataParallel(abc.ABC):
    """Base class of the `--dp` strategies.

    Args:
        model: the replica on this rank (identical architecture on every rank).
        make_optimizer: `params -> torch.optim.Optimizer`; strategies that shard the
            optimizer (ps-sharded, zero) call it on their shard only.
        group: a `psrt.Communicator` over the data-parallel ranks.

    Keyword options are the fields of the class's `Options` dataclass (validated there); an
    option the strategy does not know is a one-line PsrtError naming what it accepts, never
    silently ignored.  `self.options` holds them, typed.
    """

    name = "base"
    is_worker = True               # False on a dedicated parameter-server rank
    Options = NoOptions
    composes = True                # False: owns its whole step, plain layout only (see module)
    frees_grads = False            # True: reduces during backward and drops .grad (zero2, zero3)
    interleaved_ok = True          # False: needs the micro-batches one after another (zero3)

    @property
    def num_workers(self) -> int:
        """How many ranks train (call `step`); the global batch is split over these."""
        return self.group.size

    @property
    def worker_rank(self) -> int:
        """This rank's index among the workers (0..num_workers-1); -1 on a server."""
        return self.group.rank if self.is_worker else -1

    @property
    def tracer(self):
        """Where this strategy's spans go: its communicator's tracer (psrt.trace), if any."""
        return getattr(self.group, "tracer", OFF)

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer-state tensors held by this rank (momentum, Adam moments...)."""
        opt = getattr(self, "optimizer", None)
        return optimizer_state_bytes(opt) if opt is not None else 0

    def memory(self) -> dict:
        """The tensors this rank holds, by part (params, grads, optimizer, buffers), for the
        memory ledger (psrt.dp.memory): by default the model's parameters, their .grad and
        the optimizer.  A strategy that keeps its own copies or shards names them instead."""
        params = self.params if self.subset else [p for p in self.model.parameters()]
        return {"params": params, "grads": [p.grad for p in params],
                "optimizer": getattr(self, "optimizer", None) or []}

    def __init__(self, model: torch.nn.Module, make_optimizer: Callable[[Iterable], torch.optim.Optimizer],
                 group, params: list | None = None, **options):
        self.model = model
        self.make_optimizer = make_optimizer
        self.group = group
        # A subset (the dense or the expert parameters of a model): nothing else is touched,
        # broadcast or updated by this component; None: the whole model.
        self.subset = params is not None
        self.params = list(params) if params is not None else \
            [p for p in model.parameters() if p.requires_grad]
        self.options = make_options(self.Options, options, f"--dp {self.name}")

    # ------------------------------------------------------------ the component contract
    def begin(self, microbatches: int) -> None:
        """A step of `microbatches` micro-batches starts: clear the gradients."""
        self.microbatches = microbatches
        for p in self.params:
            p.grad = None

    def microbatch(self, k: int):
        """A context around micro-batch k's forward and backward (layouts that run them one
        after another); nothing by default."""
        return contextlib.nullcontext()

    def before_backward(self, k: int, loss: float) -> None:
        """Right before micro-batch k's backward; `loss` is the sum of the micro-batch losses
        so far over the step's number of micro-batches (this rank's mean at the last)."""

    def complete(self, loss: float) -> StepStats:
        """After every backward of the step: reduce, update, gather.  `loss` is this rank's
        mean loss; the result's loss is the global mean where the strategy has it."""
        raise NotImplementedError(f"--dp {self.name} owns its whole step: call step()")

    def step(self, loss_fn: Callable[[object], torch.Tensor], microbatches: list) -> StepStats:
        """Forward/backward over this rank's micro-batches, communicate, update parameters."""
        from psrt.dp.passes import local, run_step
        return run_step([self], local(loss_fn, self.tracer), microbatches)

    def broadcast_initial(self) -> None:
        """Every replica from group rank 0's values: the component's parameters, and the
        model's buffers when it covers the whole model."""
        from psrt.dp.common import broadcast_tensors
        broadcast_tensors(self.params + ([] if self.subset else list(self.model.buffers())), self.group)

    def serve(self, rounds: int | None = None) -> bool:
        """Run a dedicated server until every worker has finished (servers only), or until
        `rounds` more updates were made, so a server can join a checkpoint between calls.
        Returns True once every worker has finished."""
        return True

    def finish(self) -> None:
        """Tell the others this rank is done (workers), release threads and buffers."""

    def state_dict(self) -> dict:
        """Everything needed to resume this rank (model, optimizer or its shard)."""
        return {"model": self.model.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
