"""The table behind algorithm='auto': which algorithm is fastest for a message size and
world size, as measured by `python -m psrt.bench tune` (see docs/explanation/results.md, "Allreduce: auto and psrt's API overhead").

A table lists, per collective and world size, ascending byte limits and the algorithm that
won up to each limit.  For a world size not in the table the nearest measured one is used.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from psrt import env
from psrt.errors import PsrtError

SHIPPED = Path(__file__).with_name("tuning.json")


@dataclass
class Tuning:
    tables: dict = field(default_factory=dict)   # collective -> {world size: [[max_bytes, algo], ...]}
    source: str = "built-in default"

    @classmethod
    def load(cls, path: str | os.PathLike | None = None) -> "Tuning":
        path = path or env.tuning_path() or (SHIPPED if SHIPPED.exists() else None)
        if path is None:
            return cls()
        try:
            data = json.loads(Path(path).read_text())
            tables = {coll: {int(n): [(int(limit), str(algo)) for limit, algo in rows]
                             for n, rows in per_n.items()}
                      for coll, per_n in data["tables"].items()}
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise PsrtError(f"tuning table {path}: cannot read it ({err})") from err
        return cls(tables=tables, source=str(path))

    def choose(self, collective: str, nbytes: int, world_size: int, allowed, hosts: tuple = (),
               host_of=None, crowd: float | None = None) -> str:
        """The table's algorithm for one host.  On several hosts of several ranks (`hosts`:
        the ranks on each; `host_of`: each rank's host, contiguous blocks if not given), the
        fastest by the two-level model (cost.predict_two_level) of: the table's choice (priced
        as the flat ring unless the model covers it), 'hierarchical', and for an all-reduce
        'ps' and 'tree'; a tie keeps the table's.  `crowd`: ranks per core on the most crowded
        machine (default: the busiest host's ranks over this machine's cores); where ranks
        outnumber cores every sequential round waits for a rank to be scheduled, which favours
        the schedules of fewer rounds."""
        flat = self._flat(collective, nbytes, world_size, allowed)
        if len(hosts) < 2 or max(hosts) < 2 or "hierarchical" not in allowed:
            return flat
        from psrt.collectives import cost
        host_of = list(host_of) if host_of else [h for h, n in enumerate(hosts) for _ in range(n)]
        if crowd is None:
            crowd = max(1.0, max(hosts) / (os.cpu_count() or 1))
        links = cost.Links(cost.DEFAULT_LINKS.intra, cost.DEFAULT_LINKS.inter, crowd=crowd)
        rivals = ("hierarchical",) + (("ps", "tree") if collective == "allreduce" else ())
        candidates = [flat] + [a for a in rivals if a in allowed and a != flat]
        return min(candidates, key=lambda a: cost.predict_two_level(a if a in cost.TWO_LEVEL else "ring",
                                                                     host_of, nbytes, links))

    def _flat(self, collective: str, nbytes: int, world_size: int, allowed) -> str:
        per_n = self.tables.get(collective)
        if not per_n:
            return "native"
        n = min(per_n, key=lambda k: (abs(k - world_size), k))
        for limit, algo in per_n[n]:
            if nbytes <= limit and algo in allowed:
                return algo
        return per_n[n][-1][1] if per_n[n][-1][1] in allowed else "native"

    def save(self, path) -> None:
        Path(path).write_text(json.dumps({"source": self.source, "tables": {
            coll: {str(n): [[lim, algo] for lim, algo in rows] for n, rows in per_n.items()}
            for coll, per_n in self.tables.items()}}, indent=1) + "\n")
