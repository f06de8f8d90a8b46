"""A lost host, end to end: `mpi_launch --emulate --restarts 1` on two emulated hosts, the
second host lost (its processes killed, its link down) after step 12 of 40; the survivors'
watchdog ends the job, the launcher starts it again on the host that answers, psrt.train
continues from its last checkpoint, and the final parameters equal those of a run that never
failed on the survivors' ranks (same global batch).  The same scenario at full size (8 ranks,
step 30 of 100) is `python -m psrt.bench recovery`, whose table is in docs/explanation/results.md."""
from __future__ import annotations

import pytest

from psrt.bench.recovery import one
from test_cluster import needs_openmpi, netns


@netns
@pytest.mark.mpi
@needs_openmpi
@pytest.mark.parametrize("dp", ["zero1", "ps"])   # ring: python -m psrt.bench recovery
def test_a_run_that_loses_a_host_finishes_as_if_it_had_not(dp, tmp_path):
    row = one(dp, hosts=2, per_host=2, steps=40, kill_at=12, batch=64, width=32, timeout_s=5.0,
              folder=tmp_path)
    assert row["killed_after"] < 40 and row["resumed_from"] <= row["killed_after"] + 1, row
    assert row["ranks"] == "4 -> 2"
    assert row["max_diff"] <= 1e-5, row
