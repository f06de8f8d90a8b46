"""psrt.data_parallel on a user-defined model from the user's own loop: every strategy on 2
and 3 ranks, with a dedicated server rank where the strategy has one, ends with the
parameters (and rank 0's buffers) of one process training on the whole global batch, and
reports the global loss of each step (tests/mpi/ranks/dp_api.py; one launch of 3 ranks runs
both sizes on sub-communicators).

Tolerance (fp32) as in test_ddp_equivalence.py: the runs differ from the reference only in
the order gradients are summed, a few ulps; a wrong average, a lost micro-batch or a rank
that kept its own initial parameters moves them by 1e-2 or more.
"""
from __future__ import annotations

import json
from collections import defaultdict

import pytest
from conftest import launch_ranks

pytestmark = pytest.mark.mpi

# (strategy, options, loop) as tests/mpi/ranks/dp_api.py runs them.
RUNS = [("ps", {}, "loader"), ("ps", {"servers": 1}, "loader"), ("ps", {"servers": 1}, "steps"),
        ("ps-sharded", {}, "loader"), ("ps-sharded", {"servers": 1}, "loader"),
        ("ps-async", {}, "loader"), ("ps-async", {}, "steps"),
        ("ring", {"bucket_mb": 0.0005}, "loader"), ("ring", {"bucket_mb": 0.0005}, "steps"),
        ("native", {}, "loader"), ("torch", {}, "loader"), ("zero1", {}, "loader"), ("zero2", {}, "loader"),
        ("zero3", {}, "loader"), ("zero3", {}, "steps"), ("horovod", {}, "loader")]
SERVERS = {("ps", 1), ("ps-sharded", 1), ("ps-async", None)}    # (strategy, servers): a dedicated server


def test_every_strategy_is_run():
    """RUNS (and dp_api.py's CONFIGS) name every strategy psrt.dp has ('zero' is zero1's alias)."""
    from psrt.dp import STRATEGIES
    assert {dp for dp, _, _ in RUNS} == set(STRATEGIES) - {"zero"}


@pytest.fixture(scope="module")
def records():
    run = launch_ranks(3, "dp_api.py", timeout=300).check()
    by = defaultdict(list)
    for r in run.records():
        by[(r["dp"], json.dumps(r["options"]), r["loop"], r["size"])].append(r)
    return by


@pytest.mark.parametrize("size", (2, 3))
@pytest.mark.parametrize("dp,options,loop", RUNS, ids=[f"{d}-{json.dumps(o)}-{lp}" for d, o, lp in RUNS])
def test_user_model_on_n_ranks_equals_one_process(records, dp, options, loop, size):
    recs = records[(dp, json.dumps(options), loop, size)]
    if dp == "horovod" and not recs:
        pytest.skip("horovod is not installed")
    assert len(recs) == size, f"expected one record per rank, got {recs}"
    dedicated = (dp, options.get("servers")) in SERVERS
    servers = [r for r in recs if r["server"]]
    workers = [r for r in recs if not r["server"]]
    assert len(servers) == (1 if dedicated else 0), recs
    assert sorted(r["worker_rank"] for r in workers) == list(range(len(workers)))
    assert all(r["workers"] == len(workers) for r in recs)
    for r in workers:
        assert r["steps"] == 3, r
        assert not r["bad"], f"rank {r['rank']}: {r['bad']} differ from one process (max {r['max_abs']})"
        assert r["loss_ok"], (r["losses"], r["ref_losses"])
        # zero3 keeps only this rank's shard of the parameters (psrt.train reshards it on load)
        assert ("shard" if dp == "zero3" else "model") in r["state_keys"], r["state_keys"]
    for r in servers:
        # The same loop on the server: nothing to iterate over its empty shard (finish()
        # serves), or one update served per step() call.
        assert r["worker_rank"] == -1 and r["served"] == (3 if loop == "steps" else 0), r
