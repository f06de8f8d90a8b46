"""The network-bound regime: parameter server vs ring all-reduce on emulated hosts joined by
shaped links, measured next to the alpha-beta model's prediction.

For each link rate (tc, e.g. 1gbit and 100mbit) the driver brings up an emulated cluster
(psrt.cluster: one network namespace per host, each host's link shaped both ways), fits
alpha and beta from a ping-pong between two hosts, and times the all-reduce of M bytes with
`ps`, `ring`, `hierarchical` and `native` on 2..8 hosts of one rank each, and on hosts of
several ranks (`--layouts`, default 2x4 as hostfiles/two_nodes, and 4x2), where only the
traffic between the hosts crosses a shaped link.  Beside every row stands the two-level
prediction (cost.predict_two_level): alpha and beta fitted between two hosts and between two
ranks of one host, and the wait of ranks that outnumber the machine's cores.  The same jobs on
unshaped links give the floor this machine's cores set (copies through the kernel and the
reductions): a prediction is checked only where that floor is small next to the
measurement, that is where the network, not the CPU, is the bottleneck.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from psrt.bench import jobs
from psrt.bench.goal import Goal
from psrt.collectives import cost as alpha_beta
from psrt.train.report import Progress, fmt_bytes

ALGORITHMS = ("ps", "ring", "hierarchical", "native")
SUBNET = "198.18.7.0/24"
NETWORK_BOUND = 0.25   # floor / measured below this: the row is network-bound
TOLERANCE = 0.20       # the model's promise for large messages


@dataclass(frozen=True)
class Layout:
    """Hosts and ranks per host of one measurement."""
    hosts: int
    per_host: int

    @property
    def ranks(self) -> int:
        return self.hosts * self.per_host

    @property
    def name(self) -> str:
        return f"{self.hosts}x{self.per_host}"

    def host_of(self) -> list[int]:
        return [r // self.per_host for r in range(self.ranks)]


def defaults(quick: bool = False, quiet: bool = False):
    """The regime's settings as `python -m psrt.bench network` has them (and --quick): read
    from the command's own parser, so that every option it gains is here too."""
    import argparse
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    ns = parser.parse_args(["--quiet"] * quiet + ["--quick"] * quick)
    check(ns)
    return quicken(ns) if quick else ns


def quicken(ns):
    """--quick: 1gbit only, 2 and 8 hosts, 16 MiB, one repeat, no floor (so no model check)."""
    ns.rates, ns.host_counts, ns.size = ["1gbit"], [2, 8], 16 << 20
    ns.layouts, ns.floor, ns.repeats, ns.warmup = [], False, 1, 0
    return ns


def size_for(rate: str, fastest: str, size: int) -> int:
    """`size` at the fastest rate; slower links get proportionally less (a power of two, at
    least 1 MiB), so every rate takes about as long."""
    from psrt.launch.cluster import rate_bytes
    scaled = size * rate_bytes(rate) / rate_bytes(fastest)
    return max(1 << 20, min(size, 1 << int(math.log2(max(scaled, 1)))))


def groups(args) -> list[tuple[str | None, int, list[Layout]]]:
    """[(rate, or None for unshaped links; ranks per host; layouts)], one emulated cluster
    each, in the order they run."""
    layouts = [Layout(h, 1) for h in args.host_counts] + list(args.layouts)
    return [(rate, per_host, [lay for lay in layouts if lay.per_host == per_host])
            for rate in args.rates + ([None] if args.floor else [])
            for per_host in sorted({lay.per_host for lay in layouts})]


def run(args) -> dict:
    """Every measurement, fit and prediction of the regime; returns the report payload."""
    from psrt.launch import cluster as C
    C.require_netns()
    fastest = max(args.rates, key=C.rate_bytes)
    sizes = {rate: size_for(rate, fastest, args.size) for rate in args.rates}
    todo = groups(args)
    progress = Progress(sum(len(lays) + (rate is not None) for rate, _, lays in todo), "network",
                        enabled=not args.quiet, unit="jobs")
    done = 0
    fits, measured = {}, []
    for rate, per_host, lays in todo:
        names = tuple(f"{args.prefix}{i}" for i in range(max(lay.hosts for lay in lays)))
        with C.running(C.Cluster(names, args.subnet, rate)) as cluster:
            if rate is not None:
                # Between two hosts, and (for hosts of several ranks) between two ranks of one.
                pairs = {"": [(names[0], 1), (names[1], 1)]} | ({"/intra": [(names[0], 2)]} if per_host > 1 else {})
                for key, where in pairs.items():
                    pp = jobs.on_cluster(cluster, where, ["pingpong", "--quiet", "--min-size", "8",
                                                          "--max-size", "16MiB", "--repeats", str(args.repeats)])
                    fits[f"{rate}/{per_host}{key}"] = alpha_beta.fit(pp["points"])
                done += 1
                progress.update(done, f"ping-pong {rate}")
            # The unshaped floor is measured at every size the shaped runs use.
            want = sorted(set(sizes.values())) if rate is None else [sizes[rate]]
            for lay in lays:
                out = jobs.on_cluster(cluster, [(names[h], lay.per_host) for h in range(lay.hosts)],
                                      ["collectives", "--quiet", "--algorithms", ",".join(ALGORITHMS),
                                       "--sizes", ",".join(map(str, want)), "--warmup", str(args.warmup),
                                       "--repeats", str(args.repeats)])
                measured += [dict(row, rate=rate, layout=lay.name, hosts=lay.hosts, per_host=lay.per_host)
                             for row in out["rows"]]
                done += 1
                progress.update(done, f"{rate or 'unshaped'} {lay.name}")
    return assemble(fits, sizes, measured)


def assemble(fits: dict, sizes: dict, measured: list[dict]) -> dict:
    """Rows of measured vs predicted time, with the unshaped floor beside them."""
    floor = {(r["layout"], r["algorithm"], r["nbytes"]): r["time_us"] / 1e6
             for r in measured if r["rate"] is None}
    rows = []
    for r in measured:
        if r["rate"] is None:
            continue
        lay = Layout(r["hosts"], r["per_host"])
        fit = fits[f"{r['rate']}/{lay.per_host}"]
        pred = alpha_beta.predict(r["algorithm"], lay.ranks, r["nbytes"], lay.host_of(), fit) \
            if r["algorithm"] in ("ps", "ring") else None
        two = two_level(r["algorithm"], lay, r["nbytes"], fits, r["rate"])
        t = r["time_us"] / 1e6
        fl = floor.get((r["layout"], r["algorithm"], r["nbytes"]))
        bound = fl is not None and fl / t < NETWORK_BOUND
        rows.append({"rate": r["rate"], "layout": r["layout"], "hosts": r["hosts"], "per_host": lay.per_host,
                     "ranks": lay.ranks, "algorithm": r["algorithm"], "nbytes": r["nbytes"],
                     "size": fmt_bytes(r["nbytes"]), "measured_s": t, "measured_min_s": r["time_min_us"] / 1e6,
                     "predicted_s": pred, "error": (t - pred) / pred if pred else None,
                     "two_level_s": two, "two_level_error": (t - two) / two if two else None, "floor_s": fl,
                     "network_bound": bound, "bound": "network" if bound else "cpu" if fl else "-",
                     "wrong": r["wrong"]})
    return {"rows": rows, "fits": {k: vars(v) for k, v in fits.items()}, "sizes": sizes}


def two_level(algorithm: str, lay: Layout, nbytes: int, fits: dict, rate: str) -> float | None:
    """The two-level model's time of one row, or None for an algorithm it has no rounds for.
    Every emulated host shares this machine's cores, so crowding counts all the job's ranks."""
    import os
    if algorithm not in alpha_beta.TWO_LEVEL:
        return None
    inter = fits[f"{rate}/{lay.per_host}"]
    intra = fits.get(f"{rate}/{lay.per_host}/intra", inter)
    links = alpha_beta.Links(intra, inter, crowd=max(1.0, lay.ranks / (os.cpu_count() or 1)))
    return alpha_beta.predict_two_level(algorithm, lay.host_of(), nbytes, links)


COLUMNS = [("rate", "link", ""), ("layout", "hosts x ranks", ""), ("size", "size", ""),
           ("algorithm", "algorithm", ""), ("measured_s", "measured (s)", ".3f"),
           ("predicted_s", "predicted (s)", ".3f"), ("error", "error", "+.0%"),
           ("two_level_s", "two-level (s)", ".3f"), ("two_level_error", "error", "+.0%"),
           ("floor_s", "unshaped (s)", ".3f"), ("bound", "bound by", ""), ("wrong", "#wrong", "d")]


def goals(payload: dict) -> list[Goal]:
    """The regime's promises, as ratios measured in this run."""
    rows = payload["rows"]
    out = []
    for rate in dict.fromkeys(r["rate"] for r in rows):
        counts = sorted({r["hosts"] for r in rows if r["rate"] == rate and r["per_host"] == 1})
        if counts and counts[-1] >= 8:
            ps, ring = _at(rows, rate, counts[-1], 1, "ps"), _at(rows, rate, counts[-1], 1, "ring")
            out.append(Goal(f"{rate}, {counts[-1]} hosts: ring >= 3x faster than ps", "ring", "ps", ">=", 3.0,
                            ps["measured_s"] / ring["measured_s"]))
        if len(counts) > 1:
            out += growth_goals(rows, rate, counts[0], counts[-1])
        ps, ring = _at(rows, rate, 2, 4, "ps"), _at(rows, rate, 2, 4, "ring")
        if ps and ring:
            out.append(Goal(f"{rate}, two_nodes (2x4): ps/ring near the model's 2.3x", "ring", "ps", ">=", 2.0,
                            ps["measured_s"] / ring["measured_s"]))
        out += hierarchical_goals(rows, rate)
        checked = [r for r in rows if r["rate"] == rate and r["predicted_s"] and r["network_bound"]]
        if checked:
            worst = max(checked, key=lambda r: abs(r["error"]))
            out.append(Goal(f"{rate}: alpha-beta within {TOLERANCE:.0%} where network-bound ({len(checked)} rows)",
                            f"{worst['layout']} {worst['algorithm']}", "alpha-beta prediction", "within", TOLERANCE,
                            1 + worst["error"], worst=True, detail=f"({worst['layout']} {worst['algorithm']})"))
    return out


def hierarchical_goals(rows: list[dict], rate: str) -> list[Goal]:
    """Hosts of several ranks, at 16 MiB or more: hierarchical against the flat ring (2x4:
    1.5x and within 20% of its two-level prediction; 4x2: 1.3x)."""
    out = []
    for (hosts, per_host), want in (((2, 4), 1.5), ((4, 2), 1.3)):
        pick = {r["algorithm"]: r for r in rows if (r["rate"], r["hosts"], r["per_host"]) == (rate, hosts, per_host)
                and r["nbytes"] >= 16 << 20}
        if "ring" not in pick or "hierarchical" not in pick:
            continue
        h = pick["hierarchical"]
        out.append(Goal(f"{rate}, {hosts}x{per_host}, {h['size']}: hierarchical >= {want}x faster than ring",
                        "hierarchical", "ring", ">=", want, pick["ring"]["measured_s"] / h["measured_s"]))
        if (hosts, per_host) == (2, 4) and h["two_level_s"]:
            out.append(Goal(f"{rate}, 2x4, {h['size']}: hierarchical within {TOLERANCE:.0%} of its two-level model",
                            "hierarchical", "its two-level prediction", "within", TOLERANCE,
                            1 + h["two_level_error"]))
    return out


def _at(rows: list[dict], rate, hosts: int, per_host: int, algo: str) -> dict | None:
    return next((r for r in rows if (r["rate"], r["hosts"], r["per_host"], r["algorithm"])
                 == (rate, hosts, per_host, algo)), None)


def growth_goals(rows: list[dict], rate, lo: int, hi: int) -> list[Goal]:
    """Time from the fewest hosts to the most, against the model's growth: the ring's per-link
    bytes 2(N-1)/N x M stay below 2M (nearly flat), the server's link carries (N-1)M (linear).
    Judged only where every row is network-bound."""
    pair = {(h, a): _at(rows, rate, h, 1, a) for h in (lo, hi) for a in ("ring", "ps")}
    (rg, rm), (pg, pm) = [(pair[hi, a]["measured_s"] / pair[lo, a]["measured_s"],
                           pair[hi, a]["predicted_s"] / pair[lo, a]["predicted_s"]) for a in ("ring", "ps")]
    bound = all(r["network_bound"] for r in pair.values())
    why = "" if bound else "(no unshaped runs: not judged)" if any(r["floor_s"] is None for r in pair.values()) \
        else "(CPU-bound rows: not judged)"
    head = f"{rate}, {lo} -> {hi} hosts"
    return [Goal(f"{head}: ring nearly flat (model {rm:.2f}x): its time grows <= 2x", f"ring at {hi} hosts",
                 f"ring at {lo} hosts", "<=", 2.0, rg, detail=why, judged=bound),
            Goal(f"{head}: ps linear (model {pm:.2f}x): its time grows >= 0.7x the model's", f"ps at {hi} hosts",
                 f"ps at {lo} hosts, times the model's growth", ">=", 0.7, pg / pm,
                 detail=f"(grew {pg:.2f}x)" + (f" {why}" if why else ""), judged=bound)]


def fit_lines(payload: dict) -> list[str]:
    """One line per fitted link: alpha, beta and the bandwidth beta stands for."""
    return [f"{key.split('/')[0]} links ({describe_fit(key)}): "
            f"alpha = {f['alpha_s'] * 1e6:.0f} us, beta = {f['beta_s_per_byte'] * 1e9:.2f} ns/B "
            f"({1e-6 / f['beta_s_per_byte']:.0f} MB/s), r2 = {f['r2']:.4f}" for key, f in payload["fits"].items()]


def describe_fit(key: str) -> str:
    parts = key.split("/")
    if len(parts) > 2:
        return f"two ranks of one host, hosts of {parts[1]} ranks"
    return "hosts of 1 rank" if parts[1] == "1" else f"between hosts of {parts[1]} ranks"


def print_report(payload: dict) -> None:
    from psrt.bench.report import table
    for line in fit_lines(payload):
        print(f"# {line}")
    table(payload["rows"], COLUMNS)


def plot(payload: dict, path) -> bool:
    """All-reduce time vs hosts, PS and ring measured (points) and predicted (lines)."""
    from psrt.bench.report import label, panels, save
    rates = list(dict.fromkeys(r["rate"] for r in payload["rows"]))
    made = panels(len(rates), 5.2)
    if made is None:
        return False
    plt, fig, axes = made
    for ax, rate in zip(axes, rates):
        for algo, colour in (("ps", "tab:red"), ("ring", "tab:blue"), ("native", "tab:gray")):
            pts = sorted((r["hosts"], r["measured_s"], r["predicted_s"]) for r in payload["rows"]
                         if r["rate"] == rate and r["algorithm"] == algo and r["per_host"] == 1)
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", color=colour, label=f"{algo} measured")
            if pts[0][2] is not None:
                ax.plot([p[0] for p in pts], [p[2] for p in pts], "-", color=colour, alpha=0.6,
                        label=f"{algo} alpha-beta")
        size = next(r["nbytes"] for r in payload["rows"] if r["rate"] == rate)
        label(ax, f"allreduce {fmt_bytes(size)}, {rate} links, 1 rank per host", "hosts", "time (s)")
    return save(plt, fig, path)


HELP = "ps vs ring on emulated hosts with shaped links, against the alpha-beta model (root; runs its own MPI jobs)"


def add_arguments(nw) -> None:
    nw.add_argument("--rates", default="1gbit,100mbit", help="link rates, tc syntax (comma list)")
    nw.add_argument("--hosts", dest="hosts_text", default="2,4,8",
                    help="host counts of one rank each (comma list, 2..64)")
    nw.add_argument("--size", default="64MiB", help="all-reduce size at the fastest rate; slower "
                    "rates get proportionally less, at least 1 MiB")
    nw.add_argument("--layouts", dest="layouts_text", default="2x4,4x2",
                    help="hosts x ranks per host of the layouts with several ranks a host (comma "
                    "list; 2x4 is hostfiles/two_nodes)")
    nw.add_argument("--no-two-nodes", dest="layouts_text", action="store_const", const="",
                    help="skip the layouts of several ranks a host")
    nw.add_argument("--prefix", default="psrt-h", help="name prefix of the emulated hosts")
    nw.add_argument("--subnet", default=SUBNET, help="their subnet, inside 198.18.0.0/15")
    nw.add_argument("--no-floor", dest="floor", action="store_false",
                    help="skip the unshaped runs that tell network-bound rows from CPU-bound ones")
    nw.add_argument("--warmup", type=int, default=1)
    nw.add_argument("--repeats", type=int, default=3)
    nw.add_argument("--quick", action="store_true", help="1gbit, 2 and 8 hosts, 16 MiB, one repeat")
    nw.add_argument("--json")
    nw.add_argument("--csv")
    nw.add_argument("--plot", help="PNG: time vs hosts, measured and predicted")
    nw.add_argument("--quiet", action="store_true", help="no progress display")


def check(args) -> None:
    """Refuse bad values in one line; turn the text options into lists and bytes."""
    from psrt.bench.collectives import parse_size
    from psrt.bench.report import need
    from psrt.launch.cluster import RATE
    need(args.repeats >= 1, f"--repeats {args.repeats}: must be at least 1")
    need(args.warmup >= 0, f"--warmup {args.warmup}: must not be negative")
    args.rates = [r.strip() for r in args.rates.split(",")]
    bad = [r for r in args.rates if not RATE.match(r)]
    need(not bad, f"--rates {','.join(bad)}: expected tc rates such as 1gbit,100mbit")
    parts = args.hosts_text.split(",")
    need(all(p.strip().isdigit() and 2 <= int(p) <= 64 for p in parts),
         f"--hosts {args.hosts_text}: expected host counts from 2 to 64, e.g. 2,4,8")
    args.host_counts = sorted({int(p) for p in parts})
    texts = [t.strip() for t in args.layouts_text.split(",") if t.strip()]
    need(all(re.fullmatch(r"\d+x\d+", t) for t in texts),
         f"--layouts {args.layouts_text}: expected hosts x ranks per host, e.g. 2x4,4x2")
    args.layouts = [Layout(*map(int, t.split("x"))) for t in texts]
    need(all(2 <= lay.hosts <= 64 and 2 <= lay.per_host <= 64 for lay in args.layouts),
         f"--layouts {args.layouts_text}: hosts and ranks per host from 2 to 64")
    try:
        args.size = parse_size(args.size)
    except ValueError as err:
        need(False, str(err))
    need(args.size >= 1 << 20, f"--size {args.size} B: the network regime needs at least 1 MiB")


def command(args) -> int:
    """PS vs ring on emulated hosts with shaped links, measured and predicted (root)."""
    check(args)
    from psrt.bench import goal, report
    if args.quick:
        quicken(args)
    payload = run(args)
    found = goals(payload)
    payload["goals"] = goal.rows(found)
    print_report(payload)
    goal.print_goals(found)
    if args.json:
        report.write_json(args.json, payload)
    if args.csv:
        report.write_csv(args.csv, payload["rows"])
    if args.plot:
        plot(payload, args.plot)
    return 1 if any(r["wrong"] for r in payload["rows"]) else 0
