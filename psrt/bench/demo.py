"""`python -m psrt.bench demo` (what `make demo` runs): the parameter server against the ring
where the contrast is real.

A 4.3M-parameter MLP (17 MB of gradients a step) trains with `--dp ps,ring` on 4 emulated
hosts of one rank each, joined by 1 Gbit/s links (network namespaces of this machine, root).
There the server's link carries (N-1) x M each way per step and a ring rank's 2(N-1)/N x M,
so the ring's step should take about a third of the server's.  psrt.train prints its summary
and, beside it, the alpha-beta prediction of each step from a ping-pong of this run, the
regime and the crossover size; this command then draws both strategies' loss curves (they
must lie on each other: the same training) and their step time split into compute and
communication, predicted beside measured, and every rank's timeline (psrt.trace).

Where namespaces cannot be made (not root, no `ip`), it says why and runs 4 local ranks.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from psrt.bench.goal import Goal

HELP = "PS vs ring on 4 emulated hosts at 1 Gbit/s with a 17 MB model: table, prediction and PNG (make demo)"
ROOT = Path(__file__).resolve().parents[2]
SUBNET = "198.18.6.0/24"


def add_arguments(p) -> None:
    p.add_argument("--out", default="out/demo", help="folder for metrics and the PNG (default: out/demo)")
    p.add_argument("--hosts", type=int, default=4, help="emulated hosts of one rank each (default: 4)")
    p.add_argument("--rate", default="1gbit", help="their links, tc syntax (default: 1gbit)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per strategy (default: 40)")
    p.add_argument("--width", type=int, default=2048, help="MLP hidden units (default: 2048: 4.3M parameters)")
    p.add_argument("--local", action="store_true", help="run on local ranks, without emulated hosts")


def check(args) -> None:
    from psrt.bench.report import need
    need(args.hosts >= 2, f"--hosts {args.hosts}: the demo needs at least 2 hosts")
    need(args.steps >= 1, f"--steps {args.steps}: must be at least 1")
    need(args.width >= 1, f"--width {args.width}: must be at least 1")


def launch_argv(args, emulate: bool) -> list[str]:
    """The mpi_launch command of the run (printed, so it can be run again by hand)."""
    where = (["--emulate", "--hosts", ",".join(f"h{i}" for i in range(args.hosts)), "--rate", args.rate,
              "--subnet", SUBNET] if emulate else ["-np", str(args.hosts)])
    return ([str(ROOT / "mpi_launch"), *where, sys.executable, "-m", "psrt.train", "--dp", "ps,ring",
             "--width", str(args.width), "--layers", "2", "--steps", str(args.steps),
             "--metrics", str(Path(args.out) / "metrics.jsonl"), "--trace", str(Path(args.out) / "trace.json")])


def command(args) -> int:
    """Train PS and ring in one run, print the comparison, write out/demo/ps_vs_ring.png."""
    check(args)
    from psrt.bench.suite import netns_ok
    missing = None if args.local else netns_ok()
    if missing:
        print(f"psrt demo: no emulated hosts ({missing}); running {args.hosts} local ranks instead, "
              "where the ranks share memory, not a network link", file=sys.stderr, flush=True)
    emulate = not args.local and missing is None
    argv = launch_argv(args, emulate)
    print("psrt demo: " + " ".join(argv).replace(str(ROOT) + "/", "./"), file=sys.stderr, flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    # env given explicitly: this process's MPI (mpi4py initialises at import) has added
    # variables to the C environment that would make the job's mpirun think it is nested.
    done = subprocess.run(argv, cwd=ROOT, stdin=subprocess.DEVNULL, env=dict(os.environ))
    if done.returncode != 0:
        return done.returncode
    png = Path(args.out) / "ps_vs_ring.png"
    runs = read_runs(Path(args.out) / "metrics.jsonl", ("ps", "ring"))
    print("\n" + verdict(runs, emulate))
    if plot(runs, png):
        print(f"psrt demo: wrote {png} (loss curves; step time split, predicted beside measured)")
    from psrt.trace.view import draw, load, side_by_side
    timeline = Path(args.out) / "timeline.png"
    # psrt.train writes one timeline per strategy (trace.ps.json, trace.ring.json), each on a
    # clock of its own from 0: the server's ranks and then the ring's, each on rows of their own
    traces = [Path(args.out) / f"trace.{dp}.json" for dp in ("ps", "ring")]
    draw(side_by_side({dp: load(str(t)) for dp, t in zip(("ps", "ring"), traces)}), str(timeline))
    print(f"psrt demo: wrote {timeline} (every rank's timeline; {traces[0]} and {traces[1].name} open in "
          "ui.perfetto.dev)")
    return 0


def read_runs(path: Path, strategies) -> dict:
    """{strategy: {"steps": [step records], "summary": {...}}} from the per-strategy metrics
    files psrt.train wrote (FILE.<dp>.jsonl; the summary holds the prediction)."""
    runs = {}
    for dp in strategies:
        run = {"steps": [], "summary": {}}
        for line in path.with_name(f"{path.stem}.{dp}{path.suffix}").read_text().splitlines():
            rec = json.loads(line)
            if rec.get("summary"):
                run["summary"] = rec
            else:
                run["steps"].append(rec)
        runs[dp] = run
    return runs


def step_s(run: dict) -> float:
    return run["summary"]["wall_s"] / max(run["summary"]["steps"], 1)


# The demo's goals: the ring's step at most half the server's, and within 20% of the
# alpha-beta model's prediction (psrt.train.prediction), on the emulated hosts.
RING_OVER_PS = 0.5
PREDICTION_WITHIN = 0.20


def goals(runs: dict, emulated: bool = True) -> list[Goal]:
    """The demo's goals as measured: not judged where they do not apply (local ranks share
    memory, not a link; no prediction was made)."""
    ps, ring = step_s(runs["ps"]), step_s(runs["ring"])
    where = "" if emulated else " (judged on emulated hosts only: these were local ranks)"
    predicted = runs["ring"]["summary"].get("pred_step_s")
    return [Goal(f"ring step <= {RING_OVER_PS:g}x the parameter server's{where}", "ring", "ps", "<=",
                 RING_OVER_PS, ring / ps, judged=emulated),
            Goal(f"ring step within {PREDICTION_WITHIN:.0%} of the alpha-beta prediction{where}", "ring",
                 "alpha-beta prediction", "within", PREDICTION_WITHIN, ring / predicted if predicted else None,
                 judged=emulated, missing="no prediction was made")]


def verdict(runs: dict, emulated: bool = True) -> str:
    """The demo's two numbers (the ring's step against the server's, and against the model)
    and its goals, met or missed."""
    ps, ring = step_s(runs["ps"]), step_s(runs["ring"])
    text = f"psrt demo: ring step {ring * 1e3:.0f} ms = {ring / ps:.2f}x the parameter server's {ps * 1e3:.0f} ms"
    predicted = runs["ring"]["summary"].get("pred_step_s")
    if predicted:
        text += f"; the alpha-beta model predicted {predicted * 1e3:.0f} ms ({ring / predicted - 1:+.0%})"
    return "\n".join([text] + [f"psrt demo: {g.line()}" for g in goals(runs, emulated)])


def plot(runs: dict, path: Path) -> bool:
    """Left: loss per step, one line per strategy.  Right: mean step time per strategy as
    compute + communication, measured, with the model's predicted step beside it."""
    from psrt.bench import report
    figure = report.panels(2)
    if figure is None:
        return False
    plt, fig, (left, right) = figure
    styles = {"ps": dict(color="tab:red", lw=3, alpha=0.5), "ring": dict(color="tab:blue", lw=1.2, ls="--")}
    for dp, run in runs.items():
        left.plot([r["step"] for r in run["steps"]], [r["loss"] for r in run["steps"]], label=dp,
                  **styles.get(dp, {}))
    report.label(left, "training loss (the same training: the lines coincide)", "step", "loss")
    names = list(runs)
    x = range(len(names))
    compute = [mean(r["compute_s"] for r in runs[d]["steps"]) * 1e3 for d in names]
    step = [step_s(runs[d]) * 1e3 for d in names]
    comm = [max(s - c, 0.0) for s, c in zip(step, compute)]
    right.bar([i - 0.2 for i in x], compute, width=0.38, color="tab:gray", label="compute (measured)")
    right.bar([i - 0.2 for i in x], comm, width=0.38, bottom=compute, color="tab:orange",
              label="communication and waiting (measured)")
    predicted = [runs[d]["summary"].get("pred_step_s") for d in names]
    if all(p is not None for p in predicted):
        right.bar([i + 0.2 for i in x], [p * 1e3 for p in predicted], width=0.38, color="none",
                  edgecolor="black", hatch="//", label="alpha-beta prediction")
    right.set_xticks(list(x), names)
    report.label(right, "time per step" + (f": ring = {step[1] / step[0]:.2f}x ps" if names == ["ps", "ring"] else ""),
                 "strategy", "ms")
    return report.save(plt, fig, path)


def mean(values) -> float:
    values = list(values)
    return sum(values) / max(len(values), 1)
