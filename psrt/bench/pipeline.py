"""Model-parallel measurements next to their theory, in well under a minute.

    ./mpi_launch -np 4 python -m psrt.bench pipeline [--device cuda] [--json FILE]

1. Pipeline bubble per schedule.  Stages do fixed-duration work (a sleep of t_f forward and
   2 t_f backward, split over the virtual stages), so the figure measures the schedule and
   the runtime's messaging, not how busy the shared CPU is.  Theory: (p-1)/(m+p-1) for GPipe
   and 1F1B (Huang et al. 2019; Narayanan et al. 2019) and (p-1)/(v m+p-1) for interleaved
   1F1B (Narayanan et al. 2021: bubble/ideal = (p-1)/(v m)), i.e. about 1/v of 1F1B's.
2. Peak activation memory per pipeline rank, GPipe vs 1F1B (bytes autograd saved, counted
   by the runtime): GPipe holds m micro-batches on every rank, 1F1B at most p - r.
3. Bytes all-reduced per tensor-parallel transformer block next to Megatron-LM's count:
   two all-reduces of b*s*h values forward, two backward (Shoeybi et al. 2019, sec. 3).

Each part is a function of an mpi4py communicator (`bubble`, `activation_memory`,
`tp_bytes`) returning plain dicts, so `psrt.bench` can import and run them.
"""
from __future__ import annotations

import json
import time

import torch
from torch import nn

from psrt.bench import timing
from psrt.pp import PipelineRuntime, build_stages, make_schedule


class _Sleep(torch.autograd.Function):
    """Identity whose forward takes `f` seconds and backward `b` seconds."""

    @staticmethod
    def forward(ctx, x, f, b):
        ctx.b = b
        time.sleep(f)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.b)
        return grad, None, None


class SleepStage(nn.Module):
    def __init__(self, f: float, b: float):
        super().__init__()
        self.f, self.b = f, b

    def forward(self, x):
        return _Sleep.apply(x, self.f, self.b)


def bubble(comm, schedules=(("gpipe", 1), ("1f1b", 1), ("interleaved", 2)), microbatches=(4, 8),
           t_f: float = 0.03, device=torch.device("cpu")) -> list[dict]:
    """Measured idle share per schedule and micro-batch count, with the theory beside it
    (activations on `device`: on a GPU they travel as CUDA tensors do, psrt/pp/p2p.py)."""
    p = comm.Get_size()
    rows = []
    for name, v in schedules:
        for m in microbatches:
            sched = make_schedule(name, p, m, v)
            stages = {s: SleepStage(t_f / v, 2 * t_f / v) for s in sched.stages_of(comm.Get_rank())}
            rt = PipelineRuntime(stages, sched, comm, lambda y, t: (y * t).sum(), device=device, timeout_s=60)
            x = [torch.ones(4, device=device, requires_grad=True) for _ in range(m)]
            stats = []
            # one warm-up step (first messages, allocation), then one timed step
            makespan = timing.timed(comm, lambda: stats.append(rt.step(x, x)), 1, warmup=1).median
            # Idle share of p ranks x the step's makespan (the papers' definition): ranks start
            # together after the barrier, and the slowest rank's step time is the makespan.
            busy = comm.allgather(stats[-1].busy_s)
            rows.append({"schedule": name, "p": p, "v": v, "m": m,
                         "measured": 1.0 - sum(busy) / (p * makespan),
                         "theory": (p - 1) / (v * m + p - 1),
                         "theory_div_v": (p - 1) / (m + p - 1) / v,
                         "step_s": makespan, "ideal_s": m * 3 * t_f})
    return rows


def activation_memory(comm, m: int = 8, rows: int = 32, width: int = 256,
                      device=torch.device("cpu")) -> list[dict]:
    """Peak bytes held for backward on each pipeline rank, GPipe vs 1F1B (real MLP stages)."""
    p, r = comm.Get_size(), comm.Get_rank()
    torch.manual_seed(0)
    out = []
    for name in ("gpipe", "1f1b"):
        blocks = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(p)]
        sched = make_schedule(name, p, m)
        stages = {s: stage.to(device) for s, stage in build_stages(blocks, p, sched.stages_of(r)).items()}
        rt = PipelineRuntime(stages, sched, comm, lambda y, t: ((y - t) ** 2).mean(), device=device, timeout_s=60)
        xs = [torch.randn(rows, width).to(device) for _ in range(m)]
        st = rt.step(xs, xs)
        peaks = comm.allgather((st.peak_activation_bytes, st.peak_live_microbatches))
        out.append({"schedule": name, "p": p, "m": m,
                    "peak_bytes": [b for b, _ in peaks], "peak_microbatches": [n for _, n in peaks],
                    "theory_microbatches": [m if name == "gpipe" else min(p - k, m) for k in range(p)]})
    return out


def tp_bytes(comm, b: int = 4, s: int = 64, h: int = 64, heads: int = 4, device=torch.device("cpu")) -> dict:
    """Payload bytes all-reduced by one TP transformer block, forward and backward."""
    import psrt
    from psrt.tp import CountingGroup, ParallelBlock
    group = CountingGroup(psrt.Communicator(comm))
    torch.manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        block = ParallelBlock(h, heads, 4 * h, group).to(device)
    x = torch.randn(b, s, h).to(device).requires_grad_()
    group.reset()
    y = block(x)
    fwd = (dict(group.calls), sum(group.bytes.values()))
    group.reset()
    y.sum().backward()
    bwd = (dict(group.calls), sum(group.bytes.values()))
    t = comm.Get_size()
    bsh = b * s * h * 4
    return {"tp": t, "b": b, "s": s, "h": h, "forward_calls": fwd[0], "forward_bytes": fwd[1],
            "backward_calls": bwd[0], "backward_bytes": bwd[1],
            "megatron_forward_bytes": 2 * bsh, "megatron_backward_bytes": 2 * bsh,
            # A ring all-reduce puts 2(t-1)/t of the payload on each rank's link.
            "ring_wire_bytes_per_rank": int(4 * bsh * 2 * (t - 1) / t)}


def _print(res: dict) -> None:
    print(f"pipeline bubble on {res['device']} (stages sleep t_f forward, 2 t_f backward; idle share of the step)")
    print(f"{'schedule':<12}{'p':>3}{'v':>3}{'m':>4}{'measured':>10}{'theory':>9}"
          f"{'(p-1)/(m+p-1)/v':>17}{'step s':>8}{'ideal s':>9}")
    for r in res["bubble"]:
        print(f"{r['schedule']:<12}{r['p']:>3}{r['v']:>3}{r['m']:>4}{r['measured']:>10.3f}"
              f"{r['theory']:>9.3f}{r['theory_div_v']:>17.3f}{r['step_s']:>8.3f}{r['ideal_s']:>9.3f}")
    print("\npeak activation memory per pipeline rank (bytes saved for backward; micro-batches)")
    for r in res["memory"]:
        kib = " ".join(f"{b / 1024:7.0f}" for b in r["peak_bytes"])
        print(f"{r['schedule']:<6} m={r['m']}  KiB per rank: {kib}   micro-batches: "
              f"{r['peak_microbatches']} (theory {r['theory_microbatches']})")
    t = res["tp"]
    print(f"\ntensor parallelism: one block, t={t['tp']}, b={t['b']} s={t['s']} h={t['h']} (fp32)")
    print(f"  forward : {t['forward_calls']} {t['forward_bytes']:>9,} B   Megatron 2*b*s*h*4 = "
          f"{t['megatron_forward_bytes']:,} B")
    print(f"  backward: {t['backward_calls']} {t['backward_bytes']:>9,} B   Megatron 2*b*s*h*4 = "
          f"{t['megatron_backward_bytes']:,} B")
    print(f"  on the wire per rank with a ring all-reduce: {t['ring_wire_bytes_per_rank']:,} B")


HELP = "pipeline bubble per schedule, activation memory and tensor-parallel bytes, beside the theory (run under mpirun)"


def add_arguments(ap) -> None:
    ap.add_argument("--t-forward", type=float, default=0.03, help="forward time per stage (s)")
    ap.add_argument("--microbatches", default="4,8", help="micro-batch counts, comma list")
    from psrt.dp import device
    device.add_argument(ap, "where stages, activations and the tensor-parallel block live")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON (rank 0)")


def command(args) -> int:
    from psrt.bench.report import need
    try:
        ms = tuple(int(v) for v in args.microbatches.split(","))
    except ValueError:
        ms = ()
    need(bool(ms) and min(ms) >= 1, f"--microbatches {args.microbatches}: expected counts such as 4,8")
    need(args.t_forward > 0, f"--t-forward {args.t_forward}: must be positive")
    import psrt
    from psrt.dp.device import pick
    world = psrt.init(export_env=False)
    device = pick(args.device, world.local_rank)
    res = {"device": str(device), "bubble": bubble(world.comm, microbatches=ms, t_f=args.t_forward, device=device),
           "memory": activation_memory(world.comm, device=device),
           "tp": tp_bytes(world.comm, device=device)}
    if world.rank == 0:
        _print(res)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
    return 0
