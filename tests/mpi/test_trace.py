"""--trace: one Chrome-trace timeline of the whole job, from psrt.train's data-parallel and
hybrid (pipeline x tensor-parallel) runs, and clock offsets that undo a skewed clock
(psrt/trace).  Each psrt.train launch serves every check of its kind."""
from __future__ import annotations

import collections
import json
import sys

import pytest

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from test_train_cli import ranks  # noqa: E402

pytestmark = pytest.mark.mpi


def spans(path) -> list[dict]:
    trace = json.loads(path.read_text())
    for e in trace["traceEvents"]:
        assert {"ph", "pid", "name"} <= set(e), e
        if e["ph"] == "X":
            assert {"ts", "dur", "tid", "cat"} <= set(e) and e["dur"] >= 0 and e["ts"] >= 0, e
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def overlaps(a: dict, b: dict) -> bool:
    return a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]


def counts(events: list[dict], rank: int, cat: str | None = None) -> collections.Counter:
    return collections.Counter(e["name"] for e in events if e["pid"] == rank and (cat is None or e["cat"] == cat))


STEPS = 3


@pytest.fixture(scope="module")
def dp_timeline(tmp_path_factory):
    """ps, ring, ps-async and torch (psrt's DDP over gloo) on 3 ranks in one run, small
    buckets so that some are reduced during backward: ps serves from rank 0, ps-async from
    rank 2 (its dedicated server)."""
    path = tmp_path_factory.mktemp("trace") / "dp.json"
    names = ("ps", "ring", "ps-async", "torch")
    ranks(3, "--dp", ",".join(names), "--steps", str(STEPS), "--quiet", "--bucket-mb", "0.01",
          "--width", "256", "--trace", str(path)).check()
    # one timeline per strategy: each holds its own steps only, STEPS per training rank
    events = []
    for dp in names:
        mine = spans(path.with_name(f"dp.{dp}.json"))
        steps = collections.Counter(e["pid"] for e in mine if e["name"] == "step")
        assert set(steps.values()) == {STEPS}, (dp, steps)
        events += mine
    return events


def test_every_strategy_records_its_steps(dp_timeline):
    """A step, forward, backward and optimizer span per step of every strategy on the ranks
    that run it: ranks 0 and 1 train all four, rank 2 serves ps-async instead of training."""
    events = dp_timeline
    assert {e["pid"] for e in events} == {0, 1, 2}
    for r, trained in ((0, 4), (1, 4), (2, 3)):
        got = counts(events, r)
        assert got["step"] == got["forward"] == got["backward"] == STEPS * trained, (r, got)
        # ring and torch update on every rank; ps's server (rank 0) and ps-async's (rank 2) too
        assert counts(events, r, "compute")["optimizer"] == 2 * STEPS, (r, got)
        assert counts(events, r, "server")["optimizer"] == (STEPS if r in (0, 2) else 0), (r, got)
    algorithms = collections.Counter(e["args"].get("algorithm") for e in events if e["name"] == "allreduce")
    assert algorithms["ring"] > 0 and algorithms["torch"] > 0, algorithms


def test_parameter_servers_show_their_phases(dp_timeline):
    events = dp_timeline
    for r in (0, 1):        # workers of both: push, wait, load
        got = counts(events, r)
        assert got["push and pull"] == got["load parameters"] == 2 * STEPS, (r, got)
    ps_server, async_server = counts(events, 0, "server"), counts(events, 2, "server")
    assert ps_server["server: reduce"] == async_server["server: reduce"] == STEPS
    assert async_server["server: send parameters"] >= STEPS      # one send per released pull or several
    assert counts(events, 0, "wait")["server: wait for pushes"] == STEPS + 1        # and the workers' DONE
    assert counts(events, 2, "wait")["server: wait for pushes"] >= 2 * STEPS      # a push or DONE each


def test_buckets_overlap_backward(dp_timeline):
    events = dp_timeline
    buckets = [e for e in events if e["name"] == "allreduce" and e["args"].get("algorithm") == "ring"]
    assert buckets and all(e["args"]["bytes"] > 0 for e in buckets)
    # a bucket's all-reduce on psrt's communication thread overlaps a backward on the main thread
    backward = [e for e in events if e["name"] == "backward"]
    assert any(b["pid"] == k["pid"] and b["tid"] != k["tid"] and overlaps(b, k) for b in buckets for k in backward)


@pytest.mark.skipif(__import__("importlib").util.find_spec("horovod") is None,
                    reason="horovod is not installed (scripts/install_horovod.sh)")
def test_horovod_steps_are_recorded(tmp_path):
    path = tmp_path / "hvd.json"
    ranks(2, "--dp", "horovod", "--steps", "2", "--quiet", "--width", "64", "--trace", str(path)).check()
    events = spans(path)
    for r in (0, 1):
        got = counts(events, r)
        assert got["step"] == got["forward"] == got["backward"] == got["optimizer"] == 2, (r, got)
        assert got["wait for horovod"] == 2, (r, got)


def test_hybrid_timeline(tmp_path):
    """--pp 2 --tp 2 on 4 ranks with two reducers: each stage's forward and backward per
    micro-batch, the pipeline's sends and receives, the tensor-parallel all-reduces of the
    grid's communicators, the optimizer; and, with two strategies, the line saying why the
    alpha-beta block is not shown."""
    path = tmp_path / "pp.json"
    run = ranks(4, "--model", "transformer", "--pp", "2", "--tp", "2", "--dp", "ring,native", "--accum", "4",
                "--steps", "2", "--width", "32", "--layers", "2", "--quiet", "--trace", str(path)).check()
    assert "no alpha-beta prediction for --pp/--tp runs" in run.stdout
    events = spans(path.with_name("pp.ring.json")) + spans(path.with_name("pp.native.json"))
    assert {e["pid"] for e in events} == {0, 1, 2, 3}
    runs = 2 * 2            # two strategies of two steps
    for r in range(4):
        stage = r // 2      # ranks 0, 1: stage 0 (a TP pair); 2, 3: stage 1
        for kind in ("forward", "backward"):
            got = sorted(e["args"]["microbatch"] for e in events
                         if e["pid"] == r and e["cat"] == "pipeline" and e["name"] == kind)
            assert got == sorted(list(range(4)) * runs), (r, kind, got)
        assert {e["args"]["stage"] for e in events if e["pid"] == r and e["cat"] == "pipeline"} == {stage}
        got = counts(events, r)
        # 4 micro-batches a step: stage 0 sends activations and receives gradients, stage 1 the reverse
        assert got["send"] == got["recv"] == 4 * runs, (r, got)
        assert got["optimizer"] == got["step"] == runs, (r, got)
        tp = [e for e in events if e["pid"] == r and e["name"] == "allreduce" and e["args"]["bytes"] > 0]
        assert len(tp) >= 2 * 2 * runs, (r, len(tp))      # row-parallel layers of 2 blocks, forward


def test_clock_offsets_undo_a_skewed_clock(run_ranks, tmp_path):
    """Rank r's clock runs r x 1000 s behind rank 0's: in the written timeline the ranks' spans,
    recorded together after a barrier, overlap, and the offsets measured are the skews."""
    path = tmp_path / "clock.json"
    run_ranks(3, "trace_clock.py", str(path), timeout=120).check()
    trace = json.loads(path.read_text())
    together = {e["pid"]: e for e in trace["traceEvents"] if e["ph"] == "X"}
    assert sorted(together) == [0, 1, 2]
    assert all(overlaps(together[0], together[r]) for r in (1, 2)), together
    for r in (1, 2):
        assert abs(trace["otherData"]["offsets_ns"][str(r)] - r * 1000 * 10**9) < 50_000_000
