"""`python -m psrt.bench suite`: the A/B benchmark suite in one command.

1. collectives: every all-reduce algorithm and peer (psrt's ps, ring, halving-doubling, tree,
   the MPI library, torch.distributed gloo, Horovod) from 4 B to 256 MiB, per world size;
   and per call at 4 B and 1 KiB, psrt's own algorithms called in each way (into a held
   result, in place, into a fresh result, non-blocking) beside the same schedule written in
   bare mpi4py and called the same way (psrt/bench/floors.py);
2. training: step time, samples/s and scaling efficiency of every strategy, on this host
   and, as root, on an emulated two-host cluster; on this host the ring again with
   psrt.trace recording, for tracing's overhead;
3. network (as root): ps vs ring on emulated hosts with shaped links, against the alpha-beta
   model (psrt.bench.network).

Everything lands in one folder: JSON and CSV per part, PNG plots, and report.md, which
holds the tables, the goals as ratios measured in this run, and the machine they ran on.
"""
from __future__ import annotations

import datetime
import sys
from pathlib import Path

from psrt.bench import goal, jobs, report, training
from psrt.bench.goal import Goal
from psrt.errors import PsrtError
from psrt.train.report import fmt_bytes

PARTS = ("collectives", "training", "network")
COLLECTIVE_ALGORITHMS = ("ps", "ring", "halving-doubling", "tree", "native", "torch", "horovod")
# The per-call goal: psrt's own all-reduces within PER_CALL_GOAL x their bare mpi4py schedule.
PER_CALL_ALGORITHMS = ("ring", "halving-doubling", "tree", "ps")
PER_CALL_SIZES = (4, 1024)
PER_CALL_GOAL = 2.0

HELP = ("collectives, training and the network-bound regime in one run, with a Markdown report, "
        "JSON, CSV and plots (runs its own MPI jobs)")


def add_arguments(su) -> None:
    su.add_argument("--out", default="out/bench", help="folder for report.md and the files")
    su.add_argument("--np", default="2,4", help="world sizes on this host (comma list)")
    su.add_argument("--parts", default=",".join(PARTS), help="comma list of " + ", ".join(PARTS))
    su.add_argument("--quick", action="store_true", help="a small version of every part, under a minute")
    su.add_argument("--quiet", action="store_true", help="no progress display")


def check(args) -> None:
    from psrt.bench.report import need
    parts = args.np.split(",")
    need(all(p.strip().isdigit() and 2 <= int(p) <= 64 for p in parts),
         f"--np {args.np}: expected world sizes from 2 to 64, e.g. 2,4")
    args.np = sorted({int(p) for p in parts})
    args.parts = [p.strip() for p in args.parts.split(",")]
    bad = [p for p in args.parts if p not in PARTS]
    need(not bad, f"--parts {','.join(bad)}: choose from {', '.join(PARTS)}")



def settings(args) -> dict:
    """What each part measures, full or --quick (under a minute here)."""
    per_call = ["--sizes", ",".join(map(str, PER_CALL_SIZES)), "--calls", "out,inplace,new,async",
                "--algorithms", ",".join(a for name in PER_CALL_ALGORITHMS for a in (name, f"mpi4py-{name}"))]
    if args.quick:
        return {"np": [2], "coll": ["--min-size", "4", "--max-size", "4MiB", "--step", "16",
                                    "--warmup", "1", "--repeats", "2"],
                "per_call": per_call + ["--warmup", "2", "--repeats", "2"],
                "train": ["--steps", "2", "--rounds", "1", "--width", "512"], "train_np": [1, 2],
                "cluster_np": []}
    return {"np": args.np, "coll": ["--min-size", "4", "--max-size", "256MiB", "--step", "4",
                                    "--warmup", "2", "--repeats", "5"],
            "per_call": per_call + ["--warmup", "3", "--repeats", "7"],
            "train": ["--steps", "5", "--rounds", "3"], "train_np": sorted({1, *args.np}),
            "cluster_np": [n for n in args.np if n % 2 == 0]}


def netns_ok() -> str | None:
    """None where emulated clusters can be made, else why not."""
    from psrt.launch import cluster as C
    try:
        C.require_netns()
    except PsrtError as err:
        return str(err)
    return None


def command(args) -> int:
    check(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = settings(args)
    say = (lambda text: None) if args.quiet else (lambda text: print(f"psrt.bench suite: {text}", file=sys.stderr, flush=True))
    sections, goals = [], []
    for part, run in (("collectives", collectives_part), ("training", training_part), ("network", network_part)):
        if part in args.parts:
            texts, met = run(args, plan, out, say)
            sections += texts
            goals += met
    text = markdown(args, sections, goals)
    (out / "report.md").write_text(text)
    print(text)
    print(f"wrote {out}/report.md and the JSON, CSV and PNG files beside it", file=sys.stderr)
    return 0


def collectives_part(args, plan: dict, out: Path, say) -> tuple[list[str], list[Goal]]:
    """The all-reduce sweep per world size, then the per-call cost against the floors."""
    from psrt.bench.collectives import against_floors
    horovod = training.available(["horovod"]) == ["horovod"]
    algos = ",".join(training.available(list(COLLECTIVE_ALGORITHMS)))
    rows = []
    for n in plan["np"]:
        say(f"collectives on {n} ranks")
        got = jobs.local(n, ["collectives", "--quiet", "--algorithms", algos] + plan["coll"])
        rows += got["rows"]
        report.plot_busbw(rows_of(got["rows"], n), out / f"allreduce_np{n}.png",
                          f"allreduce busbw, N={n} ranks on one host, float32")
    report.write_json(out / "collectives.json", {"rows": rows})
    report.write_csv(out / "collectives.csv", rows)
    calls = []
    for n in plan["np"]:
        say(f"per-call cost on {n} ranks")
        calls += jobs.local(n, ["collectives", "--quiet"] + plan["per_call"])["rows"]
    against_floors(calls)
    report.write_json(out / "per_call.json", {"rows": calls})
    report.write_csv(out / "per_call.csv", calls)
    return ([collectives_section(rows, plan["np"]), per_call_section(calls)],
            collectives_goals(rows, horovod) + per_call_goals(calls))


def training_part(args, plan: dict, out: Path, say) -> tuple[list[str], list[Goal]]:
    """Every strategy per world size on this host, and as root on 2 emulated hosts."""
    dps = ",".join(training.available(list(training.DEFAULT_STRATEGIES)))
    rows = []
    for n in plan["train_np"]:
        say(f"training on {n} rank(s)")
        # the ring again with a timeline recorded (ring+trace): tracing's overhead
        trace = ["--trace", str(out / f"trace_np{n}.json")] if n > 1 and "ring" in dps.split(",") else []
        got = jobs.local(n, ["training", "--quiet", "--dp", "ring" if n == 1 else dps] + trace + plan["train"])
        rows += [dict(r, where="one host") for r in got["rows"]]
    if plan["cluster_np"] and netns_ok() is None:
        from psrt.launch import cluster as C
        cluster = C.Cluster(("node0", "node1"), "198.18.8.0/24")
        with C.running(cluster):
            for n in plan["cluster_np"]:
                say(f"training on {n} ranks over 2 emulated hosts")
                got = jobs.on_cluster(cluster, [("node0", n // 2), ("node1", n // 2)],
                                      ["training", "--quiet", "--dp", dps] + plan["train"])
                rows += [dict(r, where="2 emulated hosts") for r in got["rows"]]
    training.scaling([r for r in rows if r["ranks"] > 1], next((r for r in rows if r["ranks"] == 1), None))
    report.write_json(out / "training.json", {"rows": rows})
    report.write_csv(out / "training.csv", rows)
    plot_training(rows, out / "training.png")
    return [training_section(rows)], training.goals(rows)


def network_part(args, plan: dict, out: Path, say) -> tuple[list[str], list[Goal]]:
    """PS vs ring on shaped emulated hosts (root), or why not."""
    no_netns = netns_ok()
    if no_netns is not None:
        return [f"## Network-bound regime\n\nNot run: {no_netns}\n"], []
    from psrt.bench import network
    say("network-bound regime on emulated hosts")
    payload = network.run(network.defaults(args.quick, args.quiet))
    goals = network.goals(payload)
    payload["goals"] = goal.rows(goals)
    report.write_json(out / "network.json", payload)
    report.write_csv(out / "network.csv", payload["rows"])
    network.plot(payload, out / "network.png")
    return [network_section(payload)], goals


def rows_of(rows: list[dict], n: int) -> list[dict]:
    return [r for r in rows if r["world_size"] == n and r["collective"] == "allreduce"]


# --- goals ------------------------------------------------------------------------------------

def collectives_goals(rows: list[dict], horovod: bool) -> list[Goal]:
    goals = []
    for n in sorted({r["world_size"] for r in rows}):
        at = {(r["algorithm"], r["nbytes"]): r["busbw_gbs"] for r in rows_of(rows, n)}
        big = sorted({s for _, s in at if s >= 4 << 20})
        if not big:
            continue
        native = min(at[("ring", s)] / at[("native", s)] for s in big)
        goals.append(Goal(f"N={n}: ring >= 0.9x native busbw at >= 4 MiB", "ring", "native", ">=", 0.9, native,
                          worst=True))
        if horovod and all(("horovod", s) in at for s in big):
            hv = min(at[("ring", s)] / at[("horovod", s)] for s in big)
            goals.append(Goal(f"N={n}: ring >= 2x Horovod busbw at >= 4 MiB (CPU tensors)", "ring", "horovod",
                              ">=", 2.0, hv, worst=True))
    return goals


CALL_NAMES = {"out": "into a held result", "inplace": "in place", "new": "into a fresh result",
              "async": "non-blocking (async_op), waited on"}


def per_call_goals(rows: list[dict]) -> list[Goal]:
    """Per world size and way of calling: the worst ratio of psrt's algorithms to their floor
    (vs_floor: time over the bare mpi4py schedule's, called the same way, in the same run)."""
    from psrt.bench.collectives import split_name
    goals = []
    for n in sorted({r["world_size"] for r in rows}):
        for call, what in CALL_NAMES.items():
            sel = [r for r in rows if r["world_size"] == n and r.get("vs_floor") is not None
                   and split_name(r["algorithm"])[1] == call]
            if not sel:
                continue
            worst = max(sel, key=lambda r: r["vs_floor"])
            base = split_name(worst["algorithm"])[0]
            detail = f"({base}, {fmt_bytes(worst['nbytes'])})"
            if call == "async" and all(r.get("vs_sync_floor") for r in sel):
                detail += f"; {max(r['vs_sync_floor'] for r in sel):.2f}x the blocking floor"
            goals.append(Goal(f"N={n}, {what}: {', '.join(PER_CALL_ALGORITHMS)} within {PER_CALL_GOAL:g}x of the "
                              "same schedule in bare mpi4py at 4 B and 1 KiB", worst["algorithm"],
                              f"mpi4py-{base}", "<=", PER_CALL_GOAL, worst["vs_floor"], worst=True, detail=detail))
    return goals


# --- the report -------------------------------------------------------------------------------

def collectives_section(rows: list[dict], nps: list[int]) -> str:
    text = ["## Collectives: allreduce busbw (GB/s), float32, one host\n",
            "`python -m psrt.bench collectives` per world size; time = median of the timed loops, "
            "slowest rank; busbw = algbw x 2(N-1)/N (nccl-tests).\n"]
    for n in nps:
        sel = rows_of(rows, n)
        algos = list(dict.fromkeys(r["algorithm"] for r in sel))
        sizes = sorted({r["nbytes"] for r in sel})
        at = {(r["algorithm"], r["nbytes"]): r for r in sel}
        table_rows = [dict({"size": fmt_bytes(s)},
                           **{a: at[(a, s)]["busbw_gbs"] for a in algos if (a, s) in at}) for s in sizes]
        text.append(f"### N = {n}\n\n![busbw, N={n}](allreduce_np{n}.png)\n")
        text.append(report.md_table(table_rows, [("size", "size", "")] + [(a, a, ".3f") for a in algos]))
        wrong = sum(r["wrong"] for r in sel)
        text.append(f"\n{wrong} wrong elements in all.\n")
    return "\n".join(text)


def per_call_section(rows: list[dict]) -> str:
    """Time per call, psrt / floor (x ratio), per world size, algorithm and way of calling."""
    from psrt.bench.collectives import split_name
    table = []
    for n in sorted({r["world_size"] for r in rows}):
        for r in rows:
            if r["world_size"] != n or r.get("vs_floor") is None:
                continue
            base, call = split_name(r["algorithm"])
            entry = next((t for t in table if (t["n"], t["algorithm"], t["call"]) == (n, base, call)), None)
            if entry is None:
                entry = {"n": n, "algorithm": base, "call": call}
                table.append(entry)
            entry[fmt_bytes(r["nbytes"])] = (f"{r['time_us']:.1f} / {r['time_us'] / r['vs_floor']:.1f} "
                                             f"(x{r['vs_floor']:.2f})")
    sizes = [fmt_bytes(s) for s in sorted({r["nbytes"] for r in rows})]
    return ("## Per call: psrt's all-reduces against their schedule in bare mpi4py\n\n"
            "`python -m psrt.bench collectives --calls out,inplace,new,async` per world size: time per "
            "call in us, psrt / the same schedule written in bare mpi4py over NumPy and called the same "
            "way (psrt/bench/floors.py; async: handed to a worker thread and waited on), in one run.\n\n"
            + report.md_table(table, [("n", "N", "d"), ("algorithm", "algorithm", ""), ("call", "call", "")]
                              + [(s, s, "") for s in sizes]))


def training_section(rows: list[dict]) -> str:
    meta = rows[0]
    return ("## Training: step time per strategy\n\n"
            f"MLP, {meta['params'] / 1e6:.2f} M parameters, {meta['global_batch'] // meta['workers']} samples "
            "per rank (weak scaling); step = median over rounds, slowest rank; scaling efficiency = "
            "samples/s / (N x one process's); x torch DDP = torch DDP's step / this step.\n\n"
            "![step time](training.png)\n\n"
            + report.md_table(rows, [("where", "where", "")] + training.COLUMNS))


def network_section(payload: dict) -> str:
    from psrt.bench import network
    return ("## Network-bound regime: PS vs ring on emulated hosts\n\n"
            "Hosts are network namespaces whose links are shaped with tc (htb, small packets first) in both directions. "
            "Predicted: T = steps x alpha + beta x (bytes over the busiest link direction) "
            "(psrt/collectives/cost.py). `unshaped` is the same job on unshaped links, the floor set "
            "by this machine's cores; a row is network-bound where that floor is under 25% of the "
            "measurement, and only those rows test the model.\n\n"
            + "\n".join(f"- {line}" for line in network.fit_lines(payload))
            + "\n\n![time vs hosts](network.png)\n\n" + report.md_table(payload["rows"], network.COLUMNS))


def command_line(args) -> str:
    """The suite command that gives this report, every option that differs from the default."""
    parts = ["python -m psrt.bench suite"]
    if args.quick:
        parts.append("--quick")
    if args.np != [2, 4]:
        parts.append("--np " + ",".join(map(str, args.np)))
    if list(args.parts) != list(PARTS):
        parts.append("--parts " + ",".join(args.parts))
    return " ".join(parts + [f"--out {args.out}"])


def markdown(args, sections: list[str], goals: list[Goal]) -> str:
    head = [f"# psrt benchmark report{' (--quick)' if args.quick else ''}\n",
            f"- command: `{command_line(args)}`",
            f"- machine: {report.machine()}",
            f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}\n",
            "## Goals, as measured in this run\n"]
    head.append(report.md_table(goal.rows(goals), goal.COLUMNS) if goals else "(no goal applies to the parts run)\n")
    return "\n".join(head) + "\n" + "\n".join(sections)


def plot_training(rows: list[dict], path) -> bool:
    """Step time vs ranks per strategy, one panel per placement."""
    wheres = list(dict.fromkeys(r["where"] for r in rows))
    made = report.panels(len(wheres))
    if made is None:
        return False
    plt, fig, axes = made
    single = next((r for r in rows if r["ranks"] == 1), None)
    for ax, where in zip(axes, wheres):
        for dp in dict.fromkeys(r["dp"] for r in rows if r["ranks"] > 1):
            pts = sorted((r["ranks"], r["step_s"] * 1e3) for r in rows
                         if r["where"] == where and r["dp"] == dp and r["ranks"] > 1)
            if single and where == "one host":
                pts = [(1, single["step_s"] * 1e3)] + pts
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=dp,
                    lw=2.2 if dp in ("ring", "torch-ddp", "ps") else 1.2)
        report.label(ax, f"training step, {where}", "ranks", "step time (ms)")
    return report.save(plt, fig, path)
