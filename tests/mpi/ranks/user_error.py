"""Rank-side: a user's script whose model raises inside torch on some ranks.

usage: mpi_launch -np N python user_error.py RANKS
    RANKS (comma-separated) feed a batch of the wrong width to an nn.Linear, so torch raises
    in its own linear.py, called from line LINE below; the others wait in an all-reduce.
"""
import sys

import torch

import psrt

world = psrt.init()
comm = psrt.Communicator(world.comm)
comm.allreduce(torch.ones(4))
layer = torch.nn.Linear(4, 4)
width = 3 if world.rank in [int(r) for r in sys.argv[1].split(",")] else 4
out = layer(torch.ones(2, width))          # LINE
comm.allreduce(out.sum().reshape(1))
