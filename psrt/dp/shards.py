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
