"""psrt.world: which launcher started this process and how many ranks it announced, from
the variables each launcher really exports."""
from __future__ import annotations

import pytest
from launcher_env import (HOROVOD_GLOO, HOROVOD_MPI, HYDRA, HYDRA_IN_SLURM, MPIRUN_IN_SLURM,
                          OPENMPI4, OPENMPI5, SLURM_STEP, SRUN_PMI2, SRUN_PMIX, TORCHRUN)

from psrt.world import _env_world_size, _mismatch, detect_launcher, yield_before_mpi_starts

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


@pytest.mark.parametrize("case", list(CASES))
def test_launcher_and_announced_size(case):
    env, launcher, size = CASES[case]
    assert detect_launcher(env) == launcher
    assert _env_world_size(env) == size


def test_mismatch_messages_say_what_to_run():
    msg = _mismatch("torchrun", 4, 1, TORCHRUN)
    assert msg.startswith("torchrun started 4 processes without MPI") and "mpi_launch -np 4" in msg
    msg = _mismatch("horovodrun", 4, 1, HOROVOD_GLOO)
    assert msg.startswith("horovodrun --gloo started 4 processes") and "horovodrun --mpi" in msg
    msg = _mismatch("openmpi", 4, 1, OPENMPI4)
    assert "different MPI libraries" in msg


@pytest.mark.parametrize("environ,yields", [
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "64"}, True),                  # mpirun, crowded
    ({"HOROVOD_LOCAL_SIZE": "64"}, True),                          # horovodrun, crowded
    ({"SLURM_NTASKS_PER_NODE": "64"}, True),                       # srun, crowded
    ({"SLURM_TASKS_PER_NODE": "1,64(x2)", "SLURM_NODEID": "2"}, True),   # srun -n, crowded here
    ({"SLURM_TASKS_PER_NODE": "1,64(x2)", "SLURM_NODEID": "0"}, False),  # one task on this node
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, False),                  # one rank: poll
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "64", "PSRT_YIELD": "0"}, False),
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "1", "PSRT_YIELD": "1"}, True),
    ({}, False),                                                   # one plain process
])
def test_crowded_hosts_yield_before_mpi_starts(environ, yields):
    environ = dict(environ)
    said = yield_before_mpi_starts(environ)
    assert (environ.get("OMPI_MCA_mpi_yield_when_idle") == "1") is yields and bool(said) is yields


def test_a_yield_setting_of_the_user_wins():
    environ = {"OMPI_COMM_WORLD_LOCAL_SIZE": "64", "OMPI_MCA_mpi_yield_when_idle": "0"}
    assert yield_before_mpi_starts(environ) is None and environ["OMPI_MCA_mpi_yield_when_idle"] == "0"


@pytest.mark.parametrize("inherited,psrt_yield", [("1", "0"), ("0", "1")])
def test_psrt_yield_wins_over_what_the_launcher_passed(inherited, psrt_yield):
    """mpirun --mca, mpi_launch and the emulated cluster hand the ranks an
    OMPI_MCA_mpi_yield_when_idle; PSRT_YIELD still decides what MPI_Init reads."""
    environ = {"OMPI_COMM_WORLD_LOCAL_SIZE": "64", "OMPI_MCA_mpi_yield_when_idle": inherited,
               "PSRT_YIELD": psrt_yield}
    yield_before_mpi_starts(environ)
    assert environ["OMPI_MCA_mpi_yield_when_idle"] == psrt_yield


def test_psrt_yield_0_makes_ranks_poll_even_where_mpirun_would_yield():
    """Open MPI yields on its own where mpirun knows the host is oversubscribed: PSRT_YIELD=0
    has to say 0 explicitly for the ranks to poll."""
    environ = {"OMPI_COMM_WORLD_LOCAL_SIZE": "64", "PSRT_YIELD": "0"}
    assert yield_before_mpi_starts(environ) is None and environ["OMPI_MCA_mpi_yield_when_idle"] == "0"
