#!/bin/bash
# A Slurm batch job that outlives a lost node: psrt.train on 2 nodes x 4 tasks, started again
# on the nodes left after a failure, from its last checkpoint (docs/how-to/reliability.md).
#
#   sbatch examples/slurm_restart_job.sh --dp zero1 --steps 1000      # from the checkout
#
# --no-kill keeps the allocation when a node fails (Slurm's default ends the whole job), and
# mpi_launch --restarts runs the job again as a step on the nodes that still answer, at most
# twice, stopping when fewer than half its ranks are left (MIN_NP).  --requeue: a job requeued whole
# (preempted, `scontrol requeue`) starts this script again, which then resumes from the
# checkpoint.  Extra arguments go to psrt.train; CHECKPOINT names the checkpoint file.
#SBATCH --job-name=psrt-restarts
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --no-kill
#SBATCH --requeue
#SBATCH --time=01:00:00
#SBATCH --output=psrt-%j.out

set -euo pipefail
CHECKPOINT=${CHECKPOINT:-psrt-$SLURM_JOB_ID.ckpt}
resume=()
[ -e "$CHECKPOINT" ] && resume=(--resume)
echo "job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: $SLURM_NTASKS tasks, start ${SLURM_RESTART_COUNT:-0}"
./mpi_launch --launcher srun --restarts 2 --min-np "${MIN_NP:-$((SLURM_NTASKS / 2))}" --extra-args=--mpi=pmix \
    python -m psrt.train --checkpoint "$CHECKPOINT" "${resume[@]}" "$@"
