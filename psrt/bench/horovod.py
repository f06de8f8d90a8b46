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
    p.add_argument("--json", help="write the rows as JSON")
    p.add_argument("--quiet", action="store_true")


def read_timeline(path: Path) -> dict[str, dict[str, list[float]]]:
    """{shape: {phase: [durations in us]}} from Horovod's timeline.  Events are B/E pairs
    nested per tensor (pid); the shape is on the E of ALLREDUCE, so the phases seen since the
    last ALLREDUCE of a tensor (its negotiation included) belong to that shape."""
    text = path.read_text().strip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")
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
    from psrt.bench.collectives import HOROVOD, measure, sizes_from
    from psrt.bench.report import need
    from psrt.dp.horovod import import_horovod, init_horovod
    from psrt.train.report import fmt_bytes
    need(args.repeats >= 1, f"--repeats {args.repeats}: must be at least 1")
    args.min_size = args.max_size = None
    sizes = sizes_from(args)
    import_horovod()
    world = psrt.init()
    group = psrt.Communicator(world.comm)
    points = [p for s in sizes for p in measure(group, "allreduce", ["native", "ring"], s, repeats=args.repeats)]
    # The timeline goes to a folder rank 0 made; Horovod reads the variable at init.
    folder = group.comm.bcast(tempfile.mkdtemp(prefix="psrt-hvd-") if world.rank == 0 else None, root=0)
    timeline = Path(folder) / "timeline.json"
    os.environ["HOROVOD_TIMELINE"] = str(timeline)
    hvd = init_horovod(group)
    points += [p for s in sizes for p in measure(group, "allreduce", [HOROVOD], s, repeats=args.repeats)]
    hvd.shutdown()
    group.close()
    if world.rank != 0:
        return 0
    phases = read_timeline(timeline)
    shutil.rmtree(folder, ignore_errors=True)
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
    if not args.quiet:
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
    if args.json:
        report.write_json(args.json, {"meta": {"world_size": world.size, "mpi": report.mpi_version()}, "rows": rows})
    return 0
