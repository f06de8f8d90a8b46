"""--trace: one Chrome-trace timeline of the whole job, from psrt.train's data-parallel and
pipeline runs and from the training bench (psrt/trace)."""
from __future__ import annotations

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


def test_data_parallel_timeline(tmp_path):
    """ps then ring on 3 ranks, small buckets so that some are reduced during backward."""
    path = tmp_path / "dp.json"
    ranks(3, "--dp", "ps,ring", "--steps", "3", "--quiet", "--bucket-mb", "0.01", "--width", "256",
          "--trace", str(path)).check()
    events = spans(path)
    assert {e["pid"] for e in events} == {0, 1, 2}
    by_rank = {r: {e["name"] for e in events if e["pid"] == r} for r in range(3)}
    for r in range(3):
        assert {"forward", "backward", "optimizer", "wait for buckets", "allreduce", "forward+backward",
                "push and pull"} <= by_rank[r], by_rank[r]
    assert {"server: wait for pushes", "server: reduce and update"} <= by_rank[0]    # rank 0 serves
    buckets = [e for e in events if e["name"] == "allreduce" and e["args"].get("algorithm") == "ring"]
    assert buckets and all(e["args"]["bytes"] > 0 for e in buckets)
    # a bucket's all-reduce on psrt's communication thread overlaps a backward on the main thread
    backward = [e for e in events if e["name"] == "backward"]
    assert any(b["pid"] == k["pid"] and b["tid"] != k["tid"] and overlaps(b, k) for b in buckets for k in backward)


def test_pipeline_timeline(tmp_path):
    path = tmp_path / "pp.json"
    ranks(2, "--model", "transformer", "--pp", "2", "--accum", "4", "--steps", "2", "--quiet",
          "--trace", str(path)).check()
    events = [e for e in spans(path) if e["cat"] == "pipeline"]
    for r in (0, 1):
        for kind in ("forward", "backward"):
            got = sorted(e["args"]["microbatch"] for e in events if e["pid"] == r and e["name"] == kind)
            assert got == sorted(list(range(4)) * 2), (r, kind, got)      # 4 micro-batches x 2 steps
    assert {e["args"]["stage"] for e in events if e["pid"] == 1} == {1}
