"""--trace: every rank's spans gathered on rank 0 and written as one Chrome-trace timeline
(psrt.trace), one file per strategy so two strategies' steps are never drawn as one run's."""
from __future__ import annotations

from psrt.train.events import Callback


class Timeline(Callback):
    def on_run_end(self, run, everyone, row) -> None:
        if run.cfg.trace:          # collective: rank 0 writes every rank's
            run.tracer.write(run.ctl, run.path("trace"), run.job.world.hostname)
