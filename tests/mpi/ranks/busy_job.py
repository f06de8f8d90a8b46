"""Rank-side: a job that runs until it is stopped, all-reducing in a loop (the ranks are
inside MPI most of the time, as a training job is).

usage: mpirun -np N python busy_job.py TAG [ignore-term]
    prints "running" once every rank has made a call; `ignore-term`: the ranks ignore SIGTERM
    (a program with a handler of its own that does not exit), so only SIGKILL ends them.
"""
import signal
import sys

import torch

import psrt

if "ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
world = psrt.init()
comm = psrt.Communicator(world.comm)
comm.allreduce(torch.ones(4))
if world.rank == 0:
    sys.stdout.write("running\n")
    sys.stdout.flush()
while True:
    comm.allreduce(torch.ones(1024))
