"""A written psrt timeline read back: its events, the time per rank and span, and the PNG
(ranks as rows, one lane per thread, colours by category) that `python -m psrt.trace` and
`python -m psrt.bench demo` draw."""
from __future__ import annotations

import json
from pathlib import Path

from psrt.errors import PsrtError
from psrt.trace import CATEGORIES

COLOURS = {"step": "black", "compute": "tab:blue", "comm": "tab:orange", "wait": "tab:gray", "server": "tab:red",
           "pipeline": "tab:green"}


def load(path: str) -> list[dict]:
    given = Path(path)
    # `--trace FILE` with several --dp strategies writes FILE.<dp>.json, one per strategy
    siblings = sorted(given.parent.glob(f"{given.stem}.*{given.suffix}")) if not given.exists() else []
    if siblings:
        raise PsrtError(f"{path}: no such file; a run with several --dp strategies wrote one per strategy: "
                        f"{', '.join(str(s) for s in siblings)}")
    try:
        trace = json.loads(given.read_text())
    except (OSError, ValueError) as err:
        raise PsrtError(f"{path}: not a readable trace ({err})") from None
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise PsrtError(f"{path}: no traceEvents list: not a Chrome trace")
    return events


def totals(events: list[dict]) -> list[dict]:
    """Per rank and span name: count and total ms."""
    out: dict = {}
    for e in events:
        if e.get("ph") == "X":
            row = out.setdefault((e["pid"], e["name"]), {"rank": e["pid"], "name": e["name"], "cat": e.get("cat", ""),
                                                         "count": 0, "ms": 0.0})
            row["count"] += 1
            row["ms"] += e["dur"] / 1e3
    return [out[k] for k in sorted(out)]


def from_first_step(events: list[dict]) -> list[dict]:
    """The events to draw: time 0 at the first training step, and the spans that end before it
    left out (a strategy's broadcast of the parameters as it is made). Seconds of set-up lie
    between the two (building the model, torch's imports when the first optimizer is made),
    which would squeeze the steps into a sliver at the right of the picture. A trace with no
    step is drawn whole; the file keeps every span, and totals() counts them all."""
    starts = [e["ts"] for e in events if e.get("ph") == "X" and e.get("cat") == "step"]
    if not starts:
        return events
    t0 = min(starts)
    return [dict(e, ts=e["ts"] - t0) if e.get("ph") == "X" else e for e in events
            if e.get("ph") != "X" or e["ts"] + e["dur"] > t0]


def side_by_side(runs: dict[str, list[dict]]) -> list[dict]:
    """The events of several runs (one trace per strategy, each with its own clock from 0 and
    the same rank numbers) as one trace in which each run has rows of its own, named
    "<run> rank N": drawn together otherwise, their spans would fall on the same rows. Each
    run's first step is at time 0 (from_first_step), so the runs' steps line up."""
    out = []
    for i, (label, events) in enumerate(runs.items()):
        events = from_first_step(events)
        offset = i * (1 + max((e.get("pid", 0) for e in events), default=0) + 1000)
        for e in events:
            e = dict(e, pid=e.get("pid", 0) + offset)
            if e.get("ph") == "M" and e.get("name") == "process_name":
                e["args"] = dict(e["args"], name=f"{label} {e['args']['name']}")
            out.append(e)
    return out


def draw(events: list[dict], out: str) -> None:
    """The timeline as a PNG, from the first training step on (from_first_step)."""
    events = from_first_step(events)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    lanes = sorted({(e["pid"], e["tid"]) for e in spans})
    row = {lane: i for i, lane in enumerate(lanes)}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e["name"] == "thread_name"}
    fig, ax = plt.subplots(figsize=(12, 0.5 + 0.45 * len(lanes)))
    for e in spans:
        lane, cat = row[(e["pid"], e["tid"])], e.get("cat")
        if cat == "step":           # around the phases of a step: an outline, drawn over them
            ax.broken_barh([(e["ts"] / 1e3, e["dur"] / 1e3)], (lane - 0.45, 0.9), facecolor="none",
                           edgecolor=COLOURS[cat], linewidth=0.8, zorder=3)
            continue
        ax.broken_barh([(e["ts"] / 1e3, max(e["dur"] / 1e3, 1e-3))], (lane - 0.4, 0.8),
                       color=COLOURS.get(cat, "tab:purple"), linewidth=0)
    ax.set_yticks(range(len(lanes)),
                  [f"{names.get(p, f'rank {p}')} {threads.get((p, t), t)}" for p, t in lanes], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title("psrt timeline")
    used = [c for c in CATEGORIES if any(e.get("cat") == c for e in spans)]
    ax.legend(handles=[Patch(facecolor="none", edgecolor=COLOURS[c], label=c) if c == "step"
                       else Patch(color=COLOURS[c], label=c) for c in used], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
