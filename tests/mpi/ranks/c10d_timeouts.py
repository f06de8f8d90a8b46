"""Every wait of the psrt backend ends within its group's timeout, with an error naming the call.

usage: PSRT_TIMEOUT=300 mpirun -np 2 python c10d_timeouts.py
    The default group is made with init_process_group(timeout=3 s), so the group's timeout,
    not PSRT_TIMEOUT, must govern.  Rank 0 makes calls that rank 1 never answers: a receive
    from rank 1, a receive from any rank, an irecv waited on, an all-reduce and a barrier on a
    group of both ranks (timeout 3 s) that rank 1 never calls, and a barrier with a per-call
    timeout of 1 s on a group whose own timeout is 60 s.
    It prints, for each, the error and the seconds it took; rank 1 waits for it at the end.
"""
import json
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from mpi4py import MPI

import psrt.c10d

GROUP_TIMEOUT = 3.0
psrt.c10d.init_process_group(timeout=timedelta(seconds=GROUP_TIMEOUT))
rank = dist.get_rank()
pair = dist.new_group([0, 1], timeout=timedelta(seconds=GROUP_TIMEOUT))
lone = dist.new_group([0, 1], timeout=timedelta(seconds=60))     # its barrier sets a shorter one
calls = {
    "recv": lambda: dist.recv(torch.empty(2), src=1, tag=9),
    "recv-any": lambda: dist.recv(torch.empty(2), tag=8),
    "irecv-wait": lambda: dist.irecv(torch.empty(2), src=1, tag=7).wait(),
    "all_reduce": lambda: dist.all_reduce(torch.ones(3), group=pair),
    "barrier-call-timeout": lambda: dist.barrier(group=lone, timeout=timedelta(seconds=1)),
}
if rank == 0:
    out = {}
    for name, call in calls.items():
        t0 = time.monotonic()
        try:
            call()
            error = None
        except Exception as err:  # noqa: BLE001 - the error is the result
            error = f"{type(err).__name__}: {err}"
        out[name] = {"error": error, "seconds": round(time.monotonic() - t0, 2)}
    print("PSRT-RESULT " + json.dumps(out), flush=True)
# Rank 1 waits for rank 0 on MPI's own world: a call of the default group would itself time out.
MPI.COMM_WORLD.Barrier()
dist.destroy_process_group()
print(f"rank {rank}: done", flush=True)
