"""The events of a training run, and the base class of the components that listen to them.

The training loop (psrt/train/core.py) only moves batches through a layout's step; everything
else a run does (checkpoints, recovery, metrics, progress, the timeline, the memory ledger,
evaluation, the summary, loggers, the user's own `--callback`) is a component that hears what
happened and acts on it.  The shape is that of MosaicML Composer's `Engine` running callbacks
at named `Event`s, Lightning's `Callback` hooks and Hugging Face's `TrainerCallback`.

Every rank hears every event, in the order the components were given: a component that writes
(metrics, progress) does so where `run.is_lead`; one that calls a collective (a checkpoint)
does so on every rank, so that the call matches.  `run` is the run's state (psrt.train.state):
`run.step` the steps finished, `run.total`, `run.start`, `run.dp`, `run.is_lead`, `run.cfg`.
"""
from __future__ import annotations

import time


class Callback:
    """A component of a training run: override the events it cares about.

    The order of a run: `on_resume` (each may restore a state and return its step), then
    `on_run_start`, then `on_step_end` after every step (`stats` the step's StepStats; None on
    a dedicated parameter server, which hears it at each of `boundaries` instead), `on_failure`
    and `on_recovered` around a lost rank, `on_loop_end` before the strategy finishes,
    `on_evaluate` with the one-process model, `on_gather` (what this rank tells the lead
    worker), `on_run_end` with every rank's figures and the lead worker's summary row.
    """

    def on_resume(self, run) -> int | None:
        """Restore this run's state (a checkpoint); return the step it holds, or None."""
        return None

    def boundaries(self, run) -> set[int]:
        """Steps after which every rank, a dedicated server too, must meet (a checkpoint)."""
        return set()

    def on_run_start(self, run) -> None:
        """Training starts at run.start (0, or the step a resume restored: run.resumed)."""

    def on_step_end(self, run, stats) -> None:
        """run.step steps are done; `stats` says what the last one did (None on a server).
        Components before this one may have noted the step's extra fields in run.notes."""

    def on_failure(self, run, error: BaseException) -> bool:
        """A step raised `error`: return True once the run is whole again (run.step set to
        the step it goes on from), False to let the error end the run."""
        return False

    def on_recovered(self, run) -> None:
        """The run goes on from run.step after a failure, on a new world (run.is_lead may
        have moved to another rank)."""

    def on_loop_end(self, run) -> None:
        """Every step is done; the strategy has not yet finished (its state is as the last
        step left it)."""

    def on_evaluate(self, run, model) -> None:
        """`model` is the trained one-process model (on every rank of a plain run, on rank 0
        of a grid); the strategy has finished and the final checkpoint is written."""

    def on_gather(self, run, mine: dict) -> None:
        """Add this rank's figures to `mine`, which the lead worker receives from every rank."""

    def on_run_end(self, run, everyone: list[dict] | None, row: dict | None) -> None:
        """The run is over: `everyone` is every rank's `mine` and `row` the summary row, on
        the lead worker (None elsewhere); add columns to it, write, close."""


EVENTS = tuple(name for name in vars(Callback) if name.startswith("on_"))


class Events:
    """The components of a run, told of each event in their order."""

    def __init__(self, components):
        self.components = list(components)

    def ask(self, event: str, *args) -> list:
        """Every component's answer to `event` (a user's component need not subclass
        Callback: one without the event is not asked)."""
        return [getattr(c, event)(*args) for c in self.components if callable(getattr(c, event, None))]

    def emit(self, event: str, *args) -> None:
        self.ask(event, *args)

    def resume(self, run) -> int | None:
        """The step the first component that restored a state returned, or None (every
        component is asked: each restores its own part)."""
        return next((s for s in self.ask("on_resume", run) if s is not None), None)

    def boundaries(self, run) -> list[int]:
        """Every step some component needs all ranks to meet after, inside the run."""
        return sorted({b for found in self.ask("boundaries", run) for b in found if run.start < b < run.total})

    def recovered(self, run, error: BaseException) -> bool:
        """Whether a component made the run whole again after `error` (the first that can)."""
        return any(getattr(c, "on_failure", lambda *_: False)(run, error) for c in self.components)


class LoopState:
    """What a component hears about a user's own loop (psrt.data_parallel): the same names as
    a psrt.train run where they make sense there."""

    def __init__(self, driver, dp: str, total: int | None, hparams: dict):
        self.driver, self.dp, self.total, self.hparams = driver, dp, total, hparams
        self.step = self.start = 0
        self.resumed = False
        self.is_lead = driver.is_worker and driver.worker_rank == 0
        self.rank = driver.group.rank
        self.cfg, self.scaler = None, None
        self.notes: dict = {}
        self.t0 = time.perf_counter()

    @property
    def label(self) -> str:
        return self.dp

    def time_s(self) -> float:
        return time.perf_counter() - self.t0


class WithCallbacks:
    """A psrt.data_parallel Driver whose steps components hear: wrap it, call `step` and
    `finish` as on the Driver itself.

        ddp = WithCallbacks(psrt.data_parallel(model, opt, "ring"), [TensorBoard("runs/a")], total=100)
        for batch in batches:
            ddp.step(loss_fn, batch)
        ddp.finish()

    The events of a user's loop are run start (at the first step), step end and run end
    (`everyone` and `row` are None: the figures stay with the user's loop)."""

    def __init__(self, driver, components, total: int | None = None, hparams: dict | None = None):
        self.driver = driver
        self.events = Events(components)
        self.run = LoopState(driver, driver.name, total, dict(hparams or {}))

    def __getattr__(self, name):
        return getattr(self.driver, name)

    def step(self, *args, **kwargs):
        if not self.run.step and not self.driver.stats:
            self.run.t0 = time.perf_counter()
            self.events.emit("on_run_start", self.run)
        stats = self.driver.step(*args, **kwargs)
        self.run.step += 1
        self.run.notes = {}
        self.events.emit("on_step_end", self.run, None if self.driver.is_server else stats)
        return stats

    def finish(self) -> None:
        self.events.emit("on_loop_end", self.run)
        self.driver.finish()
        self.events.emit("on_run_end", self.run, None, None)
