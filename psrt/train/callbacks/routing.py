"""--model moe: the tokens each expert was routed and dropped, summed over the steps, each
step's figures in its metrics line, and the summary's MoE columns beside the uniform-routing
model (psrt.train.routing)."""
from __future__ import annotations

from psrt.train.events import Callback
from psrt.train.routing import RoutingTotals, moe_summary


class Routing(Callback):

    def __init__(self):
        self.routing = RoutingTotals()

    def on_step_end(self, run, stats) -> None:
        if stats is not None and "moe" in stats.extra:
            run.notes.update(self.routing.add(run.cfg, stats.extra["moe"]))

    def on_gather(self, run, mine: dict) -> None:
        mine["a2a"] = self.routing.a2a

    def on_run_end(self, run, everyone, row) -> None:
        r = self.routing
        if row is None or not r.layers:
            return
        cfg, g = run.cfg, run.layout.grid
        if run.group is None:
            row["dp"] += f" ep{cfg.ep}"
        row.update(moe_summary(cfg, g.dp, r, run.total - run.start, sum(e["a2a"] for e in everyone) / len(everyone),
                               run.model.embed.tok.embedding_dim, layers_per_rank=r.layers / g.pp))
