"""The scaling bench's goals, judged from its rows (psrt.bench.scaling's payload).

Only cells the link bounded count: a cell marked CPU-bound (psrt/train/cpu_load.py) measured
this machine's cores, not the network, so a goal that needs one is printed n/a, not judged.

1. The step model within 15% of the measured step on every link-bound cell, per profile and
   family of strategies (the servers, the rings and ZeRO-1/2, ZeRO-3).
2. Hierarchical against the flat ring, per step: on 2x4 with at least 16 MiB of gradients,
   at least 1.5x (the link bound, 2(N-1)/N over 2(H-1)/H, is 1.75x); on 4x4 with buckets of
   at most 64 KiB (--bucket-mb), where sequential messages and not bytes set the time, at
   least 2.5x (6 sequential steps against the flat ring's 30: psrt.collectives.cost.rounds).
3. On each profile's largest layout with a server: the single server's speed-up within 15% of
   the model's, and ps-sharded's and local aggregation's gain over it within 15% of the gains
   the model predicts.
4. `auto` within 10% of the faster of the flat and hierarchical rings on every layout.
"""
from __future__ import annotations

from psrt.bench.goal import Goal
from psrt.bench.step_model import bucket_bytes

MODEL_WITHIN = 0.15
HIER_2X4 = 1.5
HIER_2X4_BYTES = 16 << 20
HIER_4X4 = 2.5
SMALL_BUCKET = 64 << 10
AUTO_WITHIN = 1.10
FAMILIES = {"the servers": ("ps", "ps-sharded", "ps-local"),
            "the rings": ("ring", "native", "zero1", "zero2", "ring-hier", "ring-auto"),
            "zero3": ("zero3",)}


def _cell(rows: list[dict], profile: str, layout: str, strategy: str) -> dict | None:
    return next((r for r in rows if (r["profile"], r["layout"], r["strategy"]) == (profile, layout, strategy)), None)


def _linked(*cells) -> bool:
    return all(c is not None and not c.get("cpu_bound") for c in cells)


def model_goal(rows: list[dict], profile: str, family: str) -> Goal | None:
    ours = [r for r in rows if r["profile"] == profile and r["strategy"] in FAMILIES[family] and r["workers"] > 1]
    if not ours:
        return None
    cells = [r for r in ours if r.get("error") is not None and r.get("bound") == "link" and not r.get("cpu_bound")]
    worst = max(cells, key=lambda r: abs(r["error"]), default=None)
    return Goal(f"{profile}, {family}: the step model within {MODEL_WITHIN:.0%} on every link-bound cell ({len(cells)})",
                "measured step", "predicted step", "within", MODEL_WITHIN,
                ratio=None if worst is None else 1 + worst["error"], worst=True,
                detail="" if worst is None else f"({worst['strategy']} {worst['layout']})",
                missing="no link-bound cell")


def hierarchical_goal(rows: list[dict], profile: str, buckets: float) -> Goal | None:
    """Goal 2: the 4x4 latency goal where the buckets are small, else the 2x4 bandwidth goal."""
    small = buckets <= SMALL_BUCKET
    layout, least = ("4x4", HIER_4X4) if small else ("2x4", HIER_2X4)
    flat, hier = _cell(rows, profile, layout, "ring"), _cell(rows, profile, layout, "ring-hier")
    if flat is None or hier is None or not small and flat["grad_bytes"] < HIER_2X4_BYTES:
        return None
    what = f"buckets of {buckets / 1024:g} KiB" if small else "per step"
    return Goal(f"{profile} {layout}: hierarchical >= {least}x faster than the flat ring ({what})", "ring-hier",
                "ring", ">=", least, ratio=flat["step_s"] / hier["step_s"], judged=_linked(flat, hier),
                detail="" if _linked(flat, hier) else "(a cell CPU-bound: not judged)")


def server_goals(rows: list[dict], profile: str) -> list[Goal]:
    layouts = [r["layout"] for r in rows if r["profile"] == profile and r["strategy"] == "ps" and r["workers"] > 1]
    if not layouts:
        return []
    layout = max(layouts, key=lambda lay: next(r["workers"] for r in rows if r["layout"] == lay))
    ps = _cell(rows, profile, layout, "ps")
    out = [Goal(f"{profile} {layout}: the single server's speed-up within {MODEL_WITHIN:.0%} of the model's",
                "ps speed-up", "predicted", "within", MODEL_WITHIN, ratio=ps["speedup"] / ps["predicted_speedup"],
                judged=_linked(ps), detail="" if _linked(ps) else "(CPU-bound: not judged)")]
    for name, what in (("ps-sharded", "ps-sharded's"), ("ps-local", "local aggregation's")):
        other = _cell(rows, profile, layout, name)
        if other is None:
            continue
        gain, predicted = ps["step_s"] / other["step_s"], ps["predicted_s"] / other["predicted_s"]
        out.append(Goal(f"{profile} {layout}: {what} gain over the single server within {MODEL_WITHIN:.0%} of the "
                        f"model's {predicted:.2f}x", name, "ps", "within", MODEL_WITHIN, ratio=gain / predicted,
                        judged=_linked(ps, other),
                        detail=f"(gain {gain:.2f}x" + (")" if _linked(ps, other) else "; CPU-bound: not judged)")))
    return out


def auto_goal(rows: list[dict], profile: str) -> Goal | None:
    autos = [r for r in rows if r["profile"] == profile and r["strategy"] == "ring-auto" and r.get("auto_vs_fastest") is not None]
    if not autos:
        return None
    # auto chooses between the flat and the hierarchical ring: a layout judges it only where
    # both were measured (a run whose --strategies has no ring measured the flat one nowhere)
    both = [r for r in autos if all(_cell(rows, profile, r["layout"], s) for s in ("ring", "ring-hier"))]
    judged = [r for r in both if _linked(r, _cell(rows, profile, r["layout"], "ring"),
                                         _cell(rows, profile, r["layout"], "ring-hier"))]
    worst = max(judged or both or autos, key=lambda r: r["auto_vs_fastest"])
    why = "" if judged else "; CPU-bound: not judged" if both else "; the flat ring not measured (--strategies ring): not judged"
    return Goal(f"{profile}: auto within {AUTO_WITHIN - 1:.0%} of the fastest ring on every layout ({len(judged)} link-bound)",
                "ring-auto", "fastest ring", "<=", AUTO_WITHIN, ratio=1 + worst["auto_vs_fastest"], worst=True,
                judged=bool(judged), detail=f"({worst['layout']}){why}")


def goals(payload: dict) -> list[Goal]:
    rows = payload["rows"]
    buckets = bucket_bytes(payload.get("bucket_mb"))
    out = []
    for profile in dict.fromkeys(r["profile"] for r in rows):
        out += [g for g in (model_goal(rows, profile, f) for f in FAMILIES) if g]
        out += [g for g in (hierarchical_goal(rows, profile, buckets), auto_goal(rows, profile)) if g]
        out += server_goals(rows, profile)
    return out
