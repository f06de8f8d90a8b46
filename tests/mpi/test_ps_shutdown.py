"""Parameter servers wind down when workers finish after different numbers of steps: each
worker's DONE sentinel retires it, servers stop once every worker is retired.  A hang fails
through the subprocess timeout."""
from __future__ import annotations

from collections import defaultdict

import pytest
from test_ps import launch

STEPS = [1, 4, 2, 3]


@pytest.fixture(scope="module")
def records():
    return launch(4, "ps_shutdown.py", timeout=240).records()


def test_every_layout_shuts_down(records):
    cases = defaultdict(list)
    for r in records:
        if r["case"] == "lost-worker":
            continue
        cases[r["case"]].append(r)
    assert len(cases) == 7 and all(len(rs) == 4 for rs in cases.values())
    for rs in cases.values():
        for r in rs:
            assert r["steps"] == (STEPS[r["rank"]] if r["worker"] else 0), r


def test_async_workers_get_the_final_parameters(records):
    for case in ("ps-async{'staleness': 0}", "ps-async{'staleness': 2}"):
        assert len({r["digest"] for r in records if r["case"] == case}) == 1


def test_dropouts_average_over_the_remaining_workers(records):
    """ps --servers 1 and ps-async with s = 0 treat a retired worker the same way (later
    steps average over the workers still training), so the longest-running worker of ps
    ends where ps-async's final parameters are."""
    longest = next(r for r in records if r["case"] == "ps{'servers': 1}" and r["rank"] == 1)
    final = {r["digest"] for r in records if r["case"] == "ps-async{'staleness': 0}"}
    assert final == {longest["digest"]}


def test_a_worker_that_never_finishes_is_an_error_not_a_hang(records):
    lost = {r["rank"]: r for r in records if r["case"] == "lost-worker"}
    assert "no gradient or DONE from worker rank(s) [2]" in lost[3]["error"]
    assert "finish()" in lost[3]["error"]
    for rank in (0, 1):
        assert "no parameters from server rank(s) [3]" in lost[rank]["error"]
    assert lost[2]["error"] is None
    assert all(r["wait_s"] < 30 for r in lost.values())
