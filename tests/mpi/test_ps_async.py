"""--dp ps-async: the SSP clock table in one process, then a 4-rank run (3 workers + server)
with a deliberately slow worker: fast workers run ahead by at most s clocks (and do reach s,
so the run really is asynchronous), s = 0 stays in lockstep, and training with s > 0 converges.
"""
from __future__ import annotations

import pytest
from test_ps import launch

S = 2
STEPS = 12


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
