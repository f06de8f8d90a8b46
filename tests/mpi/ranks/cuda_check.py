"""Rank-side: every psrt algorithm on CUDA tensors equals the CPU result."""
import json

import torch

import psrt
from psrt.collectives import ALGORITHMS
from psrt.collectives.algorithms import THROUGH_TORCH

world = psrt.init()
torch.cuda.set_device(world.local_rank % torch.cuda.device_count())
comm = psrt.Communicator(world.comm)
failures, checked = [], 0
for dtype in (torch.float32, torch.bfloat16):
    for numel in (0, 1, 3, 1 << 20, (3 << 20) + 5):   # the last: several staged chunks, a partial one
        base = torch.arange(numel, dtype=torch.float32) % 16   # exact in bfloat16 too
        x = base.to(dtype) * (world.rank + 1)
        want = (base * (world.size * (world.size + 1) // 2)).to(dtype)
        for algo in ALGORITHMS["allreduce"]:
            if algo in THROUGH_TORCH:   # the default group is gloo; nccl: tests/mpi/ranks/nccl_check.py
                continue
            got = comm.allreduce(x.cuda(), algorithm=algo)
            checked += 1
            if not (got.is_cuda and torch.equal(got.cpu(), want)):
                failures.append(f"{algo} {dtype} n={numel}")
        t = torch.full((5,), float(world.rank), device="cuda")
        comm.broadcast(t, root=0)
        checked += 1
        if not torch.equal(t.cpu(), torch.zeros(5)):
            failures.append(f"broadcast {dtype}")
print("PSRT-RESULT " + json.dumps({"rank": world.rank, "failures": failures, "checked": checked}), flush=True)
