"""Any psrt data-parallel strategy on the user's own model, from the user's own training loop.

    import psrt
    from torch.utils.data import DataLoader

    dp = psrt.data_parallel(model, lambda params: torch.optim.SGD(params, lr=0.1), strategy="ps")
    loader = DataLoader(dp.shard(train_set), batch_size=64 // dp.num_workers)
    for x, y in loader:                     # empty on a dedicated server rank
        stats = dp.step(lambda mb: F.cross_entropy(model(mb[0]), mb[1]), (x, y))
    dp.finish()                             # a dedicated server serves here until the workers end

`data_parallel` builds the strategy named in `psrt.dp.STRATEGIES` over a communicator of its
own, checks its keyword options first (a wrong name is one line listing what it accepts) and
returns a `Driver`, which is also what `python -m psrt.train` trains with.  Every rank starts
from rank 0's parameters (each strategy broadcasts them) and buffers (the driver does).

Server ranks run the same loop: `shard()` gives them nothing to iterate, `step()` on a
server serves one update instead of computing one, and `finish()` serves until every worker
has finished.  See docs/how-to/training.md, "Your own loop".
"""
from __future__ import annotations

import os
from typing import Callable, Iterable

import torch

from psrt.dp import strategy_class
from psrt.dp.base import StepStats
from psrt.dp.common import broadcast_tensors
from psrt.dp.device import pick, to
from psrt.errors import PsrtError, make_options


# The bytes a step of a grid layout sent on each axis (psrt.train.layout.OnGrid.step).
AXIS_BYTES = ("dp_bytes_sent", "pp_bytes_sent", "tp_bytes_sent", "ep_bytes_sent")


class Totals:
    """Sums over the steps one rank took, the bytes per axis of a grid's among them."""

    def __init__(self):
        self.steps, self.compute_s, self.comm_s, self.bytes_sent, self.loss = 0, 0.0, 0.0, 0, float("nan")
        self.axis_bytes: dict[str, int] = {}

    def add(self, s: StepStats) -> None:
        self.steps += 1
        self.compute_s += s.compute_s
        self.comm_s += s.comm_s
        self.bytes_sent += s.bytes_sent
        self.loss = s.loss
        for k in AXIS_BYTES:
            if k in s.extra:
                self.axis_bytes[k] = self.axis_bytes.get(k, 0) + s.extra[k]


def split_batch(batch, k: int) -> list:
    """`batch` cut into k equal micro-batches along the first dimension of every tensor in it
    (tensors, and tuples, lists and dicts of them; anything else is given to each micro-batch
    as it is).  Unequal micro-batches would weight samples unequally, so a tensor whose first
    dimension does not divide by k is an error."""
    if k == 1:
        return [batch]
    if torch.is_tensor(batch):
        if batch.dim() == 0 or batch.shape[0] % k:
            size = batch.shape[0] if batch.dim() else "a scalar"
            raise PsrtError(f"step(accum={k}): a batch of {size} samples does not split into {k} "
                            f"equal micro-batches: use a batch size that is a multiple of {k}")
        return list(batch.chunk(k))
    if isinstance(batch, (tuple, list)):
        parts = [split_batch(b, k) for b in batch]
        return [type(batch)(p[i] for p in parts) if not hasattr(batch, "_fields")
                else type(batch)(*(p[i] for p in parts)) for i in range(k)]
    if isinstance(batch, dict):
        parts = {key: split_batch(v, k) for key, v in batch.items()}
        return [{key: p[i] for key, p in parts.items()} for i in range(k)]
    return [batch] * k


class Driver:
    """One strategy on this rank, driven by the caller's loop (made by `data_parallel`).

    Attributes: `model` (the caller's module, trained in place), `strategy` (the
    psrt.dp strategy), `group` (its psrt.Communicator), `stats` (the StepStats of every
    step this rank took), `totals` (their sums).
    """

    def __init__(self, model: torch.nn.Module, make_optimizer: Callable[[Iterable], torch.optim.Optimizer],
                 strategy: str, group, accum: int = 1, own_group: bool = False, device=None, **options):
        self.name = strategy
        where = f"psrt.data_parallel(strategy={strategy!r})"
        if not isinstance(model, torch.nn.Module):
            raise PsrtError(f"{where}: model must be a torch.nn.Module, got {type(model).__name__}",
                            everywhere=True)
        if isinstance(make_optimizer, torch.optim.Optimizer) or not callable(make_optimizer):
            raise PsrtError(f"{where}: make_optimizer must be a function params -> optimizer (the "
                            f"strategy decides which parameters it gets), got {type(make_optimizer).__name__}: "
                            "e.g. lambda params: torch.optim.SGD(params, lr=0.1)", everywhere=True)
        self.accum = _check_accum(accum, where)
        cls = strategy_class(strategy)
        make_options(cls.Options, options, where)       # before any rank sends a byte
        self.model, self.group, self._own_group = model, group, own_group
        # device: the model and every batch step() is given go there (psrt.dp.device)
        self.device = None if device is None else torch.device(device)
        if self.device is not None:
            model.to(self.device)
        self.strategy = cls(model, make_optimizer, group, **options)
        # The strategies start every replica from rank 0's parameters; buffers too here, so
        # that the parameter servers (which move parameters only) agree on them as well.
        broadcast_tensors(list(model.buffers()), group)
        self.stats: list[StepStats] = []
        self.totals = Totals()
        self._finished = False

    # ------------------------------------------------------------------ roles
    @property
    def is_server(self) -> bool:
        """A dedicated parameter-server rank: it trains nothing, it serves the workers."""
        return not self.strategy.is_worker

    @property
    def is_worker(self) -> bool:
        """This rank computes gradients (rank 0 of `ps` with servers=0 serves as well)."""
        return self.strategy.is_worker

    @property
    def num_workers(self) -> int:
        """How many ranks train; the global batch is split over these."""
        return self.strategy.num_workers

    @property
    def worker_rank(self) -> int:
        """This rank's index among the workers (0..num_workers-1); -1 on a dedicated server."""
        return self.strategy.worker_rank

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank put on the wire so far: its steps' on a worker, what it served on a
        dedicated server."""
        if self.is_worker:
            return self.totals.bytes_sent
        return getattr(self.strategy, "server_totals", {}).get("bytes_sent", 0)

    def optimizer_state_bytes(self) -> int:
        return self.strategy.optimizer_state_bytes()

    @property
    def reshardable(self) -> bool:
        """Whether a checkpoint of another world size can be loaded (zero1/2/3)."""
        return getattr(self.strategy, "reshardable", False)

    def load_resharded(self, states: list[dict]) -> None:
        self.strategy.load_resharded(states)

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds now: params, grads, optimizer, buffers (psrt.dp.memory)."""
        from psrt.dp import memory
        return memory.held(self.strategy)

    # ------------------------------------------------------------------ data
    def shard(self, dataset):
        """This worker's part of a map-style `dataset`: every num_workers-th sample from
        worker_rank on (DistributedSampler's split without shuffling), the same length on
        every worker (a tail of fewer than num_workers samples is left out), empty on a
        dedicated server.  A DataLoader over it with batch_size b (shuffle=False) gives
        workers batches that together are the consecutive global batches of b x num_workers
        samples that one process would take."""
        from torch.utils.data import Subset
        try:
            size = len(dataset)
        except TypeError:
            raise PsrtError(f"shard(): needs a map-style data set with a length, got "
                            f"{type(dataset).__name__}") from None
        if self.is_server:
            return Subset(dataset, [])
        per = size // self.num_workers
        return Subset(dataset, range(self.worker_rank, per * self.num_workers, self.num_workers))

    # ------------------------------------------------------------------ training
    def step(self, loss_fn: Callable[[object], torch.Tensor], batch=None, *, accum: int | None = None,
             microbatches: list | None = None) -> StepStats:
        """One optimizer step on this worker's `batch`: forward and backward of `loss_fn`
        (micro-batch -> scalar mean loss) over `accum` equal micro-batches cut from it (or
        over the given `microbatches`), the strategy's communication, the update.  Returns
        the step's StepStats (its `loss` is the global batch's mean where the strategy has it).

        On a dedicated server rank it serves one update instead (loss_fn and batch are not
        used) and returns StepStats with extra["served"]; once every worker has finished it
        returns at once."""
        if self._finished:
            raise PsrtError(f"--dp {self.name}: step() after finish()")
        if self.is_server:
            done = self.strategy.serve(rounds=1)
            stats = StepStats(extra={"served": True, "workers_done": done})
        else:
            if microbatches is None:
                if batch is None:
                    raise PsrtError("step(loss_fn, batch): give a batch (or microbatches=[...])")
                k = self.accum if accum is None else _check_accum(accum, "step()")
                microbatches = split_batch(batch, k)
            elif batch is not None or accum is not None:
                raise PsrtError("step(): give either a batch (with accum=) or microbatches=, not both")
            if self.device is not None:
                microbatches = [to(mb, self.device) for mb in microbatches]
            with self.strategy.tracer.span("step", "step", step=len(self.stats) + 1):
                stats = self.strategy.step(loss_fn, list(microbatches))
        self.stats.append(stats)
        self.totals.add(stats)
        return stats

    def serve(self, rounds: int | None = None) -> bool:
        """Dedicated servers: serve until every worker has called finish() (or `rounds` more
        updates).  Returns True once every worker has finished.  A worker returns True."""
        if self.is_worker:
            return True
        return self.strategy.serve(rounds)

    def finish(self) -> None:
        """Every rank calls it once after its loop: a worker tells the servers it is done, a
        dedicated server serves until all workers are; threads and communicators are freed."""
        if self._finished:
            return
        self._finished = True
        self.strategy.finish()
        if self._own_group:
            comm = self.group.comm
            self.group.close()
            comm.Free()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """This rank's state (model, optimizer or its shard, a server's shard)."""
        return self.strategy.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.strategy.load_state_dict(state)


def _check_accum(accum, where: str) -> int:
    if isinstance(accum, bool) or not isinstance(accum, int) or accum < 1:
        raise PsrtError(f"{where}: accum must be a whole number >= 1, got {accum!r}", everywhere=True)
    return accum


def data_parallel(model: torch.nn.Module, make_optimizer: Callable[[Iterable], torch.optim.Optimizer],
                  strategy: str = "ring", *, world=None, group=None, accum: int = 1, device: str | None = None,
                  **options) -> Driver:
    """Train `model` with psrt's data-parallel `strategy` from your own loop.

    Args:
        model: the replica on this rank (same architecture everywhere; rank 0's parameters
            and buffers are given to every rank).
        make_optimizer: `params -> torch.optim.Optimizer`; strategies that shard the
            optimizer (zero, ps-sharded) call it on their shard only, a parameter server on
            its server rank.  The learning rate applies to the global batch.
        strategy: a name of psrt.dp.STRATEGIES: ps, ps-sharded, ps-async, ring, native,
            torch, zero, horovod.
        world: a psrt.World (default: psrt.init()); the strategy runs on a Dup of its comm.
        group: a psrt.Communicator to run on instead (the caller closes it).
        accum: micro-batches each `step(loss_fn, batch)` cuts the batch into.
        device: "cpu", "cuda" (this rank's GPU: local rank modulo the GPUs visible) or "auto"
            (cuda where a GPU is visible): the model moves there, and each batch step() gets.
            None (default): where the model already is.
        **options: the strategy's options (its Options dataclass: servers=, staleness=,
            bucket_mb=, overlap=, compress=, algorithm=, ...); an unknown one is an error.

    Every rank of the world (or group) must call it, and later `finish()`.
    """
    own = group is None
    if own:
        if world is None:
            from psrt.watchdog import init
            world = init()
        from psrt.collectives import Communicator
        group = Communicator(world.comm.Dup(), algorithm="auto")
    elif world is not None:
        raise PsrtError("psrt.data_parallel: give world= or group=, not both", everywhere=True)
    if device is not None:
        local_rank = world.local_rank if world is not None else \
            int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)))
        device = pick(device, local_rank)
    return Driver(model, make_optimizer, strategy, group, accum=accum, own_group=own, device=device, **options)
