"""The summary row of a strategy's run: the step totals of every rank, gathered on the lead
worker, as one row of psrt.train's table (throughput, compute and communication time, bytes
per rank, optimizer state, the final losses)."""
from __future__ import annotations

from psrt.dp import strategy_class
from psrt.dp.base import option_names
from psrt.dp.driver import Totals
from psrt.train.events import Callback


class Summary(Callback):

    def __init__(self):
        self.totals = Totals()

    def on_step_end(self, run, stats) -> None:
        if stats is not None:
            self.totals.add(stats)

    def on_gather(self, run, mine: dict) -> None:
        t, layout = self.totals, run.layout
        mine.update(worker=layout.is_worker, compute_s=t.compute_s, comm_s=t.comm_s,
                    bytes=t.bytes_sent if layout.is_worker else layout.bytes_sent(), axis_bytes=t.axis_bytes,
                    opt=sum(c.optimizer_state_bytes() for c in layout.components), steps=t.steps, loss=t.loss,
                    wall=run.wall, params=layout.params_count(),
                    left_out=sum(getattr(c, "server_totals", {}).get("left_out", 0) for c in layout.components))

    def on_run_end(self, run, everyone, row) -> None:
        if row is None:
            return
        cfg, dp = run.cfg, run.dp
        name = dp if run.group is not None or cfg.pp * cfg.tp == 1 else f"{dp} pp{cfg.pp} tp{cfg.tp}"
        row.update(summarize(name, everyone, everyone[run.rank], cfg.batch_size))
        # the step the run reached, a resumed one's earlier steps included (samples/s and the
        # times are this run's own)
        row.update(steps=run.total, steps_run=self.totals.steps)
        if cfg.backup_workers and "ps" in dp:
            row.update(left_out=sum(r["left_out"] for r in everyone), backup_workers=cfg.backup_workers)
        row["grad_bytes"] = wire_gradient_bytes(run.model, cfg, dp)
        if run.scaler:
            row.update(loss_scale=run.scaler.scale, skipped_steps=run.scaler.skipped)


def wire_gradient_bytes(model, cfg, dp: str) -> int:
    """Bytes of gradients a step communicates: every trainable parameter, in the --compress
    dtype where the strategy takes it."""
    squeeze = cfg.compress != "none" and "compress" in option_names(strategy_class(dp))
    return sum(p.numel() * (2 if squeeze else p.element_size()) for p in model.parameters() if p.requires_grad)


def summarize(dp: str, everyone: list[dict], lead: dict, batch_size: int) -> dict:
    """The row's common columns: the lead worker's losses and throughput, the workers' mean
    times, bytes per rank and the largest optimizer state."""
    workers = [r for r in everyone if r["worker"]]
    mean = lambda key: sum(r[key] for r in workers) / len(workers)  # noqa: E731
    return {"dp": dp, "workers": len(workers), "ranks": len(everyone), "steps": lead["steps"],
            "train_loss": lead["loss"], "test_loss": lead["test_loss"], "test_acc": lead["test_acc"],
            "samples_per_s": lead["steps"] * batch_size / max(lead["wall"], 1e-9),
            "wall_s": lead["wall"], "compute_s": mean("compute_s"), "comm_s": mean("comm_s"),
            "bytes_per_rank": mean("bytes"), "bytes_max_rank": max(r["bytes"] for r in everyone),
            "opt_state_bytes": max(r["opt"] for r in everyone)}
