"""Which expert each token goes to, and which tokens an expert has no room for.

Top-k gating: a linear gate gives each token a softmax over E experts; the k largest are
its choices.  k = 1 is the Switch Transformer (Fedus et al., JMLR 2022): the gate value is
the chosen expert's probability.  k >= 2 follows GShard (Lepikhin et al., ICLR 2021): the
k probabilities are renormalised to sum to 1.

Capacity: an expert takes at most ceil(C x T x k / E) of a rank's T tokens (capacity factor
C).  Places are given in order, all first choices before any second choice (GShard), each
choice in token order; a choice past capacity is dropped and counted, and its token passes
through the layer by the residual connection alone.

The load-balancing loss (Switch, eq. 4): alpha x E x sum_i f_i P_i, with f_i the fraction of
tokens whose first choice is expert i and P_i the mean gate probability of expert i.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class Routing:
    expert: torch.Tensor      # [T, k] chosen experts
    gate: torch.Tensor        # [T, k] weights of their outputs (differentiable)
    keep: torch.Tensor        # [T, k] True where the expert had room
    position: torch.Tensor    # [T, k] place in the expert's buffer (valid where keep)
    capacity: int

    @property
    def dropped(self) -> int:
        return int((~self.keep).sum())


def capacity(tokens: int, k: int, experts: int, factor: float) -> int:
    return max(1, math.ceil(factor * tokens * k / experts))


def route(probs: torch.Tensor, k: int, factor: float, groups: int = 1) -> Routing:
    """probs [T, E] (softmax of the gate) -> the routing of T tokens with top-k and capacity.

    groups: the tokens are G equal consecutive groups with a capacity each (GShard's groups);
    a rank of an expert-parallel run is one group, and a one-process reference of N ranks
    routes with groups=N to give every rank's tokens the same places."""
    tokens, experts = probs.shape
    top, expert = probs.topk(k, dim=-1)
    gate = top if k == 1 else top / top.sum(-1, keepdim=True)
    per = tokens // groups
    cap = capacity(per, k, experts, factor)
    # place of each choice in its expert, per group: slot-major (every first choice first)
    order = expert.reshape(groups, per, k).transpose(1, 2).reshape(groups, k * per)
    onehot = torch.nn.functional.one_hot(order, experts)                            # [G, k*per, E]
    place = (onehot.cumsum(1) * onehot).sum(-1) - 1                                   # [G, k*per]
    position = place.reshape(groups, k, per).transpose(1, 2).reshape(tokens, k)
    return Routing(expert, gate, position < cap, position, cap)


def balance_terms(probs: torch.Tensor, expert: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(first-choice counts per expert [E], summed probabilities per expert [E]) of these
    tokens: the pieces of f and P, summed (not averaged) so ranks can add them up."""
    counts = torch.bincount(expert[:, 0], minlength=experts).to(probs.dtype)
    return counts, probs.sum(0)


def balance_loss(first_counts: torch.Tensor, prob_sums: torch.Tensor, tokens, alpha: float) -> torch.Tensor:
    """alpha x E x sum_i f_i P_i (Switch, eq. 4), with f_i = first_counts_i / tokens (the
    fraction of tokens whose first choice is expert i) and P_i = prob_sums_i / tokens (the
    mean gate probability of expert i); E = len(first_counts).  Its minimum, alpha, is
    uniform routing.  `prob_sums` may be one rank's part of the global sums: the result is
    then that rank's share of the global loss (linear in prob_sums), and the shares add up."""
    experts = len(first_counts)
    f = (first_counts.double() / tokens).to(prob_sums.dtype)
    return alpha * experts * (f * prob_sums).sum() / torch.as_tensor(tokens, dtype=prob_sums.dtype)
