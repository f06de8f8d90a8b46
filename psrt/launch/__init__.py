"""Launching: mpi_launch (plan.py builds the mpirun / srun command line), hostfiles, the
emulated cluster (cluster.py) and `python -m psrt.info` (info.py).  Nothing here imports torch."""
