"""Rank-side: a user's torch.distributed script on psrt where one rank skips a collective.

usage: mpirun -np 2 python skipped_call.py {skip|late}
    skip: only rank 0 calls dist.all_reduce; rank 1 goes on to destroy_process_group.  Rank 0
          must end within seconds, naming the call and the rank that left.
    late: rank 1 calls the all_reduce 10 s after rank 0; rank 0 prints the CPU time it spent
          waiting.
"""
import json
import sys
import time

import torch
import torch.distributed as dist

import psrt.c10d

psrt.c10d.init_process_group()
rank = dist.get_rank()
dist.all_reduce(torch.ones(4))          # every rank makes this one
if sys.argv[1] == "skip":
    if rank == 0:
        sys.stdout.write("PSRT-RESULT " + json.dumps({"waiting_since": time.time()}) + "\n")
        sys.stdout.flush()
        dist.all_reduce(torch.ones(4))
        sys.stdout.write("PSRT-RESULT {\"finished\": true}\n")
else:
    cpu, wall = time.process_time(), time.monotonic()
    if rank == 1:
        time.sleep(10)
    t = torch.ones(4)
    dist.all_reduce(t)
    if rank == 0:
        sys.stdout.write("PSRT-RESULT " + json.dumps({"cpu_s": time.process_time() - cpu,
                                                      "wall_s": time.monotonic() - wall,
                                                      "sum": t.tolist()}) + "\n")
dist.destroy_process_group()
