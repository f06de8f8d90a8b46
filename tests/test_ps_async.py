"""--dp ps-async: the SSP clock table in one process, then a 4-rank run (3 workers + server)
with a deliberately slow worker: fast workers run ahead by at most s clocks (and do reach s,
so the run really is asynchronous), s = 0 stays in lockstep, and training with s > 0 converges.
"""
from __future__ import annotations

import pytest

from psrt.dp.ps_async import SSPTable
from psrt.errors import PsrtError
from test_ps import launch

S = 2
STEPS = 12


# ---------------------------------------------------------------- SSPTable, no MPI
def test_table_s0_is_lockstep():
    t = SSPTable([0, 1, 2], staleness=0)
    t.push(2, 0, "g2")
    t.push(0, 0, "g0")
    assert t.complete() == [] and t.releasable() == []      # worker 1 has not pushed clock 0
    t.push(1, 0, "g1")
    assert t.complete() == [(0, ["g0", "g1", "g2"])]          # rank order, not arrival order
    assert t.releasable() == [0, 1, 2]


def test_table_bounds_the_lead():
    t = SSPTable([0, 1], staleness=S)
    for c in range(S):                       # worker 1 pushes S clocks while 0 is stuck
        t.push(1, c, f"b{c}")
        assert t.complete() == [] and t.releasable() == [1]
    t.push(1, S, f"b{S}")                    # would compute clock S+1 on 0 applied: too far
    assert t.complete() == [] and t.releasable() == []
    t.push(0, 0, "a0")                       # the slow worker catches up one clock
    assert t.complete() == [(0, ["a0", "b0"])]
    assert t.releasable() == [0, 1]          # 1 may now compute clock S+1 (S+1 - 1 <= S)


def test_table_retired_worker_stops_holding_others_back():
    t = SSPTable([0, 1, 2], staleness=0)
    t.push(0, 0, "a0")
    t.push(1, 0, "b0")
    t.retire(2, 0)                           # worker 2 finished without pushing clock 0
    assert t.complete() == [(0, ["a0", "b0"])]
    assert t.releasable() == [0, 1]
    t.retire(0, 1)
    t.retire(1, 1)
    assert t.finished()


def test_table_rejects_out_of_order_clocks():
    t = SSPTable([0, 1], staleness=1)
    t.push(0, 0, "a0")
    with pytest.raises(PsrtError, match="rank 0 at clock 3, expected clock 1"):
        t.push(0, 3, "a3")
    t.retire(1, 0)
    with pytest.raises(PsrtError, match="rank 1, which is not an active worker"):
        t.push(1, 0, "b0")


# ---------------------------------------------------------------- 4 ranks
@pytest.fixture(scope="module")
def records():
    return launch(4, "ps_async_ssp.py", "--staleness", str(S), "--steps", str(STEPS), timeout=300).records()


def phase(records, name, s=None):
    return [r for r in records if r["phase"] == name and (s is None or r["staleness"] == s)]


def test_slow_worker_lets_others_lead_by_at_most_s(records):
    server = next(r for r in phase(records, "clocks", S) if not r["worker"])
    leads = [clock - slowest for _w, clock, slowest, _applied in server["log"]]
    assert len(leads) == 3 * STEPS
    assert max(leads) == S, leads            # never more than s ahead, and it does get there
    for r in phase(records, "clocks", S):
        if r["worker"]:
            # every parameter read misses at most the last s clocks
            assert all(0 <= clock - version <= S for clock, version, _ in r["seen"]), r
            assert [c for c, _, _ in r["seen"]] == list(range(1, STEPS + 1))
    fast = [r for r in phase(records, "clocks", S) if r["worker"] and r["rank"] != 0]
    assert all(max(c - v for c, v, _ in r["seen"]) == S for r in fast)


def test_s0_stays_in_lockstep(records):
    for r in phase(records, "clocks", 0):
        if r["worker"]:
            assert all(clock == version for clock, version, _ in r["seen"]), r
        else:
            assert r["totals"]["max_lead"] == 0


def test_all_workers_finish_with_the_servers_parameters(records):
    for s in (0, S):
        assert len({r["digest"] for r in phase(records, "clocks", s)}) == 1
    assert len({r["digest"] for r in phase(records, "converge")}) == 1


def test_converges_with_staleness(records):
    for r in phase(records, "converge"):
        assert r["after"] < 1e-3 * r["before"], r
