"""Who owns which slice of the parameters: the one ownership map of every sharded strategy.

The trainable parameters are laid end to end in one flat vector (psrt.dp.common.flatten's
order) and cut into *units*, contiguous ranges of it.  Each unit is split over the owners as
evenly as possible (sizes differ by at most one element, larger parts first), so every
owner holds about 1/N of every unit and a unit is reduce-scattered or all-gathered with
exactly these counts.

    ps-sharded   one unit, S owners: the dedicated or co-located servers (ps-lite's key
                 ranges, Li et al. OSDI 2014 sec. 4.3)
    zero1        one unit, N owners: each worker updates 1/N of the parameters
    zero2        one unit per gradient bucket: a bucket is reduce-scattered as soon as it is
                 ready, so the whole gradient is never held
    zero3        one unit per wrapped module (a transformer block, ...): gathered just
                 before it runs, freed after

ZeRO is the parameter server whose servers are the workers themselves (Rajbhandari et al.,
SC 2020): the same map, with the push a reduce-scatter and the pull an all-gather.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from psrt.collectives.layout import even_counts, offsets


@dataclass(frozen=True)
class Unit:
    """Elements [lo, hi) of the flat vector, owned in `counts[r]`-element parts."""
    lo: int
    hi: int
    counts: tuple[int, ...]

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    def part(self, owner: int) -> tuple[int, int]:
        """[lo, hi) in the flat vector of `owner`'s part of this unit."""
        off = offsets(list(self.counts))
        return self.lo + off[owner], self.lo + off[owner + 1]


class ShardMap:
    """Units of the flat vector (given by their sizes, in flat order) split over `owners`."""

    def __init__(self, unit_sizes: list[int], owners: int):
        if owners < 1:
            raise ValueError(f"a shard map needs at least one owner, not {owners}")
        self.owners = owners
        off = offsets(list(unit_sizes))
        self.units = [Unit(lo, hi, tuple(even_counts(hi - lo, owners))) for lo, hi in zip(off, off[1:])]
        self.numel = off[-1]

    def shard_numel(self, owner: int) -> int:
        """Elements `owner` holds over all units."""
        return sum(u.counts[owner] for u in self.units)

    def shard_offsets(self, owner: int) -> list[int]:
        """Where each unit's part starts in `owner`'s concatenated shard (plus the end)."""
        return offsets([u.counts[owner] for u in self.units])

    def owned(self, owner: int) -> list[tuple[int, int]]:
        """[lo, hi) ranges of the flat vector `owner` holds, one per unit, in unit order."""
        return [u.part(owner) for u in self.units]

    def ranges(self) -> list[tuple[int, int]]:
        """Each owner's range of a one-unit map (ps-sharded's key ranges)."""
        if len(self.units) != 1:
            raise ValueError("ranges() describes a map of one unit")
        return [self.units[0].part(o) for o in range(self.owners)]


def assemble(smap: ShardMap, parts: list[list]) -> torch.Tensor:
    """The whole flat vector from every owner's parts (parts[owner][unit], 1-D tensors)."""
    first = next(t for owner in parts for t in owner)
    flat = torch.zeros(smap.numel, dtype=first.dtype)
    for owner, mine in enumerate(parts):
        for (lo, hi), t in zip(smap.owned(owner), mine):
            flat[lo:hi] = t.reshape(-1)
    return flat


def reshard_optimizer(states: list[dict], old: ShardMap, new: ShardMap, owner: int) -> dict:
    """`owner`'s optimizer state_dict under map `new`, from every old owner's state_dict under
    `old` (one optimizer parameter per unit part, as zero1/2/3 build them).  A state tensor
    with one value per element is reassembled and cut again; a scalar (Adam's step count)
    is the same in every part and is copied.  A loss-scaled optimizer's state (psrt.dp.precision)
    carries the scaler beside it, which is the same on every rank."""
    if "scaler" in states[0]:
        return {"optimizer": reshard_optimizer([s["optimizer"] for s in states], old, new, owner),
                "scaler": states[0]["scaler"]}
    per_unit = [[s["state"].get(j, s["state"].get(str(j), {})) for j in range(len(old.units))] for s in states]
    keys = {k for owner in per_unit for st in owner for k, v in st.items() if torch.is_tensor(v) and v.dim()}
    scalars = next((st for owner in per_unit for st in owner if st), {})
    full = {k: assemble(old, [[st[k] for st in owner] for owner in per_unit]) for k in keys}
    state = {}
    if scalars:
        for i, (lo, hi) in enumerate(new.owned(owner)):
            entry = {k: v.clone() for k, v in scalars.items() if k not in keys}
            entry.update((k, full[k][lo:hi].clone()) for k in keys)
            state[i] = entry
    groups = [dict(g, params=list(range(len(new.units)))) for g in states[0]["param_groups"]]
    return {"state": state, "param_groups": groups}
