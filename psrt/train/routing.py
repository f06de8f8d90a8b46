"""--model moe's routing figures in psrt.train: the options of the MoE layers, the counts of
routed and dropped tokens summed over the steps, and the summary row's MoE fields beside the
uniform-routing model."""
from __future__ import annotations

from psrt.train.config import TrainConfig

def moe_options(cfg: TrainConfig) -> dict:
    return {"experts": cfg.experts, "top_k": cfg.top_k, "capacity_factor": cfg.capacity_factor,
            "aux_alpha": cfg.aux_weight, "dispatch": cfg.moe_dispatch}


class RoutingTotals:
    """A MoE run's routing figures summed over its steps: routed and dropped per expert (every
    layer), the all-to-all bytes this rank sent, the model's number of MoE layers."""

    def __init__(self):
        self.routed = self.dropped = None
        self.a2a, self.layers = 0.0, 0

    def add(self, cfg: TrainConfig, step: dict) -> dict:
        """Add one step's figures (psrt.train.moe's step extra, or the hybrid step's extra
        "moe"); returns its fields of the --metrics line, the same for both."""
        self.routed = step["routed"].clone() if self.routed is None else self.routed + step["routed"]
        self.dropped = step["dropped"].clone() if self.dropped is None else self.dropped + step["dropped"]
        self.a2a += step["a2a_bytes"]
        self.layers = step["layers"]
        return {"ep": cfg.ep, "aux_loss": step["aux_loss"], "routed": step["routed"].tolist(),
                "dropped": int(step["dropped"].sum()), "a2a_bytes": step["a2a_bytes"]}


def moe_summary(cfg: TrainConfig, dp: int, routing: RoutingTotals, steps: int, a2a: float, width: int,
                layers_per_rank: float | None = None) -> dict:
    """The summary row's MoE fields: tokens routed per expert per step and layer, the dropped
    fraction, all-to-all bytes per rank and step (a2a: summed over the steps, mean of the
    ranks) beside the uniform-routing model, 4 all-to-alls per layer of T k h d (EP-1)/EP bytes,
    d the bytes of a value of the compute dtype, in which the rows travel (a pipeline rank
    holds layers / pp of the layers: layers_per_rank)."""
    tokens = cfg.batch_size // dp * cfg.seq_len          # per rank per step
    d = 4 if cfg.precision == "fp32" else 2
    layers = routing.layers
    layers_per_rank = layers if layers_per_rank is None else layers_per_rank
    routed, dropped = routing.routed, routing.dropped
    return dict(moe=True, experts=cfg.experts, ep=cfg.ep, top_k=cfg.top_k,
                routed_per_step=(routed / steps / max(layers, 1)).tolist(),
                dropped_frac=float(dropped.sum() / routed.sum()) if routed.sum() else 0.0,
                a2a_bytes_per_step=a2a / steps,
                a2a_uniform=4 * tokens * cfg.top_k * width * d * (cfg.ep - 1) / cfg.ep * layers_per_rank)
