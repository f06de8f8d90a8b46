"""The lead worker's progress: a bar on a terminal, a line every tenth of the run otherwise
(psrt.train.report.Progress)."""
from __future__ import annotations

from psrt.train import report
from psrt.train.events import Callback


class Progress(Callback):

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.bar = report.Progress(1, "", enabled=False)
        self.lead = False

    def start(self, run, first: int) -> None:
        self.lead = run.is_lead
        self.bar = report.Progress(run.total or 1, run.label, enabled=self.lead and not self.quiet and bool(run.total),
                                  first=first)

    def on_run_start(self, run) -> None:
        self.start(run, run.start)

    def on_recovered(self, run) -> None:
        if run.is_lead != self.lead:
            self.start(run, run.step)

    def on_step_end(self, run, stats) -> None:
        if not run.is_lead or stats is None:
            return
        note = f" dropped {run.notes['dropped']}" if "dropped" in run.notes else ""
        self.bar.update(run.step, f"loss {stats.loss:.4f}{note}")
