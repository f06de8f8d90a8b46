"""`python -m psrt.bench horovod`: where the time of Horovod's all-reduce goes, beside the MPI
library's all-reduce and psrt's ring in the same run.

Horovod's `allreduce` hands the tensor to a background thread.  Each cycle
(HOROVOD_CYCLE_TIME) the ranks negotiate which tensors every rank has ready; ready tensors
are copied into the fusion buffer when there are several (HOROVOD_FUSION_THRESHOLD), reduced
with the MPI library's MPI_Allreduce (on CPU tensors), copied out, and the caller's handle
completes (Sergeev & Del Balso, arXiv:1802.05799, sec. 4 and the timeline docs).  Horovod's
own timeline (HOROVOD_TIMELINE, Chrome-trace JSON written by rank 0) times each of those
phases; this command reads it back and splits the mean call into negotiation, fusion copies,
MPI_Allreduce and the rest (queueing, thread hand-off, the result's allocation).

One tensor per call never fills the fusion buffer, so the command also times a training
step's worth of calls: every gradient of a model (--grads, a transformer's 54 tensors by
default) handed to Horovod at once, as hvd.DistributedOptimizer does, and waited on.  Horovod
fuses what is ready in a cycle into one MPI_Allreduce; its timeline, merged over the tensors,
says how much of the step each phase takes and how many fused calls a step makes.  Beside it,
psrt does what its ring DDP does with a bucket: the gradients copied into one flat buffer,
all-reduced by psrt's ring (and by the MPI library), and copied back.

Psrt and the MPI library are timed first and Horovod last, in a phase of its own: Horovod's
thread negotiates every cycle even when idle, which would slow what runs beside it.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path

HELP = "Horovod's all-reduce split into its phases (its own timeline) beside native and psrt's ring"
PHASES = ("NEGOTIATE_ALLREDUCE", "MEMCPY_IN_FUSION_BUFFER", "MPI_ALLREDUCE", "MEMCPY_OUT_FUSION_BUFFER")


def add_arguments(p) -> None:
    p.add_argument("--sizes", default="4MiB,16MiB", help="comma list of message sizes (default: 4MiB,16MiB)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--grads", default="transformer", choices=sorted(GRADS) + ["none"],
                   help="also all-reduce this model's gradient list per step, one tensor per parameter "
                        "(default: transformer, 4 blocks of dim 256); none: single tensors only")
    p.add_argument("--json", help="write the rows as JSON")
    p.add_argument("--quiet", action="store_true")


# Models whose gradient lists the many-tensor row all-reduces (psrt.train.models).
GRADS = {"transformer": dict(vocab=96, dim=256, layers=4, heads=4, max_len=64),
         "mlp": dict(hidden=1024, depth=2)}
GRAD_NAME = "psrt.grad."      # Horovod's names of those tensors: psrt.grad.0, psrt.grad.1, ...


def gradient_list(model: str, value: float) -> list:
    """One tensor per parameter of `model`, each filled with `value` (rank + 1: the sum over
    N ranks is known)."""
    import torch

    from psrt.train import models
    if model == "mlp":
        net = models.MLP(64, 10, **GRADS["mlp"])
    else:
        net = models.TransformerLM(**GRADS["transformer"])
    return [torch.full_like(p, value, requires_grad=False) for p in net.parameters()]


def _events(path: Path) -> list[dict]:
    text = path.read_text().strip().rstrip(",")
    return json.loads(text if text.endswith("]") else text + "]")


def merged_phases(path: Path, tensors: str) -> dict[str, tuple[float, int]]:
    """{phase: (us covered, intervals)} over every tensor whose name holds `tensors` (Horovod
    names a row "allreduce.NAME"), the intervals of a phase merged across tensors: a fused
    MPI_Allreduce appears on each of its tensors' rows, and counts once."""
    events = _events(path)
    names = {e["pid"]: e["args"].get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    stacks: dict = {}
    spans: dict = {}
    for e in events:
        pid, ph = e.get("pid"), e.get("ph")
        if tensors not in names.get(pid, ""):
            continue
        if ph == "B":
            stacks.setdefault(pid, []).append((e["name"], e["ts"]))
        elif ph == "E" and stacks.get(pid):
            name, start = stacks[pid].pop()
            spans.setdefault(name, []).append((start, e["ts"]))
    out = {}
    for name, intervals in spans.items():
        # A fused call has the same interval on each of its tensors' rows (set: once); two
        # calls back to back may touch at the timeline's microsecond resolution (lo == end):
        # still two calls.
        covered, count, end = 0.0, 0, None
        for lo, hi in sorted(set(intervals)):
            if end is None or lo >= end:
                covered, count, end = covered + hi - lo, count + 1, hi
            elif hi > end:
                covered, end = covered + hi - end, hi
        out[name] = (covered, count)
    return out


def read_timeline(path: Path) -> dict[str, dict[str, list[float]]]:
    """{shape: {phase: [durations in us]}} from Horovod's timeline.  Events are B/E pairs
    nested per tensor (pid); the shape is on the E of ALLREDUCE, so the phases seen since the
    last ALLREDUCE of a tensor (its negotiation included) belong to that shape."""
    events = _events(path)
    stacks: dict = {}
    pending: dict = {}
    out: dict = {}
    for e in events:
        pid, ph = e.get("pid"), e.get("ph")
        if ph == "B":
            stacks.setdefault(pid, []).append((e["name"], e["ts"]))
        elif ph == "E" and stacks.get(pid):
            name, start = stacks[pid].pop()
            seen = pending.setdefault(pid, {})
            seen.setdefault(name, []).append(e["ts"] - start)
            if name == "ALLREDUCE" and "shape" in e.get("args", {}):
                into = out.setdefault(e["args"]["shape"], {})
                for phase, durations in seen.items():
                    into.setdefault(phase, []).extend(durations)
                pending[pid] = {}
    return out


def command(args) -> int:
    import psrt
    from psrt.bench import report
    from psrt.bench.collectives import sizes_from
    from psrt.dp.horovod import import_horovod
    report.need(args.repeats >= 1, f"--repeats {args.repeats}: must be at least 1")
    args.min_size = args.max_size = None
    sizes = sizes_from(args)
    import_horovod()
    world = psrt.init()
    grads = gradient_list(args.grads, world.rank + 1.0) if args.grads != "none" else None
    points, steps, folder = measure(world, sizes, grads, args.repeats)
    if world.rank != 0:
        return 0
    timeline = Path(folder) / "timeline.json"
    rows = single_rows(points, sizes, read_timeline(timeline))
    many = merged_phases(timeline, GRAD_NAME) if grads is not None else None
    shutil.rmtree(folder, ignore_errors=True)
    if not args.quiet:
        print_single(rows, args, world)
    step_row = None
    if grads is not None:
        step_row = many_tensor_row(args.grads, grads, steps, many)
        if not args.quiet:
            print_many(step_row, world.size)
    if args.json:
        report.write_json(args.json, {"meta": {"world_size": world.size, "mpi": report.mpi_version()}, "rows": rows,
                                      "gradient_step": step_row})
    return 1 if step_row and step_row["wrong"] else 0


def measure(world, sizes: list[int], grads: list | None, repeats: int) -> tuple[list, dict, str]:
    """(points of native, ring and Horovod per size, {way: time_steps of the gradient list},
    the folder of Horovod's timeline): psrt and the MPI library first, Horovod last."""
    import psrt
    from psrt.bench.collectives import HOROVOD
    from psrt.bench.collectives import measure as time_calls
    from psrt.dp.horovod import init_horovod
    group = psrt.Communicator(world.comm)
    points = [p for s in sizes for p in time_calls(group, "allreduce", ["native", "ring"], s, repeats=repeats)]
    steps = {}
    if grads is not None:
        for algorithm in ("ring", "native"):
            steps[algorithm] = time_steps(world.comm, grads, bucket_step(group, grads, algorithm), repeats)
    # The timeline goes to a folder rank 0 made; Horovod reads the variable at init.
    folder = group.comm.bcast(tempfile.mkdtemp(prefix="psrt-hvd-") if world.rank == 0 else None, root=0)
    os.environ["HOROVOD_TIMELINE"] = str(Path(folder) / "timeline.json")
    hvd = init_horovod(group)
    points += [p for s in sizes for p in time_calls(group, "allreduce", [HOROVOD], s, repeats=repeats)]
    if grads is not None:
        steps[HOROVOD] = time_steps(world.comm, grads, horovod_step(hvd, grads), repeats)
    hvd.shutdown()
    group.close()
    return points, steps, folder


def single_rows(points: list, sizes: list[int], phases: dict) -> list[dict]:
    """One row per size: Horovod's call split by its timeline, beside native and the ring."""
    from psrt.bench.collectives import HOROVOD
    from psrt.train.report import fmt_bytes
    at = {(p.algorithm, p.nbytes): p for p in points}
    rows = []
    for s in sizes:
        hv, native, ring = at[(HOROVOD, s)], at[("native", s)], at[("ring", s)]
        split = phases.get(f"[{s // 4}]", {})
        mean = {ph: statistics.median(split.get(ph) or [0.0]) for ph in PHASES}   # robust to a slow cycle
        inside = sum(mean.values())
        rows.append({"size": fmt_bytes(s), "nbytes": s, "horovod_us": hv.time_us,
                     "negotiate_us": mean["NEGOTIATE_ALLREDUCE"],
                     "memcpy_us": mean["MEMCPY_IN_FUSION_BUFFER"] + mean["MEMCPY_OUT_FUSION_BUFFER"],
                     "mpi_allreduce_us": mean["MPI_ALLREDUCE"], "rest_us": max(hv.time_us - inside, 0.0),
                     "native_us": native.time_us, "ring_us": ring.time_us,
                     "ring_vs_horovod": hv.time_us / ring.time_us, "ring_vs_native": native.time_us / ring.time_us,
                     "calls_timed": len(split.get("MPI_ALLREDUCE", []))})
    return rows


def print_single(rows: list[dict], args, world) -> None:
    from psrt.bench import report
    cycle = os.environ.get("HOROVOD_CYCLE_TIME", "Horovod's default")
    fusion = os.environ.get("HOROVOD_FUSION_THRESHOLD", "Horovod's default")
    print(f"# Horovod's all-reduce on N={world.size} ranks ({world.num_nodes} host(s)), float32 CPU tensors; "
          f"HOROVOD_CYCLE_TIME {cycle}, HOROVOD_FUSION_THRESHOLD {fusion}; phases from its timeline "
          f"(median per call), calls timed with psrt's bench (median of {args.repeats} loops, slowest rank)")
    report.table(rows, [("size", "size", ""), ("horovod_us", "horovod (us)", ".0f"),
                        ("negotiate_us", "negotiate", ".0f"), ("memcpy_us", "fusion copies", ".0f"),
                        ("mpi_allreduce_us", "MPI_Allreduce", ".0f"), ("rest_us", "rest", ".0f"),
                        ("native_us", "native (us)", ".0f"), ("ring_us", "psrt ring (us)", ".0f"),
                        ("ring_vs_horovod", "ring x horovod", ".2f"),
                        ("ring_vs_native", "ring x native", ".2f")])
    for r in rows:
        share = min(r["mpi_allreduce_us"] / r["horovod_us"], 1.0)
        print(f"# {r['size']}: {share:.0%} of Horovod's call is the MPI library's MPI_Allreduce, which takes "
              f"{r['mpi_allreduce_us'] / r['native_us']:.2f}x the same call made directly (Horovod's thread "
              f"runs it while the caller waits); 2x Horovod is a ring of {r['horovod_us'] / 2:.0f} us, "
              f"{2 * r['native_us'] / r['horovod_us']:.2f}x the direct call's speed (psrt's ring: "
              f"{r['ring_vs_native']:.2f}x)")


def bucket_step(group, grads: list, algorithm: str):
    """What psrt's ring DDP does with one bucket: copy the gradients into a flat buffer, all-reduce
    it in place with `algorithm`, copy the results back."""
    import torch
    flat = torch.empty(sum(g.numel() for g in grads))
    pieces = [piece.view_as(g) for piece, g in zip(flat.split([g.numel() for g in grads]), grads)]

    def step():
        torch.cat([g.view(-1) for g in grads], out=flat)
        group.allreduce(flat, out=flat, algorithm=algorithm)
        for g, piece in zip(grads, pieces):
            g.copy_(piece)
    return step


def horovod_step(hvd, grads: list):
    """What hvd.DistributedOptimizer does in a step: every gradient handed to Horovod in
    place, then every handle waited on."""
    def step():
        handles = [hvd.allreduce_async_(g, op=hvd.Sum, name=f"{GRAD_NAME}{i}") for i, g in enumerate(grads)]
        for h in handles:
            hvd.synchronize(h)
    return step


def time_steps(comm, grads: list, step, repeats: int, min_time_s: float = 0.05) -> dict:
    """{"s": median over `repeats` rounds of about min_time_s of the slowest rank's time per
    step, "steps": calls made, "wrong": elements off the sum over ranks after the first call}.
    The gradients are refilled with rank + 1 first and left summed many times over."""
    from psrt.bench import timing
    n, mine = comm.size, comm.rank + 1.0
    for g in grads:
        g.fill_(mine)
    step()
    wrong = comm.allreduce(sum(int((g != n * (n + 1) / 2).sum()) for g in grads))
    t = timing.timed(comm, step, repeats, warmup=1, min_time_s=min_time_s, most=100)
    # the check, the warm-up, the call that sized the rounds, and the rounds
    return {"s": t.median, "steps": 3 + repeats * t.calls, "wrong": wrong}


def many_tensor_row(model: str, grads: list, steps: dict, phases: dict) -> dict:
    """The gradient step's figures: Horovod's step split by its timeline (each phase's time
    merged over the tensors, per step) beside psrt's bucket with the ring and with native."""
    from psrt.bench.collectives import HOROVOD
    from psrt.train.report import fmt_bytes
    hv = steps[HOROVOD]
    per = {ph: phases.get(ph, (0.0, 0))[0] / hv["steps"] for ph in PHASES}
    inside = sum(per.values())
    return {"model": model, "tensors": len(grads), "bytes": fmt_bytes(4 * sum(g.numel() for g in grads)),
            "horovod_us": hv["s"] * 1e6, "negotiate_us": per["NEGOTIATE_ALLREDUCE"],
            "memcpy_us": per["MEMCPY_IN_FUSION_BUFFER"] + per["MEMCPY_OUT_FUSION_BUFFER"],
            "mpi_allreduce_us": per["MPI_ALLREDUCE"], "rest_us": max(hv["s"] * 1e6 - inside, 0.0),
            "fused_calls": phases.get("MPI_ALLREDUCE", (0.0, 0))[1] / hv["steps"],
            "ring_us": steps["ring"]["s"] * 1e6, "native_us": steps["native"]["s"] * 1e6,
            "ring_vs_horovod": hv["s"] / steps["ring"]["s"], "wrong": sum(v["wrong"] for v in steps.values())}


def print_many(row: dict, n: int) -> None:
    from psrt.bench import report
    print(f"\n# A training step's gradients, {row['tensors']} tensors of a {row['model']} ({row['bytes']}), "
          f"on N={n}: Horovod given each tensor (allreduce_async_, as DistributedOptimizer), psrt the "
          "flat bucket its ring DDP reduces (copies in and out included); Horovod's phases from its "
          "timeline, merged over the tensors, per step (the mean over every step it ran, warm-up included)")
    report.table([row], [("horovod_us", "horovod (us)", ".0f"), ("negotiate_us", "negotiate", ".0f"),
                         ("memcpy_us", "fusion copies", ".0f"), ("mpi_allreduce_us", "MPI_Allreduce", ".0f"),
                         ("rest_us", "rest", ".0f"), ("fused_calls", "fused calls", ".1f"),
                         ("native_us", "native bucket (us)", ".0f"), ("ring_us", "psrt ring bucket (us)", ".0f"),
                         ("ring_vs_horovod", "ring x horovod", ".2f"), ("wrong", "#wrong", "d")])
    print(f"# Horovod fused the {row['tensors']} tensors into {row['fused_calls']:.1f} MPI_Allreduce calls per "
          f"step; {min(row['mpi_allreduce_us'] / row['horovod_us'], 1.0):.0%} of its step is MPI_Allreduce, "
          f"{min(row['memcpy_us'] / row['horovod_us'], 1.0):.0%} the fusion buffer's copies, "
          f"{min(row['negotiate_us'] / row['horovod_us'], 1.0):.0%} negotiation; the rest is the cycle's wait "
          "and the hand-offs between the caller and Horovod's thread")
