"""`python -m psrt.bench tune`: measure every algorithm at each world size and write the
crossover table behind algorithm='auto' (psrt/collectives/tuning.py)."""
from __future__ import annotations

import json
import os
import sys

from psrt.bench.collectives import COLLECTIVES

HELP = "measure crossovers and write the table behind algorithm='auto'"


def add_arguments(t) -> None:
    t.add_argument("--np", default="2,4,8", help="world sizes to measure (comma list)")
    t.add_argument("--collective", default=",".join(COLLECTIVES))
    t.add_argument("--min-size", default="4")
    t.add_argument("--max-size", default="64MiB")
    t.add_argument("--step", type=int, default=4)
    t.add_argument("--repeats", type=int, default=5)
    t.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "collectives", "tuning.json"))


def check(args) -> None:
    from psrt.bench.report import need
    need(args.repeats >= 1, f"--repeats {args.repeats}: must be at least 1")
    need(args.step >= 2, f"--step {args.step}: the size multiplier must be at least 2")
    parts = args.np.split(",")
    need(all(p.strip().isdigit() and int(p) >= 1 for p in parts),
         f"--np {args.np}: expected world sizes of at least 1, e.g. 2,4,8")


def command(args) -> int:
    """Measure every algorithm at each world size and write the crossover table for 'auto'."""
    check(args)
    from psrt.bench import jobs
    from psrt.collectives.tuning import Tuning

    # Collectives and world sizes not measured now keep their rows from the existing table.
    tables: dict = Tuning.load(args.out).tables if os.path.exists(args.out) else {}
    points: list = []
    for np_ in [int(x) for x in args.np.split(",")]:
        print(f"tune: measuring N={np_} ...", file=sys.stderr, flush=True)
        rows = jobs.local(np_, ["collectives", "--quiet", "--collective", args.collective,
                                "--min-size", args.min_size, "--max-size", args.max_size,
                                "--step", str(args.step), "--repeats", str(args.repeats),
                                "--algorithms", ",".join(_tunable())])["rows"]
        points += rows
        for coll in args.collective.split(","):
            tables.setdefault(coll, {})[np_] = crossovers([r for r in rows if r["collective"] == coll])
    tuning = Tuning(tables=tables, source=f"python -m psrt.bench tune --np {args.np}")
    tuning.save(args.out)
    with open(os.path.splitext(args.out)[0] + ".points.json", "a") as f:   # raw evidence
        for row in points:
            f.write(json.dumps(row) + "\n")
    for coll, per_n in tables.items():
        for n, rows in per_n.items():
            print(f"{coll:15s} N={n}: " + ", ".join(f"<= {lim} B: {algo}" for lim, algo in rows))
    print(f"wrote {args.out}")
    return 0


def _tunable() -> list[str]:
    from psrt.collectives import ALGORITHMS
    from psrt.collectives.algorithms import THROUGH_TORCH
    tuned = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")   # the table behind 'auto'
    return list(dict.fromkeys(a for c in tuned for a in ALGORITHMS[c] if a not in THROUGH_TORCH))


def crossovers(rows: list[dict], tie: float = 0.15) -> list[tuple[int, str]]:
    """[(max_bytes, algorithm)] from measured points: the fastest per size, where an algorithm
    within `tie` of the fastest keeps the previous winner (so noise does not flip the table)."""
    table: list[tuple[int, str]] = []
    for size in sorted({r["nbytes"] for r in rows}):
        at = {r["algorithm"]: r["time_us"] for r in rows if r["nbytes"] == size}
        best = min(at, key=at.get)
        prev = table[-1][1] if table else None
        winner = prev if prev in at and at[prev] <= at[best] * (1 + tie) else best
        if table and table[-1][1] == winner:
            table[-1] = (size, winner)
        else:
            table.append((size, winner))
    if table:
        table[-1] = (1 << 62, table[-1][1])
    return table
