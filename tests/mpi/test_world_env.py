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

from psrt.world import _mismatch

ROOT = Path(__file__).resolve().parents[2]

# Variables each launcher sets in rank 1 of a 4-rank job on 2 nodes (values as exported).
OPENMPI4 = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "OMPI_COMM_WORLD_NODE_RANK": "0", "OMPI_UNIVERSE_SIZE": "4", "PMIX_RANK": "1",
            "PMIX_NAMESPACE": "1571946497", "OMPI_APP_CTX_NUM_PROCS": "4"}
OPENMPI5 = {**OPENMPI4, "PMIX_NAMESPACE": "prterun-node0-12345@1", "PRTE_MCA_plm": "ssh",
            "OMPI_MCA_orte_precondition_transports": "0"}
HYDRA = {"PMI_RANK": "1", "PMI_SIZE": "4", "PMI_FD": "9", "MPI_LOCALRANKID": "1",
         "MPI_LOCALNRANKS": "2", "PMI_SUBVERSION": "1", "PMI_VERSION": "1"}
SLURM_STEP = {"SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_STEP_ID": "0",
              "SLURM_STEPID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
              "SLURM_NODEID": "0", "SLURM_NTASKS": "4", "SLURM_NPROCS": "4",
              "SLURM_STEP_NUM_TASKS": "4", "SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2",
              "SLURM_TASKS_PER_NODE": "2(x2)", "SLURMD_NODENAME": "node0"}
SRUN_PMI2 = {**SLURM_STEP, "PMI_FD": "7", "PMI_JOBID": "4242.0", "PMI_RANK": "1",
             "PMI_SIZE": "4"}
SRUN_PMIX = {**SLURM_STEP, "PMIX_RANK": "1", "PMIX_NAMESPACE": "slurm.pmix.4242.0",
             "PMIX_SERVER_URI41": "pmix-server.123;tcp4://127.0.0.1:41234"}
# mpirun inside an allocation starts one daemon per node with srun: the ranks inherit the
# daemon's step variables (SLURM_PROCID is the node's index, not the rank).
MPIRUN_IN_SLURM = {**SLURM_STEP, **OPENMPI4, "SLURM_PROCID": "0", "SLURM_STEP_ID": "1",
                   "SLURM_NTASKS": "2"}
HYDRA_IN_SLURM = {**SLURM_STEP, **HYDRA, "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
HOROVOD_GLOO = {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1",
                "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "2",
                "HOROVOD_HOSTNAME": "node0", "HOROVOD_CONTROLLER": "gloo",
                "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1",
                "HOROVOD_GLOO_RENDEZVOUS_PORT": "41000", "HOROVOD_GLOO_IFACE": "eth0",
                "PYTHONUNBUFFERED": "1"}
# horovodrun --mpi runs mpirun -x for the driver's environment: the ranks see Open MPI's
# variables and whatever HOROVOD_* tuning the user set, but no HOROVOD_RANK.
HOROVOD_MPI = {**OPENMPI4, "HOROVOD_FUSION_THRESHOLD": "67108864", "HOROVOD_CYCLE_TIME": "5"}
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "1", "ROLE_NAME": "default",
            "ROLE_WORLD_SIZE": "4", "MASTER_ADDR": "node0", "MASTER_PORT": "29500",
            "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "OMP_NUM_THREADS": "1"}

CASES = {
    "openmpi4": (OPENMPI4, "openmpi", 4),
    "openmpi5": (OPENMPI5, "openmpi", 4),
    "hydra": (HYDRA, "mpich", 4),
    "srun": (SLURM_STEP, "srun", 4),
    "srun-pmi2": (SRUN_PMI2, "srun", 4),
    "srun-pmix": (SRUN_PMIX, "srun", 4),
    "mpirun-in-slurm": (MPIRUN_IN_SLURM, "openmpi", 4),
    "hydra-in-slurm": (HYDRA_IN_SLURM, "mpich", 4),
    "pmix-direct": ({"PMIX_RANK": "1", "PMIX_NAMESPACE": "ns", "PMIX_SIZE": "4"}, "pmix", 4),
    "horovodrun-gloo": (HOROVOD_GLOO, "horovodrun", 4),
    "horovodrun-mpi": (HOROVOD_MPI, "openmpi", 4),
    "torchrun": (TORCHRUN, "torchrun", 4),
    "single": ({}, "single", None),
}


def test_mismatch_messages_say_what_to_run():
    msg = _mismatch("torchrun", 4, 1, TORCHRUN)
    assert msg.startswith("torchrun started 4 processes without MPI") and "mpi_launch -np 4" in msg
    msg = _mismatch("horovodrun", 4, 1, HOROVOD_GLOO)
    assert msg.startswith("horovodrun --gloo started 4 processes") and "horovodrun --mpi" in msg
    msg = _mismatch("openmpi", 4, 1, OPENMPI4)
    assert "different MPI libraries" in msg


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
