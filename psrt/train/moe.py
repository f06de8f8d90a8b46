"""One training step of a model with MoE layers on a grid with expert parallelism.

Each data-parallel rank runs forward and backward on its own micro-batches (its tokens meet
the experts of its expert-parallel group through the layers' all-to-alls).  Then:
- dense parameters (attention, norms, embeddings, the gates) are averaged over the whole
  data-parallel group, with the all-reduce algorithm of --dp (ring, ps, native...);
- expert parameters are reduced over the expert-data-parallel group only, the ranks that
  hold replicas of the same experts.  An expert's gradient on its rank already sums the
  contributions of the tokens of every rank of its expert-parallel group, so the replicas'
  gradients are summed and divided by the data-parallel size: the gradient of the global
  mean loss, as one process holding every expert computes it.
The load-balancing loss enters each rank's objective times the data-parallel size, since the
dense gradients are averaged over the ranks and the layer's `aux` is this rank's share; the
layers attach it to their outputs (psrt.ep.layer.AttachAux), so it survives --recompute.
"""
from __future__ import annotations

import time

import torch

from psrt.collectives.cost import wire_bytes
from psrt.dp.base import StepStats
from psrt.ep.layer import begin_step, moe_layers, tally


def flat_grads(params: list) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def unflat_grads(params: list, flat: torch.Tensor) -> None:
    at = 0
    for p in params:
        n = p.numel()
        p.grad = flat[at:at + n].view_as(p).clone()
        at += n


class MoETrainer:
    """Args: model (MoE layers already sharded: layer.shard), make_optimizer, grid (a
    psrt.grid.Grid with ep), algorithm: the dense gradients' all-reduce algorithm, scaler: the
    psrt.dp.precision.LossScaler of an fp16 run (loss_fn scales the loss, make_optimizer
    builds ScaledOptimizers), so the balance loss is scaled alike."""

    def __init__(self, model: torch.nn.Module, make_optimizer, grid, algorithm: str = "ring", scaler=None):
        self.model, self.grid, self.algorithm, self.scaler = model, grid, algorithm, scaler
        expert_ids = {id(p) for m in moe_layers(model) for p in m.experts.parameters()}
        params = [p for p in model.parameters() if p.requires_grad]
        self.dense = [p for p in params if id(p) not in expert_ids]
        self.expert = [p for p in params if id(p) in expert_ids]
        self.optimizer = make_optimizer(params)

    def step(self, loss_fn, microbatches: list) -> StepStats:
        start = time.perf_counter()
        n, dp = len(microbatches), self.grid.dp
        self.optimizer.zero_grad(set_to_none=True)
        layers = moe_layers(self.model)
        # each micro-batch's balance loss, backpropagated with it (fp16: scaled as loss_fn scales the loss)
        begin_step(layers, dp / n * (self.scaler.scale if self.scaler else 1.0))
        total = 0.0
        for mb in microbatches:
            loss = loss_fn(mb)
            (loss / n).backward()
            total += float(loss.detach())
        seen = tally(layers)
        t_comm = time.perf_counter()
        dense = self.grid.dp_group.allreduce(flat_grads(self.dense), op="avg", algorithm=self.algorithm)
        unflat_grads(self.dense, dense)
        sent = wire_bytes("allreduce", self.algorithm, dense.numel() * dense.element_size(), dp,
                          self.grid.dp_group.rank)
        if self.expert:
            experts = flat_grads(self.expert)
            if self.grid.edp_group.size > 1:
                experts = self.grid.edp_group.allreduce(experts, algorithm=self.algorithm)
            unflat_grads(self.expert, experts / dp)
        # the loss and balance loss of the global batch (aux is a share: sum, not mean)
        both = self.grid.dp_group.allreduce(torch.tensor([total / n, seen["aux"] / n], dtype=torch.float64))
        comm = time.perf_counter() - t_comm
        self.optimizer.step()
        return StepStats(loss=float(both[0]) / dp, compute_s=time.perf_counter() - start - comm, comm_s=comm,
                         bytes_sent=sent + seen["a2a_bytes"],
                         extra={"aux_loss": float(both[1]), "routed": seen["routed"], "dropped": seen["dropped"],
                                "a2a_bytes": seen["a2a_bytes"]})

    def model_width(self) -> int:
        layers = moe_layers(self.model)
        return layers[0].gate.in_features if layers else 0
