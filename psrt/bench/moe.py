"""`python -m psrt.bench moe` (under mpirun): the all-to-all of mixture-of-experts routing, and
what an MoE step costs beside a dense one.

1. All-to-all time per size and EP, psrt's pairwise exchange against the MPI library's
   Alltoallv, beside the alpha-beta prediction of the pairwise exchange: EP-1 steps, each
   alpha + beta x (m / EP) when every rank's block goes over its own link (one rank per
   host; Thakur, Rabenseifner & Gropp 2005).  alpha and beta come from a ping-pong of this
   run (rank 0 and a rank on another host).  Groups of EP consecutive ranks run at once.
2. Step time of a dense transformer against the MoE transformer with the same active
   parameters per token (top-1 experts of the dense MLP's shape), experts spread over all
   ranks (EP = N), same global batch.
"""
from __future__ import annotations

import statistics
import time

HELP = "MoE all-to-all (pairwise vs MPI Alltoallv vs alpha-beta) and dense vs MoE step time"


def add_arguments(p) -> None:
    p.add_argument("--sizes", default="64KiB,1MiB,8MiB", help="bytes each rank sends in one all-to-all")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="training steps per model (0: no step comparison)")
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


def step_time(world, grid, name: str, steps: int) -> float:
    """Mean step of `name` (dense transformer or moe) on the same data, slowest rank."""
    import torch
    from psrt.ep.layer import moe_layers
    from psrt.train.data import load
    from psrt.train.models import build_model, loss_and_correct
    from psrt.train.moe import MoETrainer
    data = load("text", 64)
    torch.manual_seed(0)
    model = build_model(name, data, 64, 2, **({"experts": grid.ep, "top_k": 1, "capacity_factor": 2.0}
                                             if name == "moe" else {}))
    for layer in moe_layers(model):
        layer.shard(grid.ep_group, grid.dp_group, algorithm="pairwise")
    trainer = MoETrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1), grid, algorithm="ring")
    g = torch.Generator().manual_seed(1 + world.rank)
    batches = [torch.randint(len(data), (8,), generator=g) for _ in range(steps + 1)]
    times = []
    for i, idx in enumerate(batches):
        world.comm.Barrier()
        t0 = time.perf_counter()
        trainer.step(lambda mb: loss_and_correct(model, mb, "lm")[0], [(data.train_x[idx], data.train_y[idx])])
        if i:
            times.append(max(world.comm.allgather(time.perf_counter() - t0)))
    return statistics.mean(times)


def command(args) -> int:
    import psrt
    from psrt.bench import report
    from psrt.bench.collectives import parse_size
    from psrt.bench.report import need
    from psrt.grid import Grid
    from psrt.train import prediction
    from psrt.train.report import fmt_bytes
    need(args.repeats >= 1, f"--repeats {args.repeats}: must be at least 1")
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
            rows.append(row)
        grid.free()
    steps = {}
    if args.steps:
        grid = Grid.build(world.comm, ep=world.size)
        steps = {name: step_time(world, grid, name, args.steps) for name in ("transformer", "moe")}
        grid.free()
    ctl.Free()
    if world.rank != 0:
        return 0
    cols = [("ep", "EP", "d"), ("size", "size", ""), ("pairwise", "pairwise (ms)", ".3f", 1e3),
            ("native", "MPI Alltoallv (ms)", ".3f", 1e3)]
    for r in rows:
        r["pairwise_vs_native"] = r["native"] / r["pairwise"]
        if link is not None:
            block = r["nbytes"] / r["ep"]
            r["predicted"] = (r["ep"] - 1) * (link["alpha_s"] + block * link["beta_s_per_byte"])
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
                  "each rank sends; predicted = pairwise exchange, (EP-1)(alpha + beta size/EP)"
                  + ("" if one_per_host else " (ranks share hosts: the link model is a rough guide)"))
        report.table(rows, cols + [("pairwise_vs_native", "x native", ".2f")])
        if steps:
            print(f"# step time, dense transformer vs MoE (top-1, {world.size} experts of the dense MLP's shape, "
                  f"EP={world.size}): {steps['transformer'] * 1e3:.1f} ms vs {steps['moe'] * 1e3:.1f} ms "
                  f"({steps['moe'] / steps['transformer']:.2f}x), same active parameters per token")
    if args.json:
        report.write_json(args.json, {"meta": {"world_size": world.size, "link": link and {
                                          k: v for k, v in link.items() if k != "host_of"}},
                                      "rows": rows, "steps": steps})
    return 0
