"""psrt.world under each launcher's conventions.

Launchers not installed here (srun, horovodrun, MPICH's Hydra, Open MPI 5) are checked
through the variables they really export; mpirun (Open MPI 4) and torchrun run for real.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from launcher_env import HOROVOD_GLOO, TORCHRUN

ROOT = Path(__file__).resolve().parents[2]


# One process, MPI initialised once: psrt.world.init() under each environment in turn (its
# launcher check runs before it touches MPI), each reported as one JSON line.
_PROBE = r"""
import json, os, sys
from psrt.errors import PsrtError
from psrt.world import init
base = dict(os.environ)
for name, env in json.loads(sys.argv[1]).items():
    os.environ.clear(); os.environ.update(base); os.environ.update(env)
    try:
        w = init(export_env=False)
        print(json.dumps({"case": name, "launcher": w.launcher, "size": w.size,
                          "rank": w.rank}))
        w.free()
    except PsrtError as err:
        print(json.dumps({"case": name, "error": str(err), "everywhere": err.everywhere}))
"""

MARKERS = ("OMPI_", "PMI_", "PMIX_", "SLURM_", "HOROVOD_", "MPI_LOCAL", "TORCHELASTIC_",
           "RANK", "WORLD_SIZE", "LOCAL_RANK")


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(MARKERS)}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def test_init_in_one_process_under_each_convention():
    """A single process (size 1) is accepted where the launcher says 1 rank, and refused in
    one line where it says more: the processes were not connected by MPI."""
    one = {"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    cases = {
        "plain": {},
        "srun-1": one,
        "srun-2": {**one, "SLURM_NTASKS": "2"},
        "torchrun-1": {**TORCHRUN, "RANK": "0", "WORLD_SIZE": "1"},
        "torchrun-4": TORCHRUN,
        "horovod-gloo-4": HOROVOD_GLOO,
    }
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(cases)], capture_output=True,
                         text=True, timeout=300, env=clean_env(), stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    got = {r["case"]: r for r in map(json.loads, out.stdout.splitlines())}
    assert got["plain"] == {"case": "plain", "launcher": "single", "size": 1, "rank": 0}
    assert got["srun-1"]["launcher"] == "srun" and got["srun-1"]["size"] == 1
    assert got["torchrun-1"]["launcher"] == "torchrun" and got["torchrun-1"]["size"] == 1
    assert "the launcher (srun) announced 2 ranks but MPI sees 1" in got["srun-2"]["error"]
    assert got["torchrun-4"]["error"].startswith("torchrun started 4 processes without MPI")
    assert got["horovod-gloo-4"]["error"].startswith("horovodrun --gloo started 4 processes")
    assert all(r.get("everywhere", True) for r in got.values())


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun on PATH")
def test_under_mpirun(run_ranks):
    recs = sorted(run_ranks(2, "-m", "psrt.info", "--json", timeout=300).check().records(),
                  key=lambda r: r["rank"])
    assert [(r["rank"], r["size"], r["local_rank"], r["local_size"], r["node_rank"],
             r["num_nodes"], r["launcher"]) for r in recs] == [
        (0, 2, 0, 2, 0, 1, "openmpi"), (1, 2, 1, 2, 0, 1, "openmpi")]


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not installed")
def test_under_torchrun():
    """torchrun starts processes without MPI: one process works, more get one clear line."""
    def torchrun(n):
        return subprocess.run(["torchrun", "--standalone", f"--nproc-per-node={n}", "-m",
                               "psrt.info", "--json"], capture_output=True, text=True,
                              timeout=300, env=clean_env(), stdin=subprocess.DEVNULL)
    ok = torchrun(1)
    assert ok.returncode == 0, ok.stderr
    rec = json.loads(ok.stdout.split("PSRT-RESULT ", 1)[1].splitlines()[0])
    assert (rec["launcher"], rec["size"], rec["rank"]) == ("torchrun", 1, 0)
    bad = torchrun(2)
    assert bad.returncode != 0
    lines = [l for l in bad.stderr.splitlines() if "psrt.info: error:" in l]
    # Only rank 0 says it (the error is the same everywhere), and says what to run.
    assert lines == ["[rank 0] psrt.info: error: torchrun started 2 processes without MPI, so "
                     "each is an MPI world of 1: psrt joins ranks through MPI; start them with "
                     "`mpi_launch -np 2 ...` or mpirun"]
