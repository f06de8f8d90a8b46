"""One training step of a model with MoE layers on a grid with expert parallelism, from the
caller's own loop (psrt.train's --model moe builds the same through psrt.train.layout).

Each data-parallel rank runs forward and backward on its own micro-batches (its tokens meet
the experts of its expert-parallel group through the layers' all-to-alls).  Then the dense
parameters (attention, norms, embeddings, the gates) are averaged over the whole
data-parallel group and the expert parameters over the expert-data-parallel group only, the
ranks holding replicas of the same experts; an expert's gradient on its rank already sums the
contributions of the tokens of every rank of its expert-parallel group, so the replicas'
average is divided by ep: the gradient of the global mean loss, as one process holding every
expert computes it (psrt.train.layout.attach).  The load-balancing loss enters each rank's
objective times the data-parallel size, since the dense gradients are averaged over the ranks
and the layer's `aux` is this rank's share (psrt.train.layout.begin_moe_step).
"""
from __future__ import annotations

import torch

from psrt.dp.base import StepStats
from psrt.dp.passes import local, run_step
from psrt.ep.layer import moe_layers
from psrt.train.layout import attach, begin_moe_step, routing


class MoETrainer:
    """Args: model (MoE layers already sharded: layer.shard), make_optimizer, grid (a
    psrt.grid.Grid with ep), algorithm: the gradients' all-reduce algorithm (a ring
    all-reduce strategy over dp and edp), scaler: the psrt.dp.precision.LossScaler of an fp16
    run (loss_fn scales the loss, make_optimizer builds ScaledOptimizers), so the balance loss
    is scaled alike and one overflow decision covers dense and expert gradients."""

    def __init__(self, model: torch.nn.Module, make_optimizer, grid, algorithm: str = "ring", scaler=None):
        self.model, self.grid, self.scaler = model, grid, scaler
        self.layers = moe_layers(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        experts = {id(p) for m in self.layers for p in m.experts.parameters()}
        self.components = attach(grid, model, self.params, experts, "ring", {"algorithm": algorithm},
                                 make_optimizer)
        self.optimizer = self.components[0].optimizer

    def step(self, loss_fn, microbatches: list) -> StepStats:
        passes = local(loss_fn)

        def run(mbs, components):
            begin_moe_step(self.grid, self.layers, len(mbs), self.scaler)
            return passes(mbs, components)
        stats = run_step(self.components, run, microbatches, self.scaler)
        moe = routing(self.grid, self.layers, self.layers[0].num_experts if self.layers else 0,
                      len(microbatches))
        stats.extra.update(aux_loss=moe["aux_loss"], routed=moe["routed"], dropped=moe["dropped"],
                           a2a_bytes=moe["a2a_bytes"])
        stats.bytes_sent += moe["a2a_bytes"]
        return stats

    def model_width(self) -> int:
        return self.layers[0].gate.in_features if self.layers else 0
