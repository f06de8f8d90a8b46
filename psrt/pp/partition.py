"""Split a model, given as a sequence of blocks, into contiguous pipeline stages.

Balanced by parameter count (a proxy for compute and memory, as in GPipe's and torchgpipe's
balance-by-size; exact when blocks are alike) or by explicit split points.  Stage s is placed
on pipeline rank s % p (see schedule.py), so with v virtual stages per rank a model of
p*v stages is cut into p*v pieces.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from psrt.errors import PsrtError


def param_counts(blocks: Sequence[nn.Module]) -> list[int]:
    return [sum(p.numel() for p in b.parameters()) for b in blocks]


def balanced_splits(costs: Sequence[int], num_stages: int) -> list[int]:
    """Split points (index of each stage's first block, stages 1..S-1) that minimise the
    largest stage cost, each stage holding at least one block (exact, by dynamic programming
    over prefixes; ties go to the earliest split so the result is deterministic)."""
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise PsrtError(f"cannot split {n} blocks into {num_stages} pipeline stages "
                        f"(every stage needs at least one block)")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][j]: smallest max-cost splitting blocks[:j] into s stages; cut[s][j]: last split.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for j in range(s, n - (num_stages - s) + 1):
            for i in range(s - 1, j):
                cost = max(best[s - 1][i], prefix[j] - prefix[i])
                if cost < best[s][j]:
                    best[s][j], cut[s][j] = cost, i
    splits, j = [], n
    for s in range(num_stages, 1, -1):
        j = cut[s][j]
        splits.append(j)
    return sorted(splits)


def check_splits(splits: Sequence[int], num_blocks: int, num_stages: int) -> list[int]:
    splits = list(splits)
    if len(splits) != num_stages - 1 or splits != sorted(set(splits)) or \
            (splits and not (0 < splits[0] and splits[-1] < num_blocks)):
        raise PsrtError(f"split points {splits} do not cut {num_blocks} blocks into "
                        f"{num_stages} non-empty stages (give {num_stages - 1} increasing "
                        f"indices between 1 and {num_blocks - 1})")
    return splits


def stage_ranges(num_blocks: int, num_stages: int, splits: Sequence[int] | None = None,
                 costs: Sequence[int] | None = None) -> list[range]:
    """Block index range of each stage (explicit `splits`, else balanced by `costs`)."""
    if splits is None:
        splits = balanced_splits(costs if costs is not None else [1] * num_blocks, num_stages)
    splits = check_splits(splits, num_blocks, num_stages)
    bounds = [0] + splits + [num_blocks]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def build_stages(blocks: Sequence[nn.Module], num_stages: int, stage_ids: Sequence[int],
                 splits: Sequence[int] | None = None) -> dict[int, nn.Sequential]:
    """The stages this rank runs: stage id -> nn.Sequential of its blocks (the same block
    objects, so parameters are shared with `blocks`).  Balanced by parameter count unless
    `splits` is given."""
    ranges = stage_ranges(len(blocks), num_stages, splits, param_counts(blocks))
    return {s: nn.Sequential(*(blocks[i] for i in ranges[s])) for s in stage_ids}


def describe(blocks: Sequence[nn.Module], num_stages: int, splits=None) -> str:
    """One line per stage: blocks and parameter count."""
    costs = param_counts(blocks)
    ranges = stage_ranges(len(blocks), num_stages, splits, costs)
    return "\n".join(f"stage {s}: blocks {r.start}..{r.stop - 1}, "
                     f"{sum(costs[i] for i in r):,} parameters" for s, r in enumerate(ranges))


def split_batch(inputs: torch.Tensor, targets: torch.Tensor, num_microbatches: int):
    """(inputs, targets, weights) per micro-batch along dim 0, sizes as even as possible.

    Weights are each micro-batch's share of the target elements, so the weighted sum of
    per-micro-batch mean losses is the mean loss of the whole batch, even when sizes differ.
    """
    rows = inputs.shape[0]
    if not 1 <= num_microbatches <= rows:
        raise PsrtError(f"cannot split a batch of {rows} samples into {num_microbatches} "
                        f"micro-batches (need 1..{rows})")
    xs = list(torch.tensor_split(inputs, num_microbatches))
    ys = list(torch.tensor_split(targets, num_microbatches))
    total = targets.numel()
    return xs, ys, [y.numel() / total for y in ys]
