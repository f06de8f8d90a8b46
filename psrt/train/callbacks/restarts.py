"""Where a run starts: fresh, from --resume, or from the last checkpoint after a restart by
`mpi_launch --restarts` (psrt.train.recovery says what a restart costs)."""
from __future__ import annotations

import sys

from psrt import faults
from psrt.train import checkpoint
from psrt.train.events import Callback
from psrt.train.recovery import Recovery


class Restarts(Callback):
    """Loads the checkpoint a run resumes from, says so, and notes each finished step next to
    it, with a restart's cost on the first step after one."""

    def __init__(self):
        self.recovery: Recovery | None = None

    def on_resume(self, run) -> int | None:
        path = run.path("checkpoint")
        self.recovery = Recovery(path, run.cfg.checkpoint_every, run.total, run.is_lead)
        if not self.recovery.resume(run.cfg.resume, run.ctl):
            return None
        step = checkpoint.load(path, run.ctl, run.layout.state, run.hparams)
        faults.strike_if_asked("recovery", step)
        return step

    def on_run_start(self, run) -> None:
        self.recovery.started(run.start, run.dp)
        if run.cfg.resume and run.is_lead and not run.cfg.quiet:
            print(f"psrt.train: resuming {run.dp} from {run.path('checkpoint')} at step {run.start}",
                  file=sys.stderr, flush=True)

    def on_step_end(self, run, stats) -> None:
        if stats is not None:
            run.notes.update(self.recovery.step_done(run.step))
