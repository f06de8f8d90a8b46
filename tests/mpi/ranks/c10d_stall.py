"""What never comes on the psrt backend is named instead of waited for (PSRT_TIMEOUT seconds).

usage: PSRT_TIMEOUT=2 mpirun -np 3 python c10d_stall.py SLOW_RANK
    SLOW_RANK stops calling collectives: the watchdog names it and ends the job.
usage: PSRT_TIMEOUT=2 mpirun -np 2 python c10d_stall.py recv
    rank 0 waits for a message rank 1 never sends: the receive raises, naming the peer.
"""
import json
import sys
import time

import torch
import torch.distributed as dist

import psrt.c10d

psrt.c10d.init_process_group()
rank = dist.get_rank()
if sys.argv[1] == "recv":
    if rank == 0:
        try:
            dist.recv(torch.empty(2), src=1, tag=9)
            error = None
        except Exception as err:  # noqa: BLE001
            error = str(err)
        print("PSRT-RESULT " + json.dumps({"error": error}), flush=True)
    else:
        time.sleep(4)
    dist.barrier()
else:
    slow = int(sys.argv[1])
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    model(torch.ones(2, 4)).sum().backward()      # DDP's all-reduces: every rank gets here
    if rank == slow:
        time.sleep(60)                           # stuck in its own code
    dist.all_reduce(torch.ones(4))
    print("PSRT-RESULT {\"finished\": true}", flush=True)
dist.destroy_process_group()
