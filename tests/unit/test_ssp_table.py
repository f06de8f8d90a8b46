"""--dp ps-async: the SSP clock table in one process (tests/mpi/test_ps_async.py runs the
protocol on 4 ranks)."""
from __future__ import annotations

import pytest

from psrt.dp.ps_async import SSPTable
from psrt.errors import PsrtError

S = 2


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


