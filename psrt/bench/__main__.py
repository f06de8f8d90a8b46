"""`python -m psrt.bench`: parameter server vs ring, against every peer, with the model.

    python -m psrt.bench suite --out out/bench    # all of it: report.md, JSON, CSV, PNG
    python -m psrt.bench suite --quick            # a small version, under a minute
    mpirun -np 4 python -m psrt.bench collectives --max-size 64MiB --json out/coll.json
    mpirun -np 4 python -m psrt.bench training    # step time of every --dp strategy
    mpirun -np 2 python -m psrt.bench pingpong    # one-way time and the alpha-beta fit
    python -m psrt.bench network                  # shaped emulated hosts (root)
    python -m psrt.bench tune --np 2,4,8          # re-measure the table behind 'auto'
"""
from __future__ import annotations

import argparse
import json
import os
import sys

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
    from psrt.train.report import Progress

    world = psrt.init()
    sizes = _sizes(args)
    dtype = getattr(torch, args.dtype)
    torch_ready = False
    wanted = args.algorithms.split(",") if args.algorithms else None
    if wanted is None or "torch" in wanted:
        psrt.init_torch_distributed(world)
        torch_ready = True
    comm = psrt.Communicator(world)
    bad = [c for c in args.collective.split(",") if c not in COLLECTIVES]
    if bad:
        raise PsrtError(f"--collective {','.join(bad)}: choose from {', '.join(COLLECTIVES)}", everywhere=True)
    # Horovod's background thread runs an MPI negotiation every cycle, even when idle, which
    # slows every other algorithm measured beside it: Horovod is timed in a phase of its own,
    # after the others, and shut down.
    phases = [None] if wanted is None else \
        [p for p in ([a for a in wanted if a != cb.HOROVOD], [a for a in wanted if a == cb.HOROVOD]) if p]
    plan = [(algos, c, s) for algos in phases for c in args.collective.split(",") for s in sizes
            if cb.algorithms_for(c, algos, torch_ready)]
    progress = Progress(len(plan), f"bench np={world.size}", enabled=world.rank == 0 and not args.quiet)
    points, hvd = [], None
    for i, (algos, coll, size) in enumerate(plan, 1):
        if algos == [cb.HOROVOD] and hvd is None:
            from psrt.dp.horovod import init_horovod
            hvd = init_horovod(comm)
        points += cb.measure(comm, coll, cb.algorithms_for(coll, algos, torch_ready), size, dtype,
                             warmup=args.warmup, repeats=args.repeats)
        progress.update(i, f"{coll} {report.fmt_bytes(size)}")
    if hvd is not None:
        hvd.shutdown()
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


def run_pingpong(args) -> int:
    """Ping-pong between the first and the last rank; prints and writes T(m) and the fit."""
    import psrt
    from psrt.bench import pingpong, report
    from psrt.collectives import cost as alpha_beta

    world = psrt.init()
    if world.size < 2:
        raise PsrtError("pingpong needs at least 2 ranks (mpirun -np 2 ...)", everywhere=True)
    points = pingpong.pingpong(world.comm, _sizes(args), repeats=args.repeats)
    if world.rank != 0:
        return 0
    try:
        model = alpha_beta.fit(points)
    except ValueError:
        model = None
    if not args.quiet:
        print(f"# ping-pong, rank 0 ({world.hostname}) <-> rank {world.size - 1}: one-way time, median")
        report.table([dict(p, size=report.fmt_bytes(p["nbytes"]), us=p["one_way_s"] * 1e6,
                           mbs=p["nbytes"] / p["one_way_s"] / 1e6) for p in points],
                     [("size", "size", ""), ("us", "one-way(us)", ".1f"), ("mbs", "MB/s", ".1f")])
        if model:
            print(f"# alpha = {model.alpha_s * 1e6:.1f} us, beta = {model.beta_s_per_byte * 1e9:.3f} ns/B "
                  f"({model.bandwidth_bytes_s / 1e6:.1f} MB/s), r2 = {model.r2:.4f}")
    if args.json:
        report.write_json(args.json, {"meta": {"world_size": world.size, "host": world.hostname,
                                               "mpi": _mpi_version()},
                                      "points": points, "fit": model and vars(model)})
    return 0


def run_training(args) -> int:
    """Step time of every strategy on one model, in one job (run under mpirun)."""
    import psrt
    from psrt.bench import report, training
    from psrt.train.report import Progress

    world = psrt.init()
    asked = args.dp.split(",") if args.dp else list(training.DEFAULT_STRATEGIES)
    names = training.available(asked)
    if world.rank == 0 and len(names) < len(asked) and not args.quiet:
        print("psrt.bench: horovod is not installed, left out (scripts/install_horovod.sh)", file=sys.stderr)
    progress = Progress(len(names) * (args.rounds + 1), f"training np={world.size}",
                        enabled=world.rank == 0 and not args.quiet)
    rows = training.measure(world, names, args.model, args.width, args.layers, args.batch,
                            args.steps, args.rounds, bucket_mb=args.bucket_mb, progress=progress)
    if world.rank != 0:
        return 0
    if not args.quiet:
        print(f"# {args.model} ({rows[0]['params'] / 1e6:.2f} M parameters), {args.batch} samples per "
              f"rank, N={world.size} on {world.num_nodes} host(s); step = median of {args.rounds} rounds "
              f"of {args.steps} steps, slowest rank")
        report.table(rows, training.COLUMNS)
    if args.json:
        report.write_json(args.json, {"meta": {"world_size": world.size, "num_nodes": world.num_nodes,
                                               "model": args.model, "width": args.width, "layers": args.layers,
                                               "batch_per_rank": args.batch, "mpi": _mpi_version()},
                                      "rows": rows})
    return 0


def run_network(args) -> int:
    """PS vs ring on emulated hosts with shaped links, measured and predicted (root)."""
    from psrt.bench import network, report
    if args.quick:
        network.quicken(args)
    payload = network.run(args)
    payload["goals"] = network.goals(payload)
    network.print_report(payload)
    print_goals(payload["goals"])
    if args.json:
        report.write_json(args.json, payload)
    if args.csv:
        report.write_csv(args.csv, payload["rows"])
    if args.plot:
        network.plot(payload, args.plot)
    return 1 if any(r["wrong"] for r in payload["rows"]) else 0


def print_goals(goals: list[dict]) -> None:
    for g in goals:
        print(f"goal {status(g)}  {g['goal']}: {g['value']}")
    sys.stdout.flush()


def status(goal: dict) -> str:
    return {True: "met", False: "MISSED", None: "n/a"}[goal["ok"]]


def parse_size_arg(text: str) -> int:
    from psrt.bench.collectives import parse_size
    try:
        return parse_size(text)
    except ValueError as err:
        raise PsrtError(str(err)) from None


def _mpi_version() -> str:
    from mpi4py import MPI
    return MPI.Get_library_version().splitlines()[0].strip()


def run_tune(args) -> int:
    """Measure every algorithm at each world size and write the crossover table for 'auto'."""
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
    pp = sub.add_parser("pingpong", help="one-way time between the first and last rank, and the "
                        "alpha-beta fit (run under mpirun, one rank per host)")
    pp.add_argument("--sizes", default=None, help="explicit comma list, e.g. 8,1MiB,16MiB")
    pp.add_argument("--min-size", default="8")
    pp.add_argument("--max-size", default="16MiB")
    pp.add_argument("--step", type=int, default=4)
    pp.add_argument("--repeats", type=int, default=5)
    pp.add_argument("--json", help="write points and fit as JSON")
    pp.add_argument("--quiet", action="store_true")
    nw = sub.add_parser("network", help="ps vs ring on emulated hosts with shaped links, against the "
                        "alpha-beta model (root; runs its own MPI jobs)")
    nw.add_argument("--rates", default="1gbit,100mbit", help="link rates, tc syntax (comma list)")
    nw.add_argument("--hosts", dest="hosts_text", default="2,4,8",
                    help="host counts of one rank each (comma list, 2..64)")
    nw.add_argument("--size", default="64MiB", help="all-reduce size at the fastest rate; slower "
                    "rates get proportionally less, at least 1 MiB")
    nw.add_argument("--no-two-nodes", dest="two_nodes", action="store_false",
                    help="skip the 2 hosts x 4 ranks layout of hostfiles/two_nodes")
    nw.add_argument("--no-floor", dest="floor", action="store_false",
                    help="skip the unshaped runs that tell network-bound rows from CPU-bound ones")
    nw.add_argument("--warmup", type=int, default=1)
    nw.add_argument("--repeats", type=int, default=3)
    nw.add_argument("--quick", action="store_true", help="1gbit, 2 and 8 hosts, 16 MiB, one repeat")
    nw.add_argument("--json")
    nw.add_argument("--csv")
    nw.add_argument("--plot", help="PNG: time vs hosts, measured and predicted")
    nw.add_argument("--quiet", action="store_true", help="no progress display")
    tr = sub.add_parser("training", help="step time and samples/s of every --dp strategy on one model "
                        "(run under mpirun)")
    tr.add_argument("--dp", default=None, help="strategies (default: ps,ps-sharded,ring,native,torch,"
                    "torch-ddp,horovod); torch-ddp is torch.nn.parallel.DistributedDataParallel")
    tr.add_argument("--model", default="mlp", choices=["mlp", "cnn", "transformer"])
    tr.add_argument("--width", type=int, default=1024)
    tr.add_argument("--layers", type=int, default=2)
    tr.add_argument("--batch", type=int, default=32, help="samples per rank per step (weak scaling)")
    tr.add_argument("--steps", type=int, default=5, help="steps per timed round")
    tr.add_argument("--bucket-mb", type=float, default=None,
                    help="gradient bucket size of psrt's DDP strategies (default: theirs)")
    tr.add_argument("--rounds", type=int, default=3)
    tr.add_argument("--json")
    tr.add_argument("--quiet", action="store_true")
    su = sub.add_parser("suite", help="collectives, training and the network-bound regime in one run, "
                        "with a Markdown report, JSON, CSV and plots (runs its own MPI jobs)")
    su.add_argument("--out", default="out/bench", help="folder for report.md and the files")
    su.add_argument("--np", default="2,4", help="world sizes on this host (comma list)")
    su.add_argument("--parts", default=",".join(("collectives", "training", "network")),
                    help="comma list of collectives, training, network")
    su.add_argument("--quick", action="store_true", help="a small version of every part, under a minute")
    su.add_argument("--quiet", action="store_true", help="no progress display")
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
    need(getattr(args, "repeats", 1) >= 1, f"--repeats {getattr(args, 'repeats', 1)}: must be at least 1")
    need(getattr(args, "step", 2) >= 2, f"--step {getattr(args, 'step', 2)}: the size multiplier must be at least 2")
    if args.command in ("collectives", "network"):
        need(args.warmup >= 0, f"--warmup {args.warmup}: must not be negative")
    if args.command == "collectives" and args.algorithms:
        from psrt.bench.collectives import PEERS
        from psrt.collectives import ALL_ALGORITHMS
        bad = [a for a in args.algorithms.split(",") if a not in ALL_ALGORITHMS + PEERS]
        need(not bad, f"--algorithms {args.algorithms}: unknown {', '.join(bad)} "
                      f"(choose from {', '.join(ALL_ALGORITHMS + PEERS)})")
    elif args.command == "training":
        from psrt.bench.training import PEER
        from psrt.dp import STRATEGIES
        bad = [d for d in (args.dp or "").split(",") if d and d not in tuple(STRATEGIES) + (PEER,)]
        need(not bad, f"--dp {','.join(bad)}: choose from {', '.join(tuple(STRATEGIES) + (PEER,))}")
        for name in ("width", "layers", "batch", "steps", "rounds"):
            need(getattr(args, name) >= 1, f"--{name} {getattr(args, name)}: must be at least 1")
    elif args.command == "network":
        from psrt.launch.cluster import _RATE
        args.rates = [r.strip() for r in args.rates.split(",")]
        bad = [r for r in args.rates if not _RATE.match(r)]
        need(not bad, f"--rates {','.join(bad)}: expected tc rates such as 1gbit,100mbit")
        parts = args.hosts_text.split(",")
        need(all(p.strip().isdigit() and 2 <= int(p) <= 64 for p in parts),
             f"--hosts {args.hosts_text}: expected host counts from 2 to 64, e.g. 2,4,8")
        args.host_counts = sorted({int(p) for p in parts})
        args.size = parse_size_arg(args.size)
        need(args.size >= 1 << 20, f"--size {args.size} B: the network regime needs at least 1 MiB")
    elif args.command == "suite":
        from psrt.bench.suite import PARTS
        parts = args.np.split(",")
        need(all(p.strip().isdigit() and 2 <= int(p) <= 64 for p in parts),
             f"--np {args.np}: expected world sizes from 2 to 64, e.g. 2,4")
        args.np = sorted({int(p) for p in parts})
        args.parts = [p.strip() for p in args.parts.split(",")]
        bad = [p for p in args.parts if p not in PARTS]
        need(not bad, f"--parts {','.join(bad)}: choose from {', '.join(PARTS)}")
    elif args.command == "tune":
        parts = args.np.split(",")
        need(all(p.strip().isdigit() and int(p) >= 1 for p in parts),
             f"--np {args.np}: expected world sizes of at least 1, e.g. 2,4,8")


@cli_main("psrt.bench")
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    if args.command == "collectives":
        return run_collectives(args)
    if args.command == "pingpong":
        return run_pingpong(args)
    if args.command == "network":
        return run_network(args)
    if args.command == "training":
        return run_training(args)
    if args.command == "suite":
        from psrt.bench import suite
        return suite.run(args)
    return run_tune(args)


if __name__ == "__main__":
    sys.exit(main())
