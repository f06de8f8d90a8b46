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
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch


@dataclass
class StepStats:
    """What one step cost, for the summary table and the JSONL metrics."""
    loss: float = float("nan")
    compute_s: float = 0.0        # forward + backward (+ optimizer where local)
    comm_s: float = 0.0           # time blocked in communication (not hidden by overlap)
    bytes_sent: int = 0           # bytes this rank put on the wire in this step
    extra: dict = field(default_factory=dict)


class DataParallel(abc.ABC):
    """Base class of the `--dp` strategies.

    Args:
        model: the replica on this rank (identical architecture on every rank).
        make_optimizer: `params -> torch.optim.Optimizer`; strategies that shard the
            optimizer (ps-sharded, zero) call it on their shard only.
        comm: a `psrt.Communicator` over the data-parallel ranks.
    """

    name = "base"
    is_worker = True               # False on a dedicated parameter-server rank

    def __init__(self, model: torch.nn.Module, make_optimizer: Callable[[Iterable], torch.optim.Optimizer],
                 comm, **options):
        self.model = model
        self.make_optimizer = make_optimizer
        self.comm = comm
        self.options = options

    @abc.abstractmethod
    def step(self, loss_fn: Callable[[object], torch.Tensor], microbatches: list) -> StepStats:
        """Forward/backward over this rank's micro-batches, communicate, update parameters."""

    def serve(self) -> None:
        """Run a dedicated server until every worker has finished (servers only)."""

    def finish(self) -> None:
        """Tell the others this rank is done (workers), release threads and buffers."""

    def state_dict(self) -> dict:
        """Everything needed to resume this rank (model, optimizer or its shard)."""
        return {"model": self.model.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
