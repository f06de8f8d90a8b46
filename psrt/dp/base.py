"""The contract every data-parallel strategy keeps.

A strategy owns the path from local gradients to updated parameters.  It runs the forward
and backward passes itself (`step`), so a ring DDP can overlap its all-reduce with backward
and a parameter server can push and pull on its own schedule, while the training loop stays
the same for all of them.

Equivalence promise (tested for every strategy): with global batch B split over N ranks,
k calls of `step` leave the same parameters as one process training on the whole batch.
Each rank's loss is the mean over its own samples, so gradients are averaged over ranks
(and over accumulated micro-batches) to give the gradient of the global mean loss.
"""
from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from psrt.dp.common import optimizer_state_bytes
from psrt.errors import make_options
from psrt.trace import OFF


@dataclass
class StepStats:
    """What one step cost, for the summary table and the JSONL metrics.

    `loss` is the mean loss over the global batch (averaged over workers) where the strategy
    can provide it cheaply (ddp and zero reduce it together with the gradients); a strategy
    that reports only this worker's mean sets extra["loss_scope"] = "local".
    """
    loss: float = float("nan")
    compute_s: float = 0.0        # forward + backward (+ optimizer where local)
    comm_s: float = 0.0           # time blocked in communication (not hidden by overlap)
    bytes_sent: int = 0           # bytes this rank put on the wire in this step
    extra: dict = field(default_factory=dict)


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
        params = [p for p in self.model.parameters()]
        return {"params": params, "grads": [p.grad for p in params],
                "optimizer": getattr(self, "optimizer", None) or []}

    def __init__(self, model: torch.nn.Module, make_optimizer: Callable[[Iterable], torch.optim.Optimizer],
                 group, **options):
        self.model = model
        self.make_optimizer = make_optimizer
        self.group = group
        self.options = make_options(self.Options, options, f"--dp {self.name}")

    @abc.abstractmethod
    def step(self, loss_fn: Callable[[object], torch.Tensor], microbatches: list) -> StepStats:
        """Forward/backward over this rank's micro-batches, communicate, update parameters."""

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
