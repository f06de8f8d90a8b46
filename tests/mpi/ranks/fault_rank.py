"""Rank-side: one rank fails in its own code while the others wait in an allreduce.

    fault_rank.py MODE BAD_RANK HOOK [TAG]
MODE raise: RuntimeError in user code after 3 collectives; kill: SIGKILL itself.
HOOK 1 installs psrt.faults (one line + MPI_Abort); 0 runs without it.
"""
import os
import signal
import sys
import time

import torch

import psrt

mode, bad, hook = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
if hook:
    from psrt import faults
    faults.install("fault_rank")
world = psrt.init()
comm = psrt.Communicator(world.comm)
for _ in range(3):
    comm.allreduce(torch.ones(16))
if world.rank == bad:
    print("PSRT-RESULT {\"fault_at\": %r}" % time.time(), flush=True)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError("injected failure in user code")
comm.allreduce(torch.ones(16))         # the others wait here for the bad rank
print("PSRT-RESULT {\"finished\": true}", flush=True)
