"""What never comes on the psrt backend is named instead of waited for (PSRT_TIMEOUT seconds).

usage: PSRT_TIMEOUT=2 mpirun -np 3 python c10d_stall.py FAILING_RANK {stays|raises}
    Every all-reduce of FAILING_RANK fails there and only there (a broken link, say): the
    error reaches that rank's Work.wait(), future and DDP backward, and the rank prints them.
    stays:  it then keeps to its own code, as a program that caught the error would: the
            watchdog names it to the ranks waiting for it and ends the job.
    raises: the backward's error is not caught: the rank ends the job naming itself.
"""
import json
import sys
import time

import torch
import torch.distributed as dist

import psrt.c10d
from psrt.errors import PsrtError

psrt.c10d.init_process_group()
rank = dist.get_rank()
failing, after = int(sys.argv[1]), sys.argv[2]
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
model(torch.ones(2, 4)).sum().backward()      # DDP's all-reduces: every rank gets here
if rank == failing:
    def broken(*args, **kwargs):
        raise PsrtError(f"injected failure on rank {rank}")
    dist.group.WORLD.group.allreduce = broken
    errors = {}
    work = dist.all_reduce(torch.ones(4), async_op=True)
    for name, call in (("wait", work.wait), ("future", lambda: work.get_future().wait())):
        try:
            call()
        except Exception as err:  # noqa: BLE001
            errors[name] = str(err)
    if after == "stays":
        try:
            model(torch.ones(2, 4)).sum().backward()
        except RuntimeError as err:
            errors["backward"] = str(err)
    print("PSRT-RESULT " + json.dumps({"rank": rank, "errors": errors}), flush=True)
    if after == "stays":
        time.sleep(60)                       # in its own code, calling nothing
model(torch.ones(2, 4)).sum().backward()     # raises on the failing rank (after == "raises")
print("PSRT-RESULT {\"finished\": true}", flush=True)
dist.destroy_process_group()
