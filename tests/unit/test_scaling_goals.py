"""The scaling bench judges its goals from its rows: only link-bound cells count, and a
CPU-bound cell leaves its goal unjudged rather than met or missed."""
from __future__ import annotations

from psrt.bench import scaling_goals


def _row(layout, strategy, step, predicted, *, cpu=False, bound="link", speedup=1.0, predicted_speedup=1.0, auto=None):
    hosts, per_host = map(int, layout.split("x"))
    return {"profile": "vgg16", "layout": layout, "workers": hosts * per_host, "strategy": strategy,
            "step_s": step, "predicted_s": predicted, "error": step / predicted - 1, "cpu_bound": cpu,
            "bound": "cpu" if cpu else bound, "speedup": speedup, "predicted_speedup": predicted_speedup,
            "auto_vs_fastest": auto, "grad_bytes": 16.5 * 2 ** 20}


ROWS = [
    _row("1x1", "ring", 1.0, 1.0),
    _row("2x4", "ring", 2.0, 1.9),                        # +5%
    _row("2x4", "ring-hier", 1.0, 1.05),                  # 2.0x the flat ring
    _row("2x4", "ring-auto", 1.08, 1.05, auto=0.08),
    _row("2x4", "zero3", 9.0, 3.0, cpu=True),             # CPU-bound: left out of the model check
    _row("2x4", "ps", 8.0, 7.5, speedup=0.5, predicted_speedup=0.52),
    _row("2x4", "ps-sharded", 2.0, 2.5),                  # gain 4.0x against the model's 3.0x
    _row("2x4", "ps-local", 4.0, 3.75, cpu=True),
]


def _by_text(rows, **payload):
    return {g.text: g for g in scaling_goals.goals({"rows": rows, **payload})}


def test_each_goal_is_judged_on_link_bound_cells_only():
    goals = _by_text(ROWS)
    rings = goals["vgg16, the rings: the step model within 15% on every link-bound cell (3)"]
    assert rings.ok and rings.detail == "(ring 2x4)"
    servers = goals["vgg16, the servers: the step model within 15% on every link-bound cell (2)"]
    assert servers.ok is False and servers.detail == "(ps-sharded 2x4)"     # -20%
    zero3 = goals["vgg16, zero3: the step model within 15% on every link-bound cell (0)"]
    assert zero3.ok is None and zero3.value == "no link-bound cell"
    assert goals["vgg16 2x4: hierarchical >= 1.5x faster than the flat ring (per step)"].ratio == 2.0
    auto = goals["vgg16: auto within 10% of the fastest ring on every layout (1 link-bound)"]
    assert auto.ok and round(auto.ratio, 2) == 1.08
    server = goals["vgg16 2x4: the single server's speed-up within 15% of the model's"]
    assert server.ok and round(server.ratio, 3) == round(0.5 / 0.52, 3)
    sharded = goals["vgg16 2x4: ps-sharded's gain over the single server within 15% of the model's 3.00x"]
    assert sharded.ok is False and round(sharded.ratio, 3) == round(4.0 / 3.0, 3)
    local = goals["vgg16 2x4: local aggregation's gain over the single server within 15% of the model's 2.00x"]
    assert local.ok is None and "CPU-bound: not judged" in local.detail


def test_a_cpu_bound_cell_leaves_the_hierarchical_goal_unjudged():
    rows = [dict(r, cpu_bound=True, bound="cpu") if r["strategy"] == "ring-hier" else r for r in ROWS]
    hier = _by_text(rows)["vgg16 2x4: hierarchical >= 1.5x faster than the flat ring (per step)"]
    assert hier.ok is None and hier.status == "n/a" and "not judged" in hier.detail


def test_small_buckets_judge_hierarchical_on_4x4_and_small_gradients_skip_the_2x4_goal():
    rows = ROWS + [_row("4x4", "ring", 3.0, 3.0), _row("4x4", "ring-hier", 1.0, 1.0)]
    small = _by_text(rows, bucket_mb=1 / 16)
    assert not any("2x4: hierarchical" in t for t in small)
    hier = small["vgg16 4x4: hierarchical >= 2.5x faster than the flat ring (buckets of 64 KiB)"]
    assert hier.ok and hier.ratio == 3.0
    assert not any("4x4: hierarchical" in t for t in _by_text(rows, bucket_mb=25))
    tiny = [dict(r, grad_bytes=3 * 2 ** 20) for r in rows]          # under 16 MiB: no 2x4 goal
    assert not any("hierarchical" in t for t in _by_text(tiny))


def test_auto_is_not_judged_where_the_flat_ring_was_not_measured():
    """A run of the servers alone still measures the ring variants on hosts of several ranks:
    auto against the hierarchical ring only is no verdict, and the line says why (not the
    cores)."""
    rows = [_row("1x1", "ps", 1.0, 1.0), _row("2x2", "ps", 2.0, 2.0),
            _row("2x2", "ring-hier", 1.0, 1.0), _row("2x2", "ring-auto", 1.3, 1.0, auto=0.3)]
    auto = _by_text(rows)["vgg16: auto within 10% of the fastest ring on every layout (0 link-bound)"]
    assert auto.ok is None and "the flat ring not measured" in auto.detail and "CPU" not in auto.detail
