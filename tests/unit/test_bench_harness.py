"""The bench's shared machinery, without MPI: the timed rounds (psrt/bench/timing.py) on a
stand-in communicator of two ranks, the Goal type, and the shape of psrt/bench itself (short
functions; no private name or __main__ module of another psrt package)."""
import ast
from pathlib import Path

import pytest

from psrt.bench import timing
from psrt.bench.goal import Goal

BENCH = Path(__file__).resolve().parents[2] / "psrt" / "bench"


class TwoRanks:
    """A communicator whose other rank always took `slower` times as long as this one."""

    def __init__(self, slower: float = 3.0):
        self.slower, self.barriers, self.bcasts = slower, 0, []

    def Barrier(self):
        self.barriers += 1

    def allgather(self, value):
        return [value, value * self.slower]

    def bcast(self, value, root=0):
        self.bcasts.append(value)
        return value


def test_rounds_warm_up_interleave_and_take_the_slowest_rank():
    comm, seen = TwoRanks(), []
    calls = {"a": lambda: seen.append("a"), "b": lambda: seen.append("b")}
    got = timing.interleaved(comm, calls, repeats=3, warmup=2, per_round={"a": 1, "b": 2})
    # warm-up of each, then rounds A B B, A B B, A B B, each after a barrier
    assert seen == ["a", "a", "b", "b"] + ["a", "b", "b"] * 3 and comm.barriers == 6
    for t in got.values():
        assert len(t.slowest) == 3 and all(s == pytest.approx(3 * f) for s, f in zip(t.slowest, t.fastest))
        assert t.spread[0] <= t.median <= t.spread[1] and t.fastest_median == pytest.approx(t.median / 3)
    assert (got["a"].calls, got["b"].calls) == (1, 2)


def test_rounds_sized_by_time_are_decided_by_rank_0_for_all():
    comm, count = TwoRanks(1.0), []
    t = timing.timed(comm, lambda: count.append(1), repeats=2, min_time_s=1.0, most=7)
    assert comm.bcasts == [7] and t.calls == 7 and len(count) == 1 + 2 * 7    # the sizing call, then 2 rounds
    empty = timing.timed(comm, lambda: None, repeats=0)
    assert empty.median != empty.median         # no round: nan, not an error


def test_cycling_walks_the_batches_round_and_round():
    seen = []
    call = timing.cycling([1, 2, 3], seen.append)
    for _ in range(5):
        call()
    assert seen == [1, 2, 3, 1, 2]


@pytest.mark.parametrize("op, threshold, ratio, ok, value", [
    (">=", 0.9, 0.95, True, "worst 0.95x (ring, 4 B)"),
    (">=", 0.9, 0.85, False, "worst 0.85x (ring, 4 B)"),
    ("<=", 2.0, 2.0, True, "worst 2.00x (ring, 4 B)"),
    ("<", 1.05, 1.05, False, "worst 1.05x (ring, 4 B)"),
    ("within", 0.2, 1.11, True, "worst +11% (ring, 4 B)"),
    ("within", 0.2, 0.75, False, "worst -25% (ring, 4 B)"),
])
def test_a_goal_is_judged_and_printed_one_way(op, threshold, ratio, ok, value):
    g = Goal("N=2: ring against native", "ring", "native", op, threshold, ratio, worst=True, detail="(ring, 4 B)")
    assert (g.ok, g.value) == (ok, value)
    assert g.line() == f"goal {'met' if ok else 'MISSED'}: N=2: ring against native: {value}"
    assert g.as_dict() == {"goal": "N=2: ring against native", "value": value, "ok": ok, "status": g.status,
                           "measured": "ring", "peer": "native", "op": op, "threshold": threshold, "ratio": ratio}


def test_a_goal_not_judged_or_not_measured_is_n_a():
    assert Goal("g", "a", "b", ">=", 1.0, 2.0, judged=False).line() == "goal n/a: g: 2.00x"
    assert Goal("g", "a", "b", ">=", 1.0, missing="no peer row").line() == "goal n/a: g: no peer row"
    with pytest.raises(ValueError, match="op '>>'"):
        Goal("g", "a", "b", ">>", 1.0)


def _bench_trees():
    return [(path, ast.parse(path.read_text())) for path in sorted(BENCH.glob("*.py"))]


def test_no_bench_function_is_over_60_lines():
    long = [f"{path.name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, tree in _bench_trees() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60]
    assert not long, long


def _private_uses(tree) -> list[str]:
    """Imports of another psrt package's underscore names or __main__ modules, and attributes
    with an underscore name read off a module of one."""
    def foreign(module: str) -> bool:
        return module.startswith("psrt.") and not module.startswith("psrt.bench")

    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__") and name != "__main__")
    found, modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and foreign(node.module):
            if any(private(part) for part in node.module.split(".")):
                found.append(f"line {node.lineno}: from {node.module}")
            found += [f"line {node.lineno}: {node.module}.{a.name}" for a in node.names if private(a.name)]
            modules.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if foreign(a.name) and any(private(part) for part in a.name.split(".")):
                    found.append(f"line {node.lineno}: import {a.name}")
                if foreign(a.name) and a.asname:
                    modules.add(a.asname)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules \
                and private(node.attr):
            found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_bench_uses_only_public_names_of_other_packages():
    bad = {path.name: found for path, tree in _bench_trees() if (found := _private_uses(tree))}
    assert not bad, bad
    # the check itself sees each kind of private use
    sample = ast.parse("from psrt.trace.__main__ import draw\nfrom psrt.launch.cluster import _RATE\n"
                       "from psrt.dp import memory\nmemory._storages([])\nimport psrt.launch.cluster as C\nC._x\n"
                       "from psrt.bench.jobs import _env\n")
    assert len(_private_uses(sample)) == 4


@pytest.mark.parametrize("quick", [False, True])
def test_the_suite_runs_the_network_regime_with_every_option_the_command_has(quick):
    """The suite's network part builds its settings as `python -m psrt.bench network` parses
    them: an option the command gains (its hosts' subnet) is there too, or the part would stop
    on a missing attribute after minutes of the suite."""
    from psrt.bench import network
    from psrt.bench.__main__ import build_parser
    args = build_parser().parse_args(["network"] + (["--quick"] if quick else []))
    network.check(args)
    if quick:
        network.quicken(args)
    mine = vars(network.defaults(quick))
    theirs = {k: v for k, v in vars(args).items() if k not in ("command", "run")}
    assert mine == theirs
