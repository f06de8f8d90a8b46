"""The CPU load of a run's steps (psrt/train/cpu_load.py): sampled after the first step (its
set-up is not the steady state) and at the loop's end, on every rank; the lead worker's row
gets the means and whether the run was CPU-bound."""
from __future__ import annotations

from psrt.train import cpu_load
from psrt.train.events import Callback


class CpuLoad(Callback):

    def __init__(self):
        self.start = self.end = None

    def on_run_start(self, run) -> None:
        self.start = self.end = None
        if run.start >= run.total - 1:          # a single step: measure it whole
            self.start = cpu_load.sample()

    def on_step_end(self, run, stats) -> None:
        if self.start is None:
            self.start = cpu_load.sample()

    def on_loop_end(self, run) -> None:
        self.end = cpu_load.sample()

    def on_gather(self, run, mine: dict) -> None:
        if self.start is not None and self.end is not None:
            mine.update(cpu_load.shares(self.start, self.end))

    def on_run_end(self, run, everyone, row) -> None:
        if row is not None:
            row.update(cpu_load.verdict(everyone))
