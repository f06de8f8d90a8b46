#!/bin/bash
# A Slurm batch job in the usual shape: psrt.train's PS-vs-ring comparison on 2 nodes x 4 tasks.
#
#   sbatch examples/slurm_job.sh                      # on a Slurm cluster
#   python -m psrt.cluster up --slurm --hostfile hostfiles/two_nodes
#   python -m psrt.cluster exec node0 -- sbatch --wait examples/slurm_job.sh --steps 50
#
# Extra arguments go to psrt.train.  srun starts the ranks (Open MPI through PMIx); psrt takes
# rank, local rank and node from MPI and says where each rank landed in the summary.
#SBATCH --job-name=psrt-ps-vs-ring
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --time=00:10:00
#SBATCH --output=psrt-%j.out

set -euo pipefail
echo "job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: $SLURM_NTASKS tasks"
srun --mpi=pmix python -m psrt.info
srun --mpi=pmix python -m psrt.train --dp ps,ring "$@"
