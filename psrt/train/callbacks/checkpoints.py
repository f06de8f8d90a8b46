"""--checkpoint: every rank's state in one file, every --checkpoint-every steps (or every
twentieth of a run that may restart) and at the end; psrt.train.checkpoint writes it
atomically, so a failure during a write leaves the previous one whole."""
from __future__ import annotations

from psrt.train import checkpoint
from psrt.train.events import Callback
from psrt.train.recovery import interval, stop_if_asked


class Checkpoints(Callback):
    """Periodic and final checkpoints (collective: every rank, a dedicated server too)."""

    def __init__(self):
        self.saves: set[int] = set()

    def boundaries(self, run) -> set[int]:
        every = interval(run.path("checkpoint"), run.cfg.checkpoint_every, run.total)
        return {k for k in range(run.start + 1, run.total) if every and k % every == 0}

    def on_run_start(self, run) -> None:
        self.saves = self.boundaries(run)

    def on_step_end(self, run, stats) -> None:
        if run.step in self.saves:
            self.save(run, run.step)
            stop_if_asked(run.ctl, run.step, run.is_lead)     # a grow-back asked by the launcher

    def on_evaluate(self, run, model) -> None:
        if run.cfg.checkpoint:           # the final one, after the strategy has finished
            self.save(run, run.total)

    @staticmethod
    def save(run, step: int) -> None:
        checkpoint.save(run.path("checkpoint"), run.ctl, run.layout.state, step,
                        run.sampler.steps_per_epoch, run.hparams)
