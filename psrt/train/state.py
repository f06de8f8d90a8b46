"""The state of one strategy's run in psrt.train, which the loop core and its components share.

The core (psrt/train/core.py) advances `step`; the components read it and keep their own
state to themselves.  What several of them need lives here: the configuration, the built
layout (its strategy, Communicator, sampler, lead worker), where the run started and stops,
the job's communicators, and `notes`, the fields components add to the current step's
record (a recovery's cost, MoE routing) for the metrics component to write.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable


class RunState:
    """One strategy's run (`dp`) of psrt.train.

    Args:
        cfg: the TrainConfig.
        dp: the strategy.
        job: the loop's Job (world, the loop's communicator `ctl`, watchdog); in-job recovery
            replaces them.
        dataset: the data set (train_x/train_y, test_x/test_y).
        tracer: the run's Tracer (psrt.trace.OFF when not tracing).
        build: `() -> the built layout` on job.world: what a recovery calls again.
    """

    def __init__(self, cfg, dp: str, job, dataset, tracer, build: Callable):
        self.cfg, self.dp, self.job, self.dataset, self.tracer = cfg, dp, job, dataset, tracer
        self.build = build
        self.built = build()
        self.total = cfg.steps or cfg.epochs * self.sampler.steps_per_epoch
        self.start = self.step = 0
        self.resumed = False
        self.notes: dict = {}
        self.t0 = time.perf_counter()
        self.wall = 0.0
        self.model = None
        self.hparams = dict(cfg.as_dict(), dp=dp)   # what a checkpoint records and TensorBoard shows

    # what the built layout holds (replaced whole by a recovery)
    @property
    def layout(self):
        return self.built.run

    @property
    def group(self):
        return self.built.group

    @property
    def sampler(self):
        return self.built.sampler

    @property
    def scaler(self):
        return self.built.scaler

    @property
    def lead(self) -> int:
        return self.built.lead

    @property
    def ctl(self):
        return self.job.ctl

    @property
    def rank(self) -> int:
        return self.job.ctl.rank

    @property
    def is_lead(self) -> bool:
        return self.job.ctl.rank == self.built.lead

    @property
    def is_worker(self) -> bool:
        return self.layout.is_worker

    @property
    def label(self) -> str:
        return self.layout.label(self.dp)

    def path(self, name: str) -> str | None:
        """Output `name` (--metrics, --checkpoint, ...) of this strategy (FILE.<dp>.ext with
        several strategies)."""
        return self.cfg.path_for(getattr(self.cfg, name), self.dp)

    def microbatches(self) -> list:
        """This worker's micro-batches of the next step."""
        x, y = self.dataset.train_x, self.dataset.train_y
        return [(x[i], y[i]) for i in self.sampler.microbatches(self.step)]

    def stepping(self):
        """The timeline's span of a step on a grid (a plain layout's Driver draws its own)."""
        if self.group is not None:
            return contextlib.nullcontext()
        return self.tracer.span("step", "step", step=self.step + 1)

    def time_s(self) -> float:
        return time.perf_counter() - self.t0
