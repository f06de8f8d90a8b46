"""The watchdog hears each finished step, so a rank that stops stepping is named (psrt.watchdog)."""
from __future__ import annotations

from psrt.train.events import Callback


class Heartbeat(Callback):
    def on_step_end(self, run, stats) -> None:
        if run.job.dog is not None and stats is not None:
            run.job.dog.step(run.step)
