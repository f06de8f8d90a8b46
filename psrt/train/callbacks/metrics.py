"""--metrics: one JSON line per step from the lead worker (loss, times, bytes, and what the
other components noted of the step), appended to on a resume; the summary line follows at the
end of the run (psrt.train.loop)."""
from __future__ import annotations

from psrt.dp.driver import AXIS_BYTES
from psrt.train import report
from psrt.train.events import Callback


class Metrics(Callback):

    def __init__(self, path: str | None = None):
        self.path = path
        self.out = report.Metrics(None)
        self.lead = False

    def file(self, run) -> str | None:
        return self.path if self.path is not None else run.path("metrics")

    def on_run_start(self, run) -> None:
        self.lead = run.is_lead
        self.out = report.Metrics(self.file(run) if self.lead else None, append=run.resumed)

    def on_recovered(self, run) -> None:
        if run.is_lead != self.lead:          # the lead worker was lost: a new one writes on
            self.lead = run.is_lead
            self.out = report.Metrics(self.file(run) if self.lead else None, append=True)

    def on_step_end(self, run, stats) -> None:
        if not run.is_lead or stats is None:
            return
        grid = run.cfg is not None and run.group is None
        epoch = run.sampler.position(run.step - 1)[0] if run.cfg is not None else None
        self.out.write({"dp": run.dp, "step": run.step, "epoch": epoch, "loss": report.finite(stats.loss),
                        **({"pp": run.cfg.pp, "tp": run.cfg.tp} if grid else {}),
                        "compute_s": stats.compute_s, "comm_s": stats.comm_s, "bytes_sent": stats.bytes_sent,
                        "time_s": run.time_s(),
                        **{k: stats.extra[k] for k in AXIS_BYTES + ("bubble",) if k in stats.extra},
                        **({"loss_scale": run.scaler.scale} if run.scaler else {}), **run.notes})

    def on_run_end(self, run, everyone, row) -> None:
        self.out.close()
