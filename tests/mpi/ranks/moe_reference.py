"""Shared piece of the MoE rank-side scripts: the load-balancing loss of a whole batch written
out again from the gates' logits alone (Switch Transformer, Fedus et al. 2021, eq. 4), not
from psrt/ep's code, so statistics taken per rank instead of over the batch would not match."""
import torch

from psrt.ep.layer import moe_layers


def record_gates(model) -> list:
    """A list to which every forward of the model's MoE gates appends its logits."""
    logits = []
    for m in moe_layers(model):
        m.gate.register_forward_hook(lambda mod, inp, out: logits.append(out.detach()))
    return logits


def balance_loss(alpha: float, gate_logits: list) -> float:
    """Sum over the recorded gate forwards of alpha E sum_i f_i P_i, f_i the fraction of the
    forward's tokens whose first choice is expert i, P_i their mean probability of expert i."""
    total = 0.0
    for logits in gate_logits:
        probs = torch.softmax(logits.double(), dim=-1)
        E = probs.shape[1]
        f = torch.bincount(probs.argmax(-1), minlength=E).double() / len(probs)
        total += alpha * E * float((f * probs.mean(0)).sum())
    return total
