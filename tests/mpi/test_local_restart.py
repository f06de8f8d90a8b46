"""`mpi_launch --restarts 1 -np 4` on this machine alone (no hostfile, no slot count: 4 ranks
may be more than its cores), one rank SIGKILLed before step 5 (PSRT_KILL_AT): the host still
answers, so the restart runs the 4 ranks asked for, psrt.train continues from its checkpoint of
step 4, and the run finishes (about 45 s on 2 busy cores)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.mpi


def test_a_killed_rank_on_a_living_host_restarts_with_every_rank(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_", "PMIX_", "PSRT_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PSRT_TIMEOUT="20", PSRT_KILL_AT="1:5",
               PSRT_LOG_DIR=str(tmp_path / "logs"))
    argv = [sys.executable, str(ROOT / "mpi_launch"), "--restarts", "1", "-np", "4",
            sys.executable, "-m", "psrt.train", "--dp", "ring", "--steps", "8", "--batch-size", "32",
            "--width", "16", "--seed", "5", "--quiet", "--checkpoint", str(tmp_path / "ck.pt"),
            "--checkpoint-every", "2"]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT,
                         stdin=subprocess.DEVNULL)
    log = out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "psrt: PSRT_KILL_AT: rank 1 killed before step 5" in log, log
    assert "mpi_launch: restart 1: 4 rank(s) on localhost, from the last checkpoint" in log, log
    assert "psrt.train: restart 1: ring continues from step 4" in log, log
    assert "not answering" not in log, log
    # the job ended cleanly, after its restart: nothing of it is left in the log directory
    assert not list((tmp_path / "logs").glob("*")), list((tmp_path / "logs").rglob("*"))
