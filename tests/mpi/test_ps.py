"""Synchronous parameter servers (--dp ps, --dp ps-sharded) and ps-async at s = 0: k steps on
N ranks match one process on the whole global batch, for N = 1..4, SGD+momentum and Adam.

One mpirun of 4 ranks runs every size on sub-communicators (tests/mpi/ranks/ps_equivalence.py), so
the suite pays the start-up of MPI and torch once.

Tolerance: the only difference from the single-process run is the order in which the
per-sample gradients are summed (mean of per-worker, per-micro-batch means instead of one
mean): a few float32 ulps per step, which 3 steps of SGD-momentum or Adam do not amplify
noticeably (measured <= 6e-8 on parameters of size ~0.4).  |got - ref| <= 1e-6 + 1e-5 |ref|
leaves room for that and still fails for any real mistake (a sum instead of a mean, a lost
micro-batch, a stale shard), which moves parameters by 1e-3 or more.  On one rank with one
micro-batch the arithmetic is the reference's own, so it must match bit for bit.
"""
from __future__ import annotations

import subprocess
import sys
from collections import defaultdict

import pytest
from conftest import MPI_SCRIPTS, ROOT, RankRun, mpirun_argv

RTOL, ATOL = 1e-5, 1e-6
SIZES = (1, 2, 3, 4)


def launch(np_: int, script: str, *args: str, timeout: float) -> RankRun:
    """Like the run_ranks fixture, for module-scoped fixtures (one launch, many tests)."""
    import os
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{MPI_SCRIPTS}", OMP_NUM_THREADS="1")
    cmd = mpirun_argv(np_) + [sys.executable, str(MPI_SCRIPTS / script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=subprocess.DEVNULL)
    return RankRun(proc).check()


@pytest.fixture(scope="module")
def records():
    recs = launch(4, "ps_equivalence.py", timeout=400).records()
    by_size = defaultdict(list)
    for r in recs:
        by_size[r["size"]].append(r)
    return by_size


def workers(recs, case=None):
    return [r for r in recs if r["worker"] and (case is None or r["case"] == case)]


@pytest.mark.parametrize("n", SIZES)
def test_matches_single_process(records, n):
    recs = [r for r in records[n] if not r["case"].startswith(("resume", "backup"))]
    expected_cases = {1: 4, 2: 10, 3: 14, 4: 14}[n]
    assert len({r["case"] for r in recs}) == expected_cases
    for r in workers(recs):
        assert r["maxdiff"] <= ATOL + RTOL * r["maxref"], r
        for got, want in zip(r["losses"], r["ref_losses"]):
            assert abs(got - want) <= ATOL + RTOL * abs(want), (r["case"], r["losses"], r["ref_losses"])
        if n == 1:
            assert r["bitwise"], r


@pytest.mark.parametrize("n", SIZES)
def test_every_worker_ends_with_the_same_parameters(records, n):
    by_case = defaultdict(set)
    for r in workers(records[n]):
        if "digest" in r:
            by_case[r["case"]].add(r["digest"])
    assert by_case and all(len(d) == 1 for d in by_case.values()), by_case


@pytest.mark.parametrize("n", (2, 3, 4))
@pytest.mark.parametrize("optim", ("sgd", "adam"))
def test_async_s0_equals_ps_bitwise(records, n, optim):
    """Same workers, same server rank: ps-async with s = 0 and ps --servers 1 agree bit for bit."""
    ps = {r["digest"] for r in workers(records[n], f"ps[servers=1]/{optim}")}
    ps_async = {r["digest"] for r in workers(records[n], f"ps-async[staleness=0]/{optim}")}
    assert len(ps) == 1 and ps == ps_async


@pytest.mark.parametrize("n", (2, 3, 4))
def test_sums_in_worker_rank_order(records, n):
    """The server adds gradients left to right in worker-rank order, whatever its own rank
    and however the vector is sharded: ps, ps-sharded (any layout) with the same workers, and
    ps --servers 1 on n ranks against ps on n - 1 ranks, give identical bits."""
    for optim in ("sgd", "adam"):
        colocated = {r["digest"] for r in workers(records[n]) if r["case"].endswith(optim)
                     and r["case"].split("/")[0] in ("ps[]", "ps-sharded[]", "ps-sharded[shards=2]")}
        assert len(colocated) == 1, colocated
        dedicated = {r["digest"] for r in workers(records[n], f"ps[servers=1]/{optim}")}
        smaller = {r["digest"] for r in workers(records[n - 1], f"ps[]/{optim}")}
        if n - 1 > 1:     # one rank with micro-batches of 1 is a different summation
            assert dedicated == smaller


@pytest.mark.parametrize("n", (2, 3, 4))
def test_sharded_servers_hold_only_their_shard(records, n):
    numel = records[n][0]["numel"]
    for r in records[n]:
        if not r["case"].startswith("ps-sharded"):
            continue
        per_elem = {"sgd": 1, "adam": 2}[r["case"].rsplit("/", 1)[1]]   # momentum; exp_avg(+sq)
        if r["shard"] is None:
            assert r["state_numel"] == 0, r
        else:
            lo, hi = r["shard"]
            assert r["state_numel"] == per_elem * (hi - lo), r
    for case in {r["case"] for r in records[n] if r["case"].startswith("ps-sharded")}:
        shards = sorted(tuple(r["shard"]) for r in records[n] if r["case"] == case and r["shard"])
        sizes = [hi - lo for lo, hi in shards]
        assert shards[0][0] == 0 and shards[-1][1] == numel, shards
        assert all(a[1] == b[0] for a, b in zip(shards, shards[1:])), shards
        assert max(sizes) - min(sizes) <= 1, shards


@pytest.mark.parametrize("n", (2, 3, 4))
def test_answers_are_received_after_this_ranks_own_sends(records, n):
    """Co-located ps-sharded: each rank posts the receives for the other servers' answers
    only after its own pushes and its own server's answers (psrt.dp.ps, complete): posted
    earlier, its go-ahead for a peer's answer queued behind the bulk data it was sending that
    peer, and the two answers between a pair of ranks ran one after the other."""
    seen = [r for r in records[n] if "calls" in r]
    assert len(seen) == 2 * n, seen          # every rank, sgd and adam
    for r in seen:
        calls = r["calls"]
        assert calls.count("r") == calls.count("a") == calls.count("p") == 3 * (n - 1), r
        pushed = answered = posted = 0
        for c in calls:
            pushed += c == "p"
            answered += c == "a"
            posted += c == "r"
            if c == "r":
                # this step's pushes and answers all went before its first answer's receive
                assert answered >= posted and pushed >= posted, (r["case"], r["rank"], calls)


@pytest.mark.parametrize("n", (2, 3, 4))
def test_server_link_carries_n_minus_1_models(records, n):
    """Co-located ps: rank 0 sends the model to each of the other N-1 workers every step,
    while a worker sends one gradient; sharding spreads the server's share over the ranks."""
    numel = records[n][0]["numel"]
    model_bytes = numel * 4 + 32        # payload + the float64 header
    for r in workers(records[n], "ps[]/sgd"):
        expect = (n - 1) * model_bytes if r["rank"] == 0 else model_bytes
        assert r["bytes"] == [expect] * 3, r
    # ps-sharded over all N ranks: each rank pushes N-1 slices and answers N-1 pulls of its
    # own slice, 2 (N-1) M / N per step (plus a header and alignment padding per message).
    for r in workers(records[n], "ps-sharded[]/sgd"):
        per_step = r["bytes"][0]
        assert per_step <= 2 * (n - 1) * (numel * 4 / n + 40), r
        if n >= 3:
            assert per_step < (n - 1) * model_bytes


def test_resume_from_state_dict_is_exact(records):
    recs = [r for r in records[3] if r["case"].startswith("resume/")]
    assert len({r["case"] for r in recs}) == 5
    assert all(r["same"] for r in recs if r["worker"]), recs


def test_backup_workers_leave_the_straggler_out(records):
    """--backup-workers 1, the last of 4 workers 0.5 s late every step: the server leaves its
    gradient out of every step (Chen et al. 2016), the run equals one process trained on the
    other workers' shares, and the straggler ends with the same parameters as the rest."""
    recs = [r for r in records[4] if r["case"] == "backup"]
    assert len(recs) == 4
    assert {r["digest"] for r in recs} == {recs[0]["digest"]}
    assert all(r["maxdiff"] <= 1e-5 for r in recs), [r["maxdiff"] for r in recs]
    assert [r["left_out"] for r in recs if r["left_out"] is not None] == [4]


def test_bench_backup_counts_only_the_gradients_left_out(run_ranks, tmp_path):
    """`psrt.bench backup`: with no backups nothing is left out (the server's own gradient is
    not counted), with one each step leaves out at most one of the two other workers', and
    every row trains to a finite loss."""
    import json
    out = tmp_path / "backup.json"
    run_ranks(3, "-m", "psrt.bench", "backup", "--backups", "0,1", "--steps", "8", "--late-ms", "30",
              "--batch-size", "48", "--quiet", "--json", str(out), timeout=180).check()
    rows = {r["backups"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows[0]["left_out"] == 0 and rows[0]["gradients"] == 16, rows[0]
    assert 0 < rows[1]["left_out"] <= 8, rows[1]
    assert all(r["train_loss"] < 10 and 0 <= r["test_acc"] <= 1 for r in rows.values()), rows
