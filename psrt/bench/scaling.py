"""`python -m psrt.bench scaling`: every strategy's speed-up from 1 to 16 workers on emulated
accelerator hosts, beside the model's prediction.

Each layout (hosts x ranks per host: 1x1, 2x1, 2x2, 4x2, 4x4) is an emulated cluster
(psrt.launch.cluster, links shaped to --rate) running psrt.train on a profile
(psrt/train/emulated.py): compute is timed waits, communication is real MPI.  Each worker
trains the profile's own batch (weak scaling, as data parallelism is used), so the speed-up
of W workers is W x the one-worker step over the W-worker step.  The profile is dilated
(--stands-for): its gradient tensors divided by K (--byte-divisor, or per profile:
`divisor_for`) and its compute times multiplied by D = B_real / (K x B_emulated), so that
the emulated link keeps the ratio of compute to communication of a cluster whose links
carry B_real; every time in the table is the emulated one, and a stands-for line per
profile says which cluster its rows stand for (latency is not dilated:
docs/explanation/scaling.md).

Per cell: the step (median over the steps after the first), speed-up, efficiency, what
bound it (cpu where the ranks waited for cores: psrt/train/cpu_load.py, never a network
result), the model's step (psrt/bench/step_model.py, with alpha and beta from the run's own
ping-pong) and its error.  --plot draws speed-up against workers.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from psrt.bench import jobs
from psrt.bench.step_model import VARIANTS, bucket_bytes, gradient_buckets, placement, predict_step, speedup, units
from psrt.collectives import cost
from psrt.launch.delay_line import delay_ns
from psrt.train.report import Progress

HELP = ("speed-up of every strategy from 1 to 16 workers on emulated accelerator hosts (--profile), "
        "measured beside the model (root; runs its own MPI jobs)")
SUBNET = "198.18.9.0/24"
LAYOUTS = ((1, 1), (2, 1), (2, 2), (4, 2), (4, 4))
STRATEGIES = ("ring", "native", "zero1", "zero3", "ps", "ps-sharded")
MULTI = ("ring-hier", "ps-local", "ring-auto")       # on hosts of several ranks only
DEFAULTS = {"layouts": "1x1,2x1,2x2,2x4,4x2,4x4", "strategies": ",".join(STRATEGIES), "profiles": "resnet50,vgg16",
            "steps": 10}
QUICK = {"layouts": LAYOUTS[:4], "strategies": ("ring", "zero1", "ps"), "profiles": ["resnet50"], "steps": 8}


# What each profile's gradients are divided down to by default (`divisor_for`).  What the
# emulation adds to every message (a wait for a core on a crowded host, the TCP stack's
# handshakes) is not dilated, so it weighs against the emulated step, whose link time
# follows the divided gradients: divided to one size, every profile's step carries about
# the same share of it, the share VGG-16 carries at K = 32 (docs/explanation/scaling.md,
# "Time dilation", has the two runs of ResNet-50 that show it).
GRADIENT_TARGET = 16 << 20


def divisor_for(prof, target: float = GRADIENT_TARGET) -> float:
    """The default K of a profile: the power of two that divides its gradients nearest
    (as a ratio) to `target` bytes; 1 for gradients at or under it."""
    return float(2 ** max(0, round(math.log2(prof.grad_bytes() / target))))


@dataclass(frozen=True)
class Scale:
    """A profile's dilation in a run: gradients divided by `divisor`, compute x `dilation`."""
    divisor: float
    dilation: float


def scale_of(args, prof) -> Scale:
    """--byte-divisor, or the profile's own (`divisor_for`), and the time dilation that keeps
    --stands-for's ratio of compute to communication: D = B_real / (K x B_emulated)."""
    k = args.byte_divisor or divisor_for(prof)
    return Scale(k, rate_bits(args.stands_for) / (k * rate_bits(args.rate)))


@dataclass(frozen=True)
class Cell:
    profile: str
    hosts: int
    per_host: int
    strategy: str

    @property
    def workers(self) -> int:
        return self.hosts * self.per_host

    @property
    def layout(self) -> str:
        return f"{self.hosts}x{self.per_host}"


def rate_bits(rate: str) -> float:
    from psrt.launch.cluster import rate_bytes
    return 8 * rate_bytes(rate)


def train_argv(profile: str, args, scale: Scale, dps: list[str], workers: int, metrics: str,
               extra: list[str]) -> list[str]:
    from psrt.train.profile import load
    batch = load(profile).batch * workers
    return [sys.executable, "-m", "psrt.train", "--profile", profile, "--time-dilation", f"{scale.dilation:g}",
            "--byte-divisor", f"{scale.divisor:g}", "--dp", ",".join(dps), "--steps", str(args.steps),
            "--batch-size", str(batch), "--quiet", "--metrics", metrics, *extra,
            *(["--bucket-mb", f"{args.bucket_mb:g}"] if args.bucket_mb is not None else [])]


def read_metrics(path_for, dps: list[str]) -> dict:
    """{dp: (median step seconds after the first, summary row)} from the metrics files."""
    out = {}
    for dp in dps:
        path = path_for(dp)
        if not os.path.exists(path):
            continue
        lines = [json.loads(line) for line in open(path) if line.strip()]
        steps = [r for r in lines if "step" in r and "summary" not in r]
        times = [b["time_s"] - a["time_s"] for a, b in zip(steps, steps[1:])]
        summary = next((r for r in lines if r.get("summary")), {})
        out[dp] = (statistics.median(times) if times else summary.get("wall_s", 0) / max(summary.get("steps", 1), 1),
                   summary)
    return out


def launches(strategies: list[str]) -> list[list[str]]:
    """The cells grouped into launches: a launch trains each of its --dp once, so the flat
    strategies go together and the variants (one --dp with a flag of their own) are packed
    so that no --dp repeats in one launch."""
    out = [[s for s in strategies if s not in VARIANTS]]
    for s in (s for s in strategies if s in VARIANTS):
        home = next((group for group in out[1:] if VARIANTS[s][0] not in (VARIANTS[g][0] for g in group)), None)
        if home is None:
            out.append([s])
        else:
            home.append(s)
    return [group for group in out if group]


def measure_layout(profile: str, hosts: int, per_host: int, args, scale: Scale, strategies: list[str]) -> dict:
    """{cell strategy: (step seconds, summary row)} of one layout (`launches`)."""
    from psrt.launch import cluster as C
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        if hosts * per_host == 1:                # one worker: every strategy is the same step
            argv = train_argv(profile, args, scale, ["ring"], 1, os.path.join(tmp, "one.jsonl"), [])
            subprocess.run(argv, stdin=subprocess.DEVNULL, env=jobs.rank_env(), check=True)
            got = read_metrics(lambda dp: os.path.join(tmp, "one.jsonl"), ["ring"])["ring"]
            return {s: got for s in strategies}
        names = tuple(f"{args.prefix}{i}" for i in range(hosts))
        with C.running(C.Cluster(names, args.subnet, args.rate, args.delay)) as cluster:
            for k, cells in enumerate(launches(strategies)):
                dps = [VARIANTS[c][0] if c in VARIANTS else c for c in cells]
                extra = [f for c in cells if c in VARIANTS for f in VARIANTS[c][1]]
                metrics = os.path.join(tmp, f"launch{k}.jsonl")
                argv = train_argv(profile, args, scale, dps, hosts * per_host, metrics, extra)
                code = jobs.run_on_cluster(cluster, [(n, per_host) for n in names], argv)
                if code != 0:
                    print(f"psrt.bench scaling: {profile} {hosts}x{per_host} {' '.join(cells)} failed (exit {code})",
                          file=sys.stderr, flush=True)
                    continue
                stem = metrics[:-len(".jsonl")]
                got = read_metrics(lambda dp: f"{stem}.{dp}.jsonl" if len(dps) > 1 else metrics, dps)
                found.update({c: got[dp] for c, dp in zip(cells, dps) if dp in got})
    return found


def links_of(summary: dict, hosts: int, per_host: int) -> cost.Links | None:
    """The run's fitted link (its ping-pong, in the summary) between hosts; inside a host the
    shared-memory default (psrt.collectives.cost.DEFAULT_LINKS), crowded by the ranks per core."""
    if "alpha_s" not in summary:
        return None
    inter = cost.Fit(summary["alpha_s"], summary["beta_s_per_byte"], 1.0)
    crowd = max(1.0, hosts * per_host / (os.cpu_count() or 1))
    return cost.Links(cost.DEFAULT_LINKS.intra, inter, crowd)


def run(args) -> dict:
    from psrt.train.profile import load
    rows = []
    todo = [(p, h, r) for p in args.profiles for h, r in args.layouts]
    progress = Progress(len(todo), "scaling", enabled=not args.quiet, unit="layouts")
    for i, (profile, hosts, per_host) in enumerate(todo):
        strategies = list(args.strategies) + (list(MULTI) if per_host > 1 else [])
        scale = scale_of(args, load(profile))
        measured = measure_layout(profile, hosts, per_host, args, scale, strategies)
        prof = load(profile).dilated(scale.dilation, scale.divisor)
        # a launch of one strategy measures no link (psrt.train fits it when comparing): the
        # layout's fit from another launch stands for it
        fitted = next((sm for _, sm in measured.values() if "alpha_s" in sm), {})
        for s, (step_s, summary) in measured.items():
            rows.append({"profile": profile, "layout": f"{hosts}x{per_host}", "hosts": hosts, "per_host": per_host,
                         "workers": hosts * per_host, "strategy": s, "step_s": step_s,
                         "cpu_bound": bool(summary.get("cpu_bound")), "run_queue": summary.get("run_queue"),
                         "grad_bytes": summary.get("grad_bytes", prof.grad_bytes()),
                         "links": links_of(summary if "alpha_s" in summary else fitted, hosts, per_host),
                         "prof": prof})
        progress.update(i + 1, f"{profile} {hosts}x{per_host}")
    return assemble(rows, args)


def assemble(rows: list[dict], args) -> dict:
    """Speed-up, efficiency, bound and prediction of every measured cell.

    The model's step is the profile's compute and the strategy's communication; what a
    worker's step also does on the host (the update, the loop's own work) is the one-worker
    cell's step less the profile's compute, measured in the same run and added to every
    cell of more workers (`host_s`).  The one-worker cell is predicted without it, so its
    error shows that work's share."""
    out, scales = [], {}
    for r in rows:
        one = next((o for o in rows if o["profile"] == r["profile"] and o["workers"] == 1), None)
        prof, links = r.pop("prof"), r.pop("links")
        scales[r["profile"]] = Scale(1 / prof.byte_scale, prof.dilation)
        compute = prof.forward_s + prof.backward_s
        host = max(0.0, one["step_s"] - compute) if one else 0.0
        pred = None
        if r["workers"] == 1:
            pred = compute
        elif links is not None:
            p = predict_step(r["strategy"], prof.forward_s, prof.backward_s,
                             placement(r["hosts"], r["per_host"]), r["grad_bytes"], links,
                             gradient_buckets(prof, bucket_bytes(args.bucket_mb)), units(prof))
            pred = p.step_s + host if p else None
            r["model_bound"] = p.bound if p else None
            r["host_s"] = host
        r["predicted_s"] = pred
        r["error"] = (r["step_s"] - pred) / pred if pred else None
        r["speedup"] = speedup(r["workers"], one["step_s"], r["step_s"]) if one else None
        r["efficiency"] = r["speedup"] / r["workers"] if r["speedup"] else None
        r["predicted_speedup"] = speedup(r["workers"], compute + (host if r["workers"] > 1 else 0.0), pred) if pred else None
        r["bound"] = "cpu" if r["cpu_bound"] else r.get("model_bound", "compute")
        out.append(r)
    for r in out:                 # auto against the fastest ring measured on the same layout
        if r["strategy"] == "ring-auto":
            rings = [o["step_s"] for o in out if (o["profile"], o["layout"]) == (r["profile"], r["layout"])
                     and o["strategy"] in ("ring", "ring-hier")]
            r["auto_vs_fastest"] = r["step_s"] / min(rings) - 1 if rings else None
    return {"rows": out, "stands_for": {p: stands_for(args.rate, p, s, args.delay) for p, s in scales.items()},
            "scales": {p: {"byte_divisor": s.divisor, "dilation": s.dilation} for p, s in scales.items()},
            "rate": args.rate, "bucket_mb": args.bucket_mb, "cores": os.cpu_count()}


def stands_for(rate: str, profile: str, scale: Scale, delay: str | None = None) -> str:
    real = scale.dilation * scale.divisor * rate_bits(rate)
    if delay:      # a delay the user set is dilated with the rest: it stands for delay / D
        us = delay_ns(delay) / 1e3 / scale.dilation
        latency = (f"links' one-way delay {delay}, which stands for "
                   + (f"{us / 1e3:.3g} ms there" if us >= 1000 else f"{us:.3g} us there"))
    else:
        latency = "latency not dilated"
    return (f"{profile}: emulated links of {rate}; gradients /{scale.divisor:g} and compute x{scale.dilation:g}: "
            f"its rows stand for the same accelerators on links of {real / 1e9:g} Gbit/s with the profile's real "
            f"gradient sizes, step times {scale.dilation:g}x shorter than shown ({latency})")


COLUMNS = [("profile", "profile", ""), ("layout", "hosts x ranks", ""), ("workers", "workers", "d"),
           ("strategy", "strategy", ""), ("step_s", "step (s)", ".3f"), ("speedup", "speed-up", ".2f"),
           ("efficiency", "efficiency", ".0%"), ("bound", "bound by", ""), ("predicted_s", "predicted (s)", ".3f"),
           ("error", "error", "+.0%"), ("predicted_speedup", "predicted speed-up", ".2f"),
           ("auto_vs_fastest", "auto vs fastest ring", "+.0%")]


def plot(payload: dict, path) -> bool:
    """Speed-up against workers: the ideal line, measured points (hollow where CPU-bound),
    predicted lines, one colour per strategy, one panel per profile.  Workers on a log
    scale, speed-up up to a little over the highest point, so that the strategies, not the
    ideal line, fill the panel; a dotted line at 1, below which a strategy is slower than
    one worker."""
    from psrt.bench.report import label, panels, save
    profiles = list(dict.fromkeys(r["profile"] for r in payload["rows"]))
    made = panels(len(profiles), 6.0, 4.5)
    if made is None:
        return False
    plt, fig, axes = made
    for ax, profile in zip(axes, profiles):
        rows = [r for r in payload["rows"] if r["profile"] == profile and r["speedup"]]
        workers = sorted({r["workers"] for r in rows})
        top = max(max(r["speedup"], r["predicted_speedup"] or 0) for r in rows)
        ax.plot(workers, workers, "k--", alpha=0.4, label="ideal")
        ax.axhline(1.0, color="k", linestyle=":", alpha=0.5)
        for k, s in enumerate(dict.fromkeys(r["strategy"] for r in rows)):
            colour = f"C{k}"
            pts = sorted((r["workers"], r["speedup"], r["predicted_speedup"], r["cpu_bound"])
                         for r in rows if r["strategy"] == s)
            for j, (w, up, _, cpu) in enumerate(pts):     # hollow: CPU-bound, not a network result
                ax.plot([w], [up], "o", color=colour, markerfacecolor="none" if cpu else colour,
                        markersize=9 if cpu else 6, zorder=3 if cpu else 2,
                        label=f"{s} measured" if j == 0 else None)
            pred = [(p[0], p[2]) for p in pts if p[2]]
            if pred:
                ax.plot([p[0] for p in pred], [p[1] for p in pred], "-", color=colour, alpha=0.6)
        ax.set_xscale("log", base=2)
        ax.set_xticks(workers, [str(w) for w in workers])
        label(ax, f"{profile}: speed-up (lines: model; hollow: CPU-bound)", "workers", "speed-up")
        ax.set_ylim(0, 1.2 * top)
        ax.legend(fontsize=7, loc="upper left")
    return save(plt, fig, path)


def add_arguments(p) -> None:
    p.add_argument("--profiles", default=DEFAULTS["profiles"], help="shipped profiles or files (comma list)")
    p.add_argument("--strategies", default=DEFAULTS["strategies"], help="flat strategies (comma list); "
                   "ring-hier and ps-local are added on hosts of several ranks")
    p.add_argument("--layouts", default=DEFAULTS["layouts"], help="hosts x ranks per host (comma list)")
    # A slow link and small gradients, rather than 1 Gbit/s and 4x the bytes, for the same
    # step times: every byte a rank copies, reduces or pushes through the TCP stack costs this
    # machine's shared cores, the link's time does not (docs/explanation/scaling.md).
    p.add_argument("--rate", default="250mbit", help="emulated link rate (tc syntax)")
    p.add_argument("--delay", help="one-way delay of every host's link (tc syntax: 500us, 2ms; netem, or "
                   "psrt's delay line where the kernel has none): makes small messages latency-bound")
    p.add_argument("--byte-divisor", type=float, help="gradient tensors divided by K (default: per profile, "
                   f"the power of two that brings its gradients nearest {GRADIENT_TARGET >> 20} MiB)")
    p.add_argument("--stands-for", default="25gbit", help="the real cluster's link rate: sets the time "
                   "dilation D = rate / (K x --rate)")
    p.add_argument("--bucket-mb", type=float, help="DDP's bucket size in MiB, of the divided gradients "
                   "(psrt.train --bucket-mb, default its own); small buckets make the rings latency-bound")
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    p.add_argument("--prefix", default="psrt-s", help="name prefix of the emulated hosts")
    p.add_argument("--subnet", default=SUBNET, help="inside 198.18.0.0/15")
    p.add_argument("--quick", action="store_true", help="resnet50, ring/zero1/ps (+ring-hier, ps-local), "
                   "up to 8 workers, 8 steps, where those flags are not given")
    p.add_argument("--predict", action="store_true", help="no measurement: the model's table from 32 to "
                   "1024 workers on --preset (psrt/bench/scaling_prediction.py); needs no root")
    p.add_argument("--preset", default="dgx-a100,pcie-25g,emulated", help="with --predict: cluster presets "
                   "(dgx-a100, pcie-25g, emulated) or your own .json/.toml (comma list)")
    p.add_argument("--workers", default="32,64,128,256,512,1024", help="with --predict: worker counts")
    p.add_argument("--json")
    p.add_argument("--plot", help="PNG of speed-up against workers")
    p.add_argument("--quiet", action="store_true")


def check(args) -> None:
    import re
    from psrt.bench.report import need
    from psrt.launch.cluster import RATE
    from psrt.train.profile import load
    if args.quick:              # the quick settings, where the command line left the defaults
        quick = {"layouts": ",".join(f"{h}x{r}" for h, r in QUICK["layouts"]),
                 "strategies": ",".join(QUICK["strategies"]), "profiles": ",".join(QUICK["profiles"]),
                 "steps": QUICK["steps"]}
        for name, value in quick.items():
            if getattr(args, name) == DEFAULTS[name]:
                setattr(args, name, value)
    need(bool(RATE.match(args.rate)) and bool(RATE.match(args.stands_for)),
         f"--rate {args.rate} / --stands-for {args.stands_for}: expected tc rates such as 1gbit, 25gbit")
    texts = [t.strip() for t in args.layouts.split(",") if t.strip()]
    need(texts and all(re.fullmatch(r"\d+x\d+", t) for t in texts),
         f"--layouts {args.layouts}: expected hosts x ranks per host, e.g. 1x1,2x2")
    args.layouts = [tuple(map(int, t.split("x"))) for t in texts]
    need(all(h >= 1 and r >= 1 and (h == r == 1 or h >= 2) for h, r in args.layouts),
         f"--layouts {','.join(texts)}: one worker is 1x1; more need at least 2 hosts")
    need((1, 1) in args.layouts, "--layouts: include 1x1, the one-worker step every speed-up is over")
    from psrt.dp import STRATEGIES as KNOWN
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in args.strategies if s not in KNOWN or s in ("ps-async", "horovod", "torch")]
    need(not bad, f"--strategies {','.join(bad)}: choose from ring, native, zero1, zero2, zero3, ps, ps-sharded")
    args.profiles = [p.strip() for p in args.profiles.split(",") if p.strip()]
    for p in args.profiles:
        load(p)
    if args.delay is not None:
        try:
            delay_ns(args.delay)
        except ValueError as err:
            need(False, str(err))
    need(args.steps >= 2, f"--steps {args.steps}: at least 2 (the first is set-up)")
    need(args.byte_divisor is None or args.byte_divisor >= 1, f"--byte-divisor {args.byte_divisor}: at least 1")
    need(args.bucket_mb is None or args.bucket_mb > 0, f"--bucket-mb {args.bucket_mb}: more than 0")


def predict_command(args) -> int:
    """--predict: the model's table on each preset, nothing measured."""
    from psrt.bench import presets, report, scaling_prediction
    from psrt.bench.report import need
    from psrt.train.profile import load
    texts = [t.strip() for t in args.workers.split(",") if t.strip()]
    need(texts and all(t.isdigit() and int(t) >= 1 for t in texts), f"--workers {args.workers}: expected counts, e.g. 32,64")
    chosen = [presets.load(p.strip()) for p in args.preset.split(",") if p.strip()]
    profiles = [load(p.strip()) for p in args.profiles.split(",") if p.strip()]
    rows = []
    for preset in chosen:
        print(f"# {preset['name']}: {preset['per_node']} per node; inside {preset['intra_gbit_s']:g} Gbit/s, "
              f"alpha {preset['intra_alpha_us']:g} us; between nodes {preset['inter_gbit_s']:g} Gbit/s per node, "
              f"alpha {preset['inter_alpha_us']:g} us. {preset['source']}")
        for prof in profiles:
            rows += scaling_prediction.rows(prof, preset, [int(t) for t in texts])
    for prof in profiles:
        print(f"# {prof.describe()}")
    report.table(rows, scaling_prediction.COLUMNS)
    if args.json:
        report.write_json(args.json, {"rows": rows, "presets": chosen})
    return 0


@contextlib.contextmanager
def _children_on_stderr():
    """Each launch's own summary goes to stderr, beside the progress: stdout is the bench's
    table and goals alone (what `make bench` publishes)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def command(args) -> int:
    if args.predict:
        return predict_command(args)
    check(args)
    from psrt.bench import report
    from psrt.launch import cluster as C
    C.require_netns()
    with _children_on_stderr():
        payload = run(args)
    for line in payload["stands_for"].values():
        print(f"# {line}")
    print(f"# this machine: {payload['cores']} cores; a cell 'bound by cpu' waited for cores (not a network result)")
    report.table(payload["rows"], COLUMNS)
    from psrt.bench import goal, scaling_goals
    judged = scaling_goals.goals(payload)
    goal.print_goals(judged)
    payload["goals"] = goal.rows(judged)
    if args.json:
        report.write_json(args.json, payload)
    if args.plot:
        plot(payload, args.plot)
    return 0
