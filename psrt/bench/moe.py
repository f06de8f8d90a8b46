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

from psrt.bench import timing

HELP = "MoE all-to-all (pairwise vs MPI Alltoallv vs alpha-beta), dense vs MoE step, padded vs variable dispatch"
DISPATCH = ("variable", "padded")


def add_arguments(p) -> None:
    p.add_argument("--sizes", default="64KiB,1MiB,8MiB", help="bytes each rank sends in one all-to-all")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="training steps per model (0: no step comparison)")
    p.add_argument("--capacity-factor", type=float, default=1.25,
                   help="expert capacity factor of the MoE steps (padded dispatch sends all of it)")
    from psrt.dp import device
    device.add_argument(p, "where the exchanged tensors and the models live (without a CUDA-aware MPI "
                           "the exchange is staged through host memory)")
    p.add_argument("--json", help="write the rows as JSON")
    p.add_argument("--quiet", action="store_true")


def time_alltoall(group, nbytes: int, algorithm: str, repeats: int, calls: int = 4, device="cpu") -> float:
    """Median over repeats of the slowest rank's mean time of `calls` back-to-back alltoallvs
    of nbytes per rank (back to back: a TCP connection left idle restarts slowly)."""
    import torch
    p = group.size
    rows = max(nbytes // 4 // p, 1)
    x, out = torch.ones(rows * p, device=device), torch.empty(rows * p, device=device)
    counts = [rows] * p

    def call():
        group.alltoallv(x, counts, counts, out=out, algorithm=algorithm)
        if x.is_cuda:         # done when the GPU has the result, not when the host is
            torch.cuda.synchronize(x.device)
    return timing.timed(group.comm, call, repeats, warmup=calls, per_round=calls).median


def time_steps(group, nbytes: int, repeats: int, calls: int = 4, device="cpu") -> list[float]:
    """Each step k = 1..EP-1 of the pairwise exchange timed alone (every group at once, as in
    the exchange): median over repeats of the slowest rank's mean of `calls` back-to-back
    steps.  Their sum beside the whole exchange says whether the steps cost more together
    (waiting on one another) or each alone (what one step of EP concurrent flows costs)."""
    import torch
    from psrt.collectives import alltoall
    from psrt.collectives.layout import offsets
    p = group.size
    rows = max(nbytes // 4 // p, 1)
    x, out = torch.ones(rows * p, device=device), torch.empty(rows * p, device=device)
    off = offsets([rows] * p)
    return [timing.timed(group.comm, lambda k=k: alltoall.step(group.comm, k, x, off, out, off), repeats,
                         warmup=calls, per_round=calls).median for k in range(1, p)]


def step_time(world, grid, name: str, steps: int, dispatch: str = "variable",
              capacity_factor: float = 1.25, device="cpu") -> tuple[float, float]:
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
    model.to(device)
    trainer = MoETrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1), grid, algorithm="ring")
    g = torch.Generator().manual_seed(1 + world.rank)
    batches = [torch.randint(len(data), (8,), generator=g) for _ in range(steps + 1)]
    sent = []

    def step(idx):
        batch = [(data.train_x[idx].to(device), data.train_y[idx].to(device))]
        stats = trainer.step(lambda mb: loss_and_correct(model, mb, "lm")[0], batch)
        sent.append(stats.extra.get("a2a_bytes", 0))
    t = timing.timed(world.comm, timing.cycling(batches, step), steps, warmup=1)
    return t.mean, statistics.mean(world.comm.allgather(statistics.mean(sent[1:])))


def check(args) -> list[int]:
    """The sizes; bad values refused in one line."""
    from psrt.bench.collectives import parse_size
    from psrt.bench.report import need
    need(args.repeats >= 1, f"--repeats {args.repeats}: must be at least 1")
    need(args.capacity_factor > 0, f"--capacity-factor {args.capacity_factor}: must be a positive number")
    try:
        return [parse_size(s) for s in args.sizes.split(",")]
    except ValueError as err:
        need(False, f"--sizes: {err}")


def command(args) -> int:
    import psrt
    from psrt.bench import report
    from psrt.train import prediction
    sizes = check(args)
    world = psrt.init()
    report.need(world.size >= 2, "bench moe needs at least 2 ranks (mpirun -np 2 ...)")
    from psrt.dp.device import pick
    device = pick(args.device, world.local_rank)
    ctl = world.comm.Dup()
    link = prediction.measure(world, ctl)
    rows = measure_exchange(world, sizes, args.repeats, device)
    steps, a2a = measure_steps(world, args.steps, args.capacity_factor, device) if args.steps else ({}, {})
    ctl.Free()
    if world.rank != 0:
        return 0
    add_ratios(rows, link, world.size)
    if not args.quiet:
        print(f"# tensors on {device}")
        print_exchange(rows, link, world.size)
        if steps:
            print_steps(steps, a2a, args.capacity_factor, world.size)
    if args.json:
        report.write_json(args.json, {"meta": {"world_size": world.size, "capacity_factor": args.capacity_factor,
                                               "device": str(device),
                                               "link": link and {k: v for k, v in link.items() if k != "host_of"}},
                                      "rows": rows, "steps": steps, "a2a_bytes": a2a})
    return 0


def measure_exchange(world, sizes: list[int], repeats: int, device="cpu") -> list[dict]:
    """Both all-to-alls and the pairwise exchange's steps alone, per EP dividing N and size.
    The steps alone hand the tensors to MPI as they are: on a GPU, only with a CUDA-aware MPI."""
    import torch
    from psrt.transport import cuda_aware
    from psrt.grid import Grid
    from psrt.train.report import fmt_bytes
    rows = []
    for ep in [e for e in (2, 4, 8) if e <= world.size and world.size % e == 0]:
        grid = Grid.build(world.comm, ep=ep)
        for m in sizes:
            row = {"ep": ep, "size": fmt_bytes(m), "nbytes": m}
            for algo in ("pairwise", "native"):
                row[algo] = time_alltoall(grid.ep_group, m, algo, repeats, device=device)
            steps_alone = torch.device(device).type == "cpu" or cuda_aware()
            row["steps_s"] = time_steps(grid.ep_group, m, repeats, device=device) if steps_alone else []
            rows.append(row)
        grid.free()
    return rows


def measure_steps(world, count: int, capacity_factor: float, device="cpu") -> tuple[dict, dict]:
    """({model: step s}, {model: all-to-all bytes per rank and step}): dense against MoE,
    EP = N, MoE with each dispatch shape."""
    from psrt.grid import Grid
    steps, a2a = {}, {}
    grid = Grid.build(world.comm, ep=world.size)
    steps["transformer"], _ = step_time(world, grid, "transformer", count, device=device)
    for dispatch in DISPATCH:
        key = "moe" if dispatch == "variable" else f"moe {dispatch}"
        steps[key], a2a[key] = step_time(world, grid, "moe", count, dispatch, capacity_factor, device)
    grid.free()
    return steps, a2a


def add_ratios(rows: list[dict], link: dict | None, n: int) -> None:
    """x native, and with a ping-pong fit the pairwise exchange's prediction and its error."""
    from psrt.collectives.cost import Fit, predict_alltoall
    from psrt.grid import ep_ranks
    for r in rows:
        r["pairwise_vs_native"] = r["native"] / r["pairwise"]
        if link is not None:
            groups = [ep_ranks(first, n, 1, 1, r["ep"]) for first in range(0, n, r["ep"])]
            fit = Fit(link["alpha_s"], link["beta_s_per_byte"], 1.0)
            r["predicted"] = predict_alltoall(groups, r["nbytes"], link["host_of"], fit)
            if r["predicted"] is not None:       # None: every group inside one host
                r["error"] = r["pairwise"] / r["predicted"] - 1


def print_exchange(rows: list[dict], link: dict | None, n: int) -> None:
    from psrt.bench import report
    cols = [("ep", "EP", "d"), ("size", "size", ""), ("pairwise", "pairwise (ms)", ".3f", 1e3),
            ("native", "MPI Alltoallv (ms)", ".3f", 1e3)]
    if link is None:
        print(f"# MoE all-to-all, N={n}; no prediction (see above); size = bytes each rank sends")
    else:
        cols += [("predicted", "predicted (ms)", ".3f", 1e3), ("error", "error", "+.0%")]
        one_per_host = link["hosts"] == n
        where = "one rank per host" if one_per_host else f"{link['hosts']} host(s)"
        print(f"# MoE all-to-all, N={n} ({where}); ping-pong {link['between']}: alpha "
              f"{link['alpha_s'] * 1e6:.1f} us, {1 / link['beta_s_per_byte'] / 1e6:.0f} MB/s; size = bytes "
              "each rank sends; predicted = pairwise exchange, EP-1 steps of alpha + beta x the busiest "
              "link's bytes"
              + ("" if one_per_host else " (ranks share hosts: the link model is a rough guide)"))
    report.table(rows, cols + [("pairwise_vs_native", "x native", ".2f")])
    print("# the pairwise exchange's steps timed one at a time (ms), beside their sum and the whole exchange"
          + ("" if link is None else "; one step alone by the ping-pong fit: alpha + beta x size/EP"))
    for r in (r for r in rows if r["steps_s"]):
        alone = "" if link is None else \
            f"; ping-pong fit {(link['alpha_s'] + r['nbytes'] / r['ep'] * link['beta_s_per_byte']) * 1e3:.2f}"
        print(f"  EP {r['ep']} {r['size']}: steps " + ", ".join(f"{t * 1e3:.2f}" for t in r["steps_s"])
              + f" (sum {sum(r['steps_s']) * 1e3:.2f}, whole {r['pairwise'] * 1e3:.2f}){alone}")


def print_steps(steps: dict, a2a: dict, capacity_factor: float, n: int) -> None:
    from psrt.train.report import fmt_bytes
    print(f"# step time, dense transformer vs MoE (top-1, {n} experts of the dense MLP's shape, "
          f"EP={n}): {steps['transformer'] * 1e3:.1f} ms vs {steps['moe'] * 1e3:.1f} ms "
          f"({steps['moe'] / steps['transformer']:.2f}x), same active parameters per token")
    padded = "moe padded"
    print(f"# MoE dispatch at capacity factor {capacity_factor:g}: padded {steps[padded] * 1e3:.1f} ms "
          f"and {fmt_bytes(a2a[padded])} of all-to-all per rank and step vs variable "
          f"{steps['moe'] * 1e3:.1f} ms and {fmt_bytes(a2a['moe'])} "
          f"({steps[padded] / steps['moe']:.2f}x the time, {a2a[padded] / max(a2a['moe'], 1):.2f}x the bytes)")
