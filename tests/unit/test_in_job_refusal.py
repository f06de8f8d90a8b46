"""Which runs `mpi_launch --in-job-recovery` serves (psrt.train.in_job.refusal), without MPI."""
from __future__ import annotations

import pytest

from psrt.train.in_job import FROM_CHECKPOINT, FULL_REPLICA, refusal


@pytest.mark.parametrize("dp", FULL_REPLICA)
def test_full_replica_strategies_recover_inside_the_job(dp):
    assert refusal(dp, grid=False, precision="fp32", why_not_ulfm=None) is None
    assert refusal(dp, grid=False, precision="bf16", why_not_ulfm=None) is None


@pytest.mark.parametrize("dp", FROM_CHECKPOINT)
def test_a_state_on_one_rank_comes_back_from_the_checkpoint(dp):
    assert refusal(dp, grid=False, precision="fp32", why_not_ulfm=None, checkpoint=True) is None
    why = refusal(dp, grid=False, precision="fp32", why_not_ulfm=None)
    assert "--checkpoint FILE" in why and "\n" not in why
    why = refusal(dp, grid=False, precision="fp32", why_not_ulfm=None, checkpoint=True, servers=2)
    assert "--servers 2" in why and "--restarts" in why


@pytest.mark.parametrize("dp,grid,precision,says", [
    ("ps-async", False, "fp32", "--restarts"), ("horovod", False, "fp32", "--restarts"),
    ("torch", False, "fp32", "gloo"), ("ring", True, "fp32", "grid"), ("ring", False, "fp16", "loss scale")])
def test_other_runs_are_refused_in_one_line(dp, grid, precision, says):
    why = refusal(dp, grid=grid, precision=precision, why_not_ulfm=None, checkpoint=True)
    assert why and says in why and "\n" not in why and why.startswith(f"--dp {dp} ")


def test_an_mpi_without_ulfm_points_to_restarts():
    why = refusal("ring", grid=False, precision="fp32", why_not_ulfm="the MPI here (Open MPI v4.1.4) has none")
    assert "Open MPI v4.1.4" in why and "--restarts" in why
