"""The alpha-beta prediction beside `psrt.train`'s summary when it compares strategies.

After the last strategy has trained, rank 0 and one rank on another host (or, on one host,
rank 1) ping-pong messages of 8 B to 4 MiB; the fit (psrt.collectives.cost.fit) gives this
run's alpha and beta.  psrt.dp.traffic turns them into each strategy's communication time
per step on the job's placement, its regime (whether the latency or the bandwidth part is
larger) and the gradient size above which the ring's step beats the parameter server's.
The measured columns sit beside the predicted ones; where they part by more than 2x, the
line under the table says what the model leaves out.

On one host there is no network link: each rank is modelled as its own node joined by the
shared-memory path the ping-pong measured, a rough guide that says so.
"""
from __future__ import annotations

import os
import sys

from psrt.collectives import cost
from psrt.collectives.pingpong import measure_fit
from psrt.dp import traffic
from psrt.train.report import fmt_bytes, format_table

SIZES = [8, 1 << 20, 2 << 20, 4 << 20]
ATTEMPTS = 3
RING_FAMILY = traffic.RING_LIKE
PS_FAMILY = tuple(traffic.PS_LAYOUTS)


def not_covered(pp: int, tp: int, model: str) -> str | None:
    """Why the model has no prediction for this run's strategies (None: it has one).  It
    prices one data-parallel exchange of the whole model's gradients over every rank
    (psrt.dp.traffic); a step of these runs moves other traffic over other groups."""
    if pp * tp != 1:
        return ("no alpha-beta prediction for --pp/--tp runs: psrt's model prices the data-parallel "
                "gradient exchange over all ranks, while these steps also send pipeline activations "
                "and tensor-parallel partial sums, each strategy reducing only its shard over dp ranks")
    if model == "moe":
        return ("no alpha-beta prediction for --model moe: psrt's model prices the dense gradient "
                "exchange, while these steps also move tokens through expert-parallel all-to-alls")
    return None


def measure(world, ctl) -> dict | None:
    """Fit alpha and beta between rank 0 and a rank on another host (collective over ctl);
    the link description on rank 0, None elsewhere and on one rank."""
    from psrt.world import crowding, host_key, machine_key
    hosts = ctl.allgather(host_key(world.hostname))
    machines = ctl.allgather((machine_key(), os.cpu_count() or 1))
    if ctl.size < 2:
        return None
    peer = next((r for r, h in enumerate(hosts) if h != hosts[0]), 1)
    # A busy host can make a larger message look no slower than a smaller one: measure_fit
    # measures again, and if it stays so the prediction is left out, saying why.
    fit, why = _pair_fit(ctl, peer)
    # The two-level model also needs two ranks of one host, where hosts hold several.
    several = len(set(hosts)) > 1
    near = next((r for r in range(1, ctl.size) if hosts[r] == hosts[0]), None) if several else None
    intra = _pair_fit(ctl, near)[0] if near is not None else None
    if ctl.rank != 0:
        return None
    if fit is None:
        print(f"psrt: no alpha-beta prediction: {why}", file=sys.stderr, flush=True)
        return None
    names = list(dict.fromkeys(hosts))
    one_host = len(names) == 1
    return {"alpha_s": fit.alpha_s, "beta_s_per_byte": fit.beta_s_per_byte,
            "between": f"rank 0 ({hosts[0]}) <-> rank {peer} ({hosts[peer]})",
            "hosts": len(names), "ranks": ctl.size, "cores": os.cpu_count() or 1,
            "per_host": max(hosts.count(h) for h in names),
            "crowd": crowding([m for m, _ in machines], [c for _, c in machines]),
            "host_of": list(range(ctl.size)) if one_host else [names.index(h) for h in hosts],
            "placement": [names.index(h) for h in hosts],
            "intra": None if intra is None else (intra.alpha_s, intra.beta_s_per_byte)}


def _pair_fit(ctl, peer: int):
    """(fit, why) of a ping-pong between rank 0 and `peer` (collective over ctl)."""
    from mpi4py import MPI
    pair = ctl.Split(0 if ctl.rank in (0, peer) else MPI.UNDEFINED, key=0 if ctl.rank == 0 else 1)
    if pair == MPI.COMM_NULL:
        return None, None
    _, fit, why = measure_fit(pair, SIZES, repeats=3, min_time_s=0.02, attempts=ATTEMPTS)
    pair.Free()
    return fit, why


def annotate(rows: list[dict], link: dict, servers: int | None) -> None:
    """Add each row's prediction (pred_comm_s, pred_step_s, regime) and the link's fit, and,
    to the first ring-like row, the crossover against the first parameter-server row."""
    for row in rows:
        row.update(link=link, alpha_s=link["alpha_s"], beta_s_per_byte=link["beta_s_per_byte"])
    fit = cost.Fit(link["alpha_s"], link["beta_s_per_byte"], 1.0)
    n, host_of = link["ranks"], link["host_of"]
    both = levels(link)
    for row in rows:
        p = traffic.predict(row["dp"], n, row["grad_bytes"], host_of, fit, servers, both)
        if p is None or not row.get("steps_run", row["steps"]):
            continue
        row.update(pred_comm_s=p.total_s, regime=p.regime,
                   pred_step_s=row["compute_s"] / row.get("steps_run", row["steps"]) + p.total_s)
    ps = next((r for r in rows if r["dp"] in PS_FAMILY), None)
    ring = next((r for r in rows if r["dp"] in RING_FAMILY), None)
    if ps and ring:
        ring["crossover_bytes"] = traffic.crossover(ps["dp"], ring["dp"], n, host_of, fit, servers, both)
        ring["crossover_vs"] = ps["dp"]


COLUMNS = [("dp", "strategy", ""), ("pred_comm", "comm/step predicted", ""), ("comm", "measured", ""),
           ("pred_step", "step predicted", ""), ("step", "measured", ""), ("regime", "regime", "")]


def describe(rows: list[dict]) -> str:
    """The text under the summary table (rows annotated by `annotate`): the link, the table
    of predictions, the crossover and, where the measurement is far from the model, why."""
    link = rows[0]["link"]
    where = (f"{link['ranks']} ranks on one host (no network: shared memory modelled as links)"
             if link["hosts"] == 1 else f"{link['ranks']} ranks on {link['hosts']} hosts")
    lines = [f"alpha-beta model (ping-pong {link['between']}): alpha {link['alpha_s'] * 1e6:.1f} us, "
             f"{1 / link['beta_s_per_byte'] / 1e6:.0f} MB/s; {where}; "
             f"gradients {fmt_bytes(rows[0]['grad_bytes'])} per step"]
    table = []
    for r in rows:
        steps = max(r.get("steps_run", r["steps"]), 1)
        table.append({"dp": r["dp"], "pred_comm": duration(r.get("pred_comm_s")),
                      "comm": duration(r["comm_s"] / steps), "pred_step": duration(r.get("pred_step_s")),
                      "step": duration(r["wall_s"] / steps), "regime": r.get("regime", "-")})
    lines.append(format_table(table, COLUMNS))
    ring = next((r for r in rows if "crossover_vs" in r), None)
    if ring is not None:
        server = next(r for r in rows if r["dp"] == ring["crossover_vs"])
        lines += [crossover_line(ring, server), ratio_line(ring, server)]
    if link.get("intra") and link["hosts"] > 1:
        lines.append(two_level_line(link, rows[0]["grad_bytes"]))
    far = [r for r in rows if r.get("pred_comm_s")
           and r["comm_s"] / max(r.get("steps_run", r["steps"]), 1) > 2 * r["pred_comm_s"]]
    if far:
        lines.append(why_far(far, link))
    return "\n".join(lines)


def levels(link: dict) -> cost.Links | None:
    """The placement's two levels as the ping-pongs measured them, for the two-level model;
    None on one host, or where no two ranks of one host were measured."""
    if not link.get("intra") or link["hosts"] < 2:
        return None
    inter = cost.Fit(link["alpha_s"], link["beta_s_per_byte"], 1.0)
    crowd = link.get("crowd") or max(1.0, link["per_host"] / link["cores"])
    return cost.Links(cost.Fit(*link["intra"], 1.0), inter, crowd)


def two_level_line(link: dict, nbytes: float) -> str:
    """The two-level model's all-reduce time of this run's gradients on its placement, for
    each algorithm it covers (psrt.collectives.cost.predict_two_level), fastest first."""
    links = levels(link)
    intra, crowd = links.intra, links.crowd
    times = sorted((cost.predict_two_level(a, link["placement"], nbytes, links), a) for a in cost.TWO_LEVEL)
    listing = ", ".join(f"{a} {duration(t)}" for t, a in times)
    return (f"two-level model (inside a host: alpha {intra.alpha_s * 1e6:.1f} us, "
            f"{1 / intra.beta_s_per_byte / 1e6:.0f} MB/s; {crowd:.1f} ranks per core): all-reduce of "
            f"{fmt_bytes(nbytes)}: {listing}")


def duration(seconds: float | None) -> str | None:
    """12 us, 3.4 ms, 870 ms, 1.2 s: three significant figures at most."""
    if seconds is None:
        return None
    for unit, scale in (("s", 1.0), ("ms", 1e-3)):
        if seconds >= scale:
            v = seconds / scale
            return f"{v:.0f} {unit}" if v >= 100 else f"{v:.3g} {unit}"
    return f"{seconds * 1e6:.3g} us"


def crossover_line(ring: dict, other: dict) -> str:
    vs, m = other["dp"], ring["crossover_bytes"]
    if m is None:
        return (f"crossover: on this placement the model never has {ring['dp']} beat {vs}: "
                f"{ring['dp']} puts as many bytes on the busiest link and pays more latencies")
    ratio = other["pred_comm_s"] / ring["pred_comm_s"]
    if m == 0:
        return (f"crossover: {ring['dp']} beats {vs} at every gradient size on this placement "
                f"(here {ratio:.1f}x less communication per step)")
    here = "above" if ring["grad_bytes"] >= m else "below"
    return (f"crossover: {ring['dp']} communicates faster than {vs} above {fmt_bytes(m)} of gradients "
            f"on this placement; this model's {fmt_bytes(ring['grad_bytes'])} is {here} it "
            f"({ring['dp']} predicted {ratio:.2f}x {vs}'s speed)")


def ratio_line(ring: dict, other: dict) -> str:
    """How many times faster the ring's step was than the server's, measured and predicted."""
    def step(r):
        return r["wall_s"] / max(r.get("steps_run", r["steps"]), 1)
    measured = step(other) / step(ring)
    if not (ring.get("pred_step_s") and other.get("pred_step_s")):
        return f"step: {ring['dp']} {measured:.2f}x {other['dp']}'s speed (no model for one of them)"
    predicted = other["pred_step_s"] / ring["pred_step_s"]
    return (f"step: {ring['dp']} {measured:.2f}x {other['dp']}'s speed, the model {predicted:.2f}x "
            f"({measured / predicted - 1:+.0%})")


def why_far(rows: list[dict], link: dict) -> str:
    names = ", ".join(f"{r['dp']} {r['comm_s'] / max(r['steps'], 1) / r['pred_comm_s']:.1f}x" for r in rows)
    if link["per_host"] > link["cores"] or link["hosts"] == 1 and link["ranks"] > link["cores"]:
        return (f"measured comm over the model: {names}. {link['per_host']} ranks share a host's "
                f"{link['cores']} cores: a rank waiting for a message often waits for its sender to be scheduled, a "
                f"cost per sequential step (ring: 2(N-1) of them, ps: 2) that the link model leaves out")
    return (f"measured comm over the model: {names}: the reductions and copies of this machine's "
            f"cores, which the link model leaves out, are a large part of the step")
