"""What each launcher exports to its ranks, shared by the unit and the MPI tests of psrt.world."""

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
