"""`python -m psrt.bench moe` (under mpirun): the all-to-all of mixture-of-experts routing, and
what an MoE step costs beside a dense one.

1. All-to-all time per size and EP, psrt's pairwise exchange against the MPI library's
   Alltoallv, beside the alpha-beta prediction of the pairwise exchange
   (psrt.collectives.cost.predict_alltoall: EP-1 steps, each alpha + beta x the bytes of the
   busiest host link; (EP-1)(alpha + beta m/EP) with one rank per host).  alpha and beta
   come from a ping-pong of this run (rank 0 and a rank on another host; on one host, rank 1,
   each rank then standing for a host of its own).  Groups of EP consecutive ranks run at once.
   Each step of the exchange is also timed alone, to see where the time goes against the
   model: in steps that wait on one another, or in each step's EP concurrent flows.
2. Step time of a dense transformer against the MoE transformer with the same active
   parameters per token (top-1 experts of the dense MLP's shape), experts spread over all
   ranks (EP = N), same global batch; the MoE step with both dispatch shapes, variable (the
   counts first, then only the kept rows) and padded (every expert's full capacity), with
   the all-to-all bytes each sends per rank and step.
"""
from __future__ import annotations

import statistics
import time

HELP = "MoE all-to-all (pairwise vs MPI Alltoallv vs alpha-beta), dense vs MoE step, padded vs variable dispatch"
DISPATCH = ("variable", "padded")


def add_arguments(p) -> None:
    p.add_argument("--sizes", default="64KiB,1MiB,8MiB", help="bytes each rank sends in one all-to-all")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="training steps per model (0: no step comparison)")
    p.add_argument("--capacity-factor", type=float, default=1.25,
                   help="expert capacity factor of the MoE steps (padded dispatch sends all of it)")
    p.add_argument("--json", help="write the rows as JSON")
    p.add_argument("--quiet", action="store_true")


def time_alltoall(group, nbytes: int, algorithm: str, repeats: int, calls: int = 4) -> float:
    """Median over repeats of the slowest rank's mean time of `calls` back-to-back alltoallvs
    of nbytes per rank (back to back: a TCP connection left idle restarts slowly)."""
    import torch
    p = group.size
    rows = max(nbytes // 4 // p, 1)
    x, out = torch.ones(rows * p), torch.empty(rows * p)
    counts = [rows] * p
    times = []
    for i in range(repeats + 1):
        group.comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            group.alltoallv(x, counts, counts, out=out, algorithm=algorithm)
        t = max(group.comm.allgather((time.perf_counter() - t0) / calls))
        if i:
            times.append(t)
    return statistics.median(times)


def time_steps(group, nbytes: int, repeats: int, calls: int = 4) -> list[float]:
    """Each step k = 1..EP-1 of the pairwise exchange timed alone (every group at once, as in
    the exchange): median over repeats of the slowest rank's mean of `calls` back-to-back
    steps.  Their sum beside the whole exchange says whether the steps cost more together
    (waiting on one another) or each alone (what one step of EP concurrent flows costs)."""
    import torch
    from psrt.collectives import alltoall
    from psrt.collectives.layout import offsets
    p = group.size
    rows = max(nbytes // 4 // p, 1)
    x, out = torch.ones(rows * p), torch.empty(rows * p)
    off = offsets([rows] * p)
    times = []
    for k in range(1, p):
        runs = []
        for i in range(repeats + 1):
            group.comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                alltoall.step(group.comm, k, x, off, out, off)
            t = max(group.comm.allgather((time.perf_counter() - t0) / calls))
            if i:
                runs.append(t)
        times.append(statistics.median(runs))
    return times


def step_time(world, grid, name: str, steps: int, dispatch: str = "variable",
              capacity_factor: float = 1.25) -> tuple[float, float]:
    """(mean step, mean all-to-all bytes per rank and step) of `name` (dense transformer or
    moe, with this dispatch shape) on the same data, slowest rank."""
    import torch
    from psrt.ep.layer import moe_layers
    from psrt.train.data import load
    from psrt.train.models import build_model, loss_and_correct
    from psrt.train.moe import MoETrainer
    data = load("text", 64)
    torch.manual_seed(0)
    model = build_model(name, data, 64, 2, **({"experts": grid.ep, "top_k": 1, "capacity_factor": capacity_factor,
                                               "dispatch": dispatch} if name == "moe" else {}))
    for layer in moe_layers(model):
        layer.shard(grid.ep_group, grid.dp_group, algorithm="pairwise")
    trainer = MoETrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1), grid, algorithm="ring")
    g = torch.Generator().manual_seed(1 + world.rank)
    batches = [torch.randint(len(data), (8,), generator=g) for _ in range(steps + 1)]
    times, sent = [], []
    for i, idx in enumerate(batches):
        world.comm.Barrier()
        t0 = time.perf_counter()
        stats = trainer.step(lambda mb: loss_and_correct(model, mb, "lm")[0], [(data.train_x[idx], data.train_y[idx])])
        if i:
            times.append(max(world.comm.allgather(time.perf_counter() - t0)))
            sent.append(stats.extra.get("a2a_bytes", 0))
    return statistics.mean(times), statistics.mean(world.comm.allgather(statistics.mean(sent)))


def command(args) -> int:
    import psrt
    from psrt.bench import report
    from psrt.bench.collectives import parse_size
    from psrt.bench.report import need
    from psrt.collectives.cost import Fit, predict_alltoall
    from psrt.grid import Grid, ep_ranks
    from psrt.train import prediction
    from psrt.train.report import fmt_bytes
    need(args.repeats >= 1, f"--repeats {args.repeats}: must be at least 1")
    need(args.capacity_factor > 0, f"--capacity-factor {args.capacity_factor}: must be a positive number")
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
    except ValueError as err:
        need(False, f"--sizes: {err}")
    world = psrt.init()
    need(world.size >= 2, "bench moe needs at least 2 ranks (mpirun -np 2 ...)")
    ctl = world.comm.Dup()
    link = prediction.measure(world, ctl)
    eps = [e for e in (2, 4, 8) if e <= world.size and world.size % e == 0]
    rows = []
    for ep in eps:
        grid = Grid.build(world.comm, ep=ep)
        for m in sizes:
            row = {"ep": ep, "size": fmt_bytes(m), "nbytes": m}
            for algo in ("pairwise", "native"):
                row[algo] = time_alltoall(grid.ep_group, m, algo, args.repeats)
            row["steps_s"] = time_steps(grid.ep_group, m, args.repeats)
            rows.append(row)
        grid.free()
    steps, a2a = {}, {}
    if args.steps:
        grid = Grid.build(world.comm, ep=world.size)
        steps["transformer"], _ = step_time(world, grid, "transformer", args.steps)
        for dispatch in DISPATCH:
            key = "moe" if dispatch == "variable" else f"moe {dispatch}"
            steps[key], a2a[key] = step_time(world, grid, "moe", args.steps, dispatch, args.capacity_factor)
        grid.free()
    ctl.Free()
    if world.rank != 0:
        return 0
    cols = [("ep", "EP", "d"), ("size", "size", ""), ("pairwise", "pairwise (ms)", ".3f", 1e3),
            ("native", "MPI Alltoallv (ms)", ".3f", 1e3)]
    for r in rows:
        r["pairwise_vs_native"] = r["native"] / r["pairwise"]
        if link is not None:
            n, ep = world.size, r["ep"]
            groups = [ep_ranks(first, n, 1, 1, ep) for first in range(0, n, ep)]
            fit = Fit(link["alpha_s"], link["beta_s_per_byte"], 1.0)
            r["predicted"] = predict_alltoall(groups, r["nbytes"], link["host_of"], fit)
            if r["predicted"] is not None:       # None: every group inside one host
                r["error"] = r["pairwise"] / r["predicted"] - 1
    if link is not None:
        cols += [("predicted", "predicted (ms)", ".3f", 1e3), ("error", "error", "+.0%")]
    if not args.quiet:
        if link is None:
            print(f"# MoE all-to-all, N={world.size}; no prediction (see above); size = bytes each rank sends")
        else:
            one_per_host = link["hosts"] == world.size
            where = "one rank per host" if one_per_host else f"{link['hosts']} host(s)"
            print(f"# MoE all-to-all, N={world.size} ({where}); ping-pong {link['between']}: alpha "
                  f"{link['alpha_s'] * 1e6:.1f} us, {1 / link['beta_s_per_byte'] / 1e6:.0f} MB/s; size = bytes "
                  "each rank sends; predicted = pairwise exchange, EP-1 steps of alpha + beta x the busiest "
                  "link's bytes"
                  + ("" if one_per_host else " (ranks share hosts: the link model is a rough guide)"))
        report.table(rows, cols + [("pairwise_vs_native", "x native", ".2f")])
        print("# the pairwise exchange's steps timed one at a time (ms), beside their sum and the whole exchange"
              + ("" if link is None else "; one step alone by the ping-pong fit: alpha + beta x size/EP"))
        for r in rows:
            alone = "" if link is None else \
                f"; ping-pong fit {(link['alpha_s'] + r['nbytes'] / r['ep'] * link['beta_s_per_byte']) * 1e3:.2f}"
            print(f"  EP {r['ep']} {r['size']}: steps " + ", ".join(f"{t * 1e3:.2f}" for t in r["steps_s"])
                  + f" (sum {sum(r['steps_s']) * 1e3:.2f}, whole {r['pairwise'] * 1e3:.2f}){alone}")
        if steps:
            print(f"# step time, dense transformer vs MoE (top-1, {world.size} experts of the dense MLP's shape, "
                  f"EP={world.size}): {steps['transformer'] * 1e3:.1f} ms vs {steps['moe'] * 1e3:.1f} ms "
                  f"({steps['moe'] / steps['transformer']:.2f}x), same active parameters per token")
            padded = "moe padded"
            print(f"# MoE dispatch at capacity factor {args.capacity_factor:g}: padded {steps[padded] * 1e3:.1f} ms "
                  f"and {fmt_bytes(a2a[padded])} of all-to-all per rank and step vs variable "
                  f"{steps['moe'] * 1e3:.1f} ms and {fmt_bytes(a2a['moe'])} "
                  f"({steps[padded] / steps['moe']:.2f}x the time, {a2a[padded] / max(a2a['moe'], 1):.2f}x the bytes)")
    if args.json:
        report.write_json(args.json, {"meta": {"world_size": world.size, "capacity_factor": args.capacity_factor,
                                               "link": link and {k: v for k, v in link.items() if k != "host_of"}},
                                      "rows": rows, "steps": steps, "a2a_bytes": a2a})
    return 0
