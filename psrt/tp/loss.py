"""Cross-entropy over vocabulary-parallel logits: no rank ever holds the full logits.

Each rank holds logits for its vocabulary slice [start, end).  The loss of a token,
log(sum_j exp(z_j)) - z_target, needs three all-reduces of one number per token: the max
(for a stable exp), the sum of exponentials, and the target's logit (non-zero on exactly
one rank).  The gradient, softmax(z) - onehot(target), is local to each slice.
(Shoeybi et al. 2019, sec. 3: "fuse the output of the parallel GEMM with the cross entropy
loss, which reduces the dimension to b x s"; the function mirrors Megatron-LM's
_VocabParallelCrossEntropy.)
"""
from __future__ import annotations

import torch

from psrt.collectives.layout import shard_range
from psrt.errors import PsrtError
from psrt.tp.comm import _allreduce


class VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab):
        start, end = shard_range(vocab, group.size, group.rank)
        if logits.shape[-1] != end - start:
            raise PsrtError(f"vocab-parallel cross-entropy: rank {group.rank} has "
                            f"{logits.shape[-1]} logits, expected {end - start} of {vocab}")
        logits = logits.float()
        zmax = _allreduce(logits.max(dim=-1).values, group, op="max")
        z = logits - zmax.unsqueeze(-1)
        outside = (target < start) | (target >= end)
        local = (target - start).masked_fill(outside, 0)
        picked = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        picked = _allreduce(picked, group)
        exp = z.exp()
        total = _allreduce(exp.sum(dim=-1), group)
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), local, outside)
        return total.log() - picked

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local.unsqueeze(-1), -(~outside).to(g.dtype).unsqueeze(-1))
        return g * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group,
                                 vocab: int) -> torch.Tensor:
    """Mean cross-entropy over all tokens of vocabulary-parallel `logits` (..., V/t) and
    integer `target` (...), equal to F.cross_entropy on the gathered logits."""
    return VocabParallelCrossEntropy.apply(logits, target, group, vocab).mean()
