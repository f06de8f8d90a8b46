"""`python -m psrt.bench`: measure psrt's collectives against the MPI library and torch.

    mpirun -np 4 python -m psrt.bench collectives --max-size 64MiB --json out/coll.json
    python -m psrt.bench tune --np 2,4,8          # re-measure the table behind 'auto'
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from psrt.errors import ArgumentParser, PsrtError, cli_main

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")


def _sizes(args) -> list[int]:
    from psrt.bench.collectives import parse_size, size_sweep
    try:
        if args.sizes:
            return [parse_size(s) for s in args.sizes.split(",")]
        lo, hi = parse_size(args.min_size), parse_size(args.max_size)
    except ValueError as err:
        raise PsrtError(f"--sizes/--min-size/--max-size: {err}", everywhere=True) from err
    if lo < 1 or hi < lo:
        raise PsrtError(f"--min-size {args.min_size} / --max-size {args.max_size}: need 1 <= min <= max",
                        everywhere=True)
    return size_sweep(lo, hi, args.step)


def run_collectives(args) -> int:
    import torch

    import psrt
    from psrt.bench import collectives as cb
    from psrt.bench import report
    from psrt.report import Progress

    world = psrt.init()
    sizes = _sizes(args)
    dtype = getattr(torch, args.dtype)
    torch_ready = False
    wanted = args.algorithms.split(",") if args.algorithms else None
    if wanted is None or "torch" in wanted:
        psrt.init_torch_distributed(world)
        torch_ready = True
    comm = psrt.Communicator(world)
    if wanted and cb.HOROVOD in wanted:
        from psrt.dp.horovod import init_horovod
        init_horovod(comm)
    bad = [c for c in args.collective.split(",") if c not in COLLECTIVES]
    if bad:
        raise PsrtError(f"--collective {','.join(bad)}: choose from {', '.join(COLLECTIVES)}", everywhere=True)
    plan = [(c, s) for c in args.collective.split(",") for s in sizes]
    progress = Progress(len(plan), f"bench np={world.size}", enabled=world.rank == 0 and not args.quiet)
    points = []
    for i, (coll, size) in enumerate(plan, 1):
        points += cb.measure(comm, coll, cb.algorithms_for(coll, wanted, torch_ready), size, dtype,
                             warmup=args.warmup, repeats=args.repeats)
        progress.update(i, f"{coll} {report.fmt_bytes(size)}")
    # one table block per algorithm reads best: sort by collective, algorithm order, size
    order = {a: i for i, a in enumerate(dict.fromkeys(p.algorithm for p in points))}
    rows = [p.row() for p in sorted(points, key=lambda p: (p.collective, order[p.algorithm], p.nbytes))]
    if world.rank != 0:
        comm.close()
        return 0
    native = {(r["collective"], r["nbytes"]): r["time_us"] for r in rows if r["algorithm"] == "native"}
    for r in rows:
        base = native.get((r["collective"], r["nbytes"]))
        r["vs_native"] = base / r["time_us"] if base else None   # >1: faster than the MPI library
        r["size"] = report.fmt_bytes(r["nbytes"])
    wrong = sum(r["wrong"] for r in rows)
    if not args.quiet:
        print(f"# psrt collectives: N={world.size} ranks on {world.num_nodes} host(s), dtype {args.dtype}; "
              f"time = median of {args.repeats} loops, slowest rank; vs_native = native time / time")
        for coll in dict.fromkeys(r["collective"] for r in rows):
            print(f"\n## {coll}")
            report.table([r for r in rows if r["collective"] == coll], [
                ("size", "size", ""), ("algorithm", "algorithm", ""), ("time_us", "time(us)", ".1f"),
                ("time_min_us", "fastest rank(us)", ".1f"), ("algbw_gbs", "algbw(GB/s)", ".3f"),
                ("busbw_gbs", "busbw(GB/s)", ".3f"), ("wrong", "#wrong", "d"), ("vs_native", "x native", ".2f")])
        print(f"\n# {wrong} wrong elements in all")
    meta = {"world_size": world.size, "num_nodes": world.num_nodes, "dtype": args.dtype,
            "mpi": _mpi_version(), "host": world.hostname}
    if args.json:
        report.write_json(args.json, {"meta": meta, "rows": rows})
    if args.csv:
        report.write_csv(args.csv, rows)
    if args.plot:
        report.plot_busbw([r for r in rows if r["collective"] == args.collective.split(",")[0]], args.plot,
                          f"{args.collective.split(',')[0]}, N={world.size}, {args.dtype}")
    comm.close()
    return 1 if wrong else 0


def _mpi_version() -> str:
    from mpi4py import MPI
    return MPI.Get_library_version().splitlines()[0].strip()


def run_tune(args) -> int:
    """Measure every algorithm at each world size and write the crossover table for 'auto'."""
    from psrt.collectives.tuning import Tuning
    from psrt.launcher import local_mpirun_prefix

    # Collectives and world sizes not measured now keep their rows from the existing table.
    tables: dict = Tuning.load(args.out).tables if os.path.exists(args.out) else {}
    points: list = []
    for np_ in [int(x) for x in args.np.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "points.json")
            cmd = local_mpirun_prefix(np_) + [sys.executable, "-m", "psrt.bench", "collectives", "--quiet",
                                              "--collective", args.collective, "--min-size", args.min_size,
                                              "--max-size", args.max_size, "--step", str(args.step),
                                              "--repeats", str(args.repeats), "--json", out,
                                              "--algorithms", ",".join(_tunable())]
            print(f"tune: measuring N={np_} ...", file=sys.stderr, flush=True)
            # one thread per rank, as mpi_launch sets it: torch's intra-op threads would fight
            # the other ranks for the cores and skew the comparison
            env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
            subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL, env=env)
            rows = json.load(open(out))["rows"]
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
    from psrt.collectives import ALL_ALGORITHMS
    return [a for a in ALL_ALGORITHMS if a not in ("auto", "torch")]


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


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python -m psrt.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collectives", help="time, algbw, busbw per algorithm and size (run under mpirun)")
    c.add_argument("--collective", default="allreduce", help=f"comma list of {', '.join(COLLECTIVES)}")
    c.add_argument("--algorithms", default=None,
                   help="comma list (default: all for the collective, plus auto); 'mpi4py' adds the "
                        "MPI library called directly, without psrt's API; 'horovod' adds "
                        "horovod's allreduce (scripts/install_horovod.sh)")
    c.add_argument("--sizes", default=None, help="explicit comma list, e.g. 4,64K,16MiB")
    c.add_argument("--min-size", default="4")
    c.add_argument("--max-size", default="64MiB")
    c.add_argument("--step", type=int, default=4, help="size multiplier between points (default 4)")
    c.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16", "bfloat16"])
    c.add_argument("--warmup", type=int, default=3)
    c.add_argument("--repeats", type=int, default=5)
    c.add_argument("--json", help="write points as JSON")
    c.add_argument("--csv", help="write points as CSV")
    c.add_argument("--plot", help="write a busbw-vs-size PNG")
    c.add_argument("--quiet", action="store_true")
    t = sub.add_parser("tune", help="measure crossovers and write the table behind algorithm='auto'")
    t.add_argument("--np", default="2,4,8", help="world sizes to measure (comma list)")
    t.add_argument("--collective", default=",".join(COLLECTIVES))
    t.add_argument("--min-size", default="4")
    t.add_argument("--max-size", default="64MiB")
    t.add_argument("--step", type=int, default=4)
    t.add_argument("--repeats", type=int, default=5)
    t.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "collectives", "tuning.json"))
    return ap


def check_args(args) -> None:
    """Refuse values that would crash or never end, in one line each."""
    def need(ok: bool, text: str):
        if not ok:
            raise PsrtError(text, everywhere=True)
    need(args.repeats >= 1, f"--repeats {args.repeats}: must be at least 1")
    need(args.step >= 2, f"--step {args.step}: the size multiplier must be at least 2")
    if args.command == "collectives":
        need(args.warmup >= 0, f"--warmup {args.warmup}: must not be negative")
        if args.algorithms:
            from psrt.bench.collectives import PEERS
            from psrt.collectives import ALL_ALGORITHMS
            bad = [a for a in args.algorithms.split(",") if a not in ALL_ALGORITHMS + PEERS]
            need(not bad, f"--algorithms {args.algorithms}: unknown {', '.join(bad)} "
                          f"(choose from {', '.join(ALL_ALGORITHMS + PEERS)})")
    else:
        parts = args.np.split(",")
        need(all(p.strip().isdigit() and int(p) >= 1 for p in parts),
             f"--np {args.np}: expected world sizes of at least 1, e.g. 2,4,8")


@cli_main("psrt.bench")
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    if args.command == "collectives":
        return run_collectives(args)
    return run_tune(args)


if __name__ == "__main__":
    sys.exit(main())
