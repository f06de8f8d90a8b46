"""Scaling past this machine: the step model (psrt/bench/step_model.py) on a cluster preset
(psrt/bench/presets.py) from 32 to 1024 workers, for a profile's real compute and gradient
sizes (no dilation: the preset's own links).

    python -m psrt.bench scaling --predict --preset dgx-a100 --profiles vgg16,resnet50
    python -m psrt.bench scaling --predict --preset my-cluster.toml

Nodes fill one after another (ranks 0..per_node-1 on the first).  The speed-up is weak
scaling against one accelerator (its step is the profile's compute alone).  What the model
leaves out: the last bucket's reduction after backward, the CPU's work (the update, copies),
congestion in the switches above the nodes (a full-bisection fabric is assumed), stragglers.
"""
from __future__ import annotations

from psrt.bench import presets
from psrt.bench.step_model import BUCKET_BYTES, gradient_buckets, placement, predict_step, speedup, units

WORKERS = (32, 64, 128, 256, 512, 1024)
STRATEGIES = ("ring", "ring-hier", "zero1", "zero3", "ps", "ps-sharded", "ps-local")


def rows(profile, preset: dict, workers=WORKERS, strategies=STRATEGIES) -> list[dict]:
    """One row per (workers, strategy): predicted step, speed-up, efficiency, what bounds it."""
    out = []
    for w in workers:
        per = min(preset["per_node"], w)
        if w % per == 0:
            out += placement_rows(profile, preset, placement(w // per, per), strategies)
    return out


def placement_rows(profile, preset: dict, host_of: list[int], strategies=STRATEGIES) -> list[dict]:
    """The same rows for one placement (rank -> host index, e.g. a job's own), on the preset's
    links: what each strategy's step would be if these hosts were the preset's nodes."""
    links = presets.links(preset)
    one = profile.forward_s + profile.backward_s
    w, nodes = len(host_of), len(set(host_of))
    out = []
    for s in strategies:
        p = predict_step(s, profile.forward_s, profile.backward_s, host_of, profile.grad_bytes(), links,
                         gradient_buckets(profile, BUCKET_BYTES), units(profile))
        if p is not None:
            up = speedup(w, one, p.step_s)
            out.append({"preset": preset["name"], "profile": profile.name, "workers": w, "nodes": nodes,
                        "strategy": s, "predicted_s": p.step_s, "comm_s": p.comm_s, "speedup": up,
                        "efficiency": up / w, "bound": p.bound})
    return out


COLUMNS = [("preset", "cluster", ""), ("profile", "profile", ""), ("workers", "workers", "d"),
           ("nodes", "nodes", "d"), ("strategy", "strategy", ""), ("predicted_s", "step (s)", ".4f"),
           ("comm_s", "comm (s)", ".4f"), ("speedup", "speed-up", ".1f"), ("efficiency", "efficiency", ".0%"),
           ("bound", "bound by", "")]
