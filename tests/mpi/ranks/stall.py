"""Rank-side: one rank does not reach a collective; the watchdog must name it and end the job.

    stall.py SLOW_RANK TIMEOUT_S
"""
import sys
import time

import torch

import psrt
from psrt.watchdog import Watchdog

slow, timeout = int(sys.argv[1]), float(sys.argv[2])
world = psrt.init()
comm = psrt.Communicator(world.comm)
dog = Watchdog(world, [comm], timeout_s=timeout, interval=0.25).start()
comm.allreduce(torch.ones(4))          # call #1: everyone gets here
dog.step(1)
if world.rank == slow:
    time.sleep(60)                     # stuck in its own code, never reaches call #2
comm.allreduce(torch.ones(4))
print("PSRT-RESULT {\"finished\": true}", flush=True)
dog.stop()
