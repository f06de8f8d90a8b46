"""Rank-side: every psrt algorithm on CUDA tensors equals the CPU result; then every other
collective, on tensors of several staged pieces (uneven counts, large all-to-all blocks),
equals the same call on the CPU."""
import json

import torch

import psrt
from psrt.collectives import ALGORITHMS
from psrt.collectives.algorithms import THROUGH_TORCH
from psrt.collectives.staged import Stager
from psrt.transport import forced_but_unsupported

world = psrt.init()

# PSRT_CUDA_AWARE=1 from a test that cannot ask the library itself (the pytest process is no
# MPI process): on an MPI that is not CUDA-aware the ranks report a skip instead of crashing.
if forced_but_unsupported():
    print("PSRT-RESULT " + json.dumps({"rank": world.rank, "skip": forced_but_unsupported()}), flush=True)
    raise SystemExit(0)
torch.cuda.set_device(world.local_rank % torch.cuda.device_count())
comm = psrt.Communicator(world.comm)
stagers = {side: Stager(reduce_on=side) for side in ("host", "gpu")}
failures, checked = [], 0
for dtype in (torch.float32, torch.bfloat16):
    for numel in (0, 1, 3, 1 << 20, (3 << 20) + 5):   # the last: several staged chunks, a partial one
        base = torch.arange(numel, dtype=torch.float32) % 16   # exact in bfloat16 too
        x = base.to(dtype) * (world.rank + 1)
        want = (base * (world.size * (world.size + 1) // 2)).to(dtype)
        for reduce_on in ("host", "gpu"):     # where a staged all-reduce adds (PSRT_STAGED_REDUCE)
            comm._stager = stagers[reduce_on]
            for algo in ALGORITHMS["allreduce"]:
                if algo in THROUGH_TORCH:   # the default group is gloo; nccl: tests/mpi/ranks/nccl_check.py
                    continue
                got = comm.allreduce(x.cuda(), algorithm=algo)
                checked += 1
                if not (got.is_cuda and torch.equal(got.cpu(), want)):
                    failures.append(f"{algo} reduced on {reduce_on} {dtype} n={numel}")
        t = torch.full((5,), float(world.rank), device="cuda")
        comm.broadcast(t, root=0)
        checked += 1
        if not torch.equal(t.cpu(), torch.zeros(5)):
            failures.append(f"broadcast {dtype}")


def same_as_cpu(name, call, x):
    """The call on x moved to the GPU equals it on x on the CPU."""
    global checked
    want, got = call(x), call(x.cuda())
    checked += 1
    if want is None and got is None:
        return
    if got is None or not got.is_cuda or not torch.equal(got.cpu(), want):
        failures.append(name)


n, r = world.size, world.rank
for dtype in (torch.float32, torch.bfloat16):
    rows = ((3 << 20) + 5) // 4
    x = ((torch.arange(rows * 4) + r) % 16).to(dtype).view(rows, 4)
    counts = [rows // n + (7 if j == 0 else 0) for j in range(n)]
    counts[-1] = rows - sum(counts[:-1])
    for algo in ("ring", "ps", "native"):
        same_as_cpu(f"reduce_scatter {algo} {dtype}", lambda t: comm.reduce_scatter(t, counts=counts, algorithm=algo), x)
        same_as_cpu(f"allgather {algo} {dtype}", lambda t: comm.allgather(t[:counts[r]], algorithm=algo), x)
    for algo in ("tree", "native"):
        same_as_cpu(f"broadcast {algo} {dtype}", lambda t: comm.broadcast(t.clone(), root=n - 1, algorithm=algo), x)
        same_as_cpu(f"reduce {algo} {dtype}", lambda t: comm.reduce(t, root=n - 1, algorithm=algo), x)
    send = [(r + j) % 3 * (rows // (3 * n)) for j in range(n)]     # none, or blocks of several pieces
    for algo in ("pairwise", "native"):
        same_as_cpu(f"alltoallv {algo} {dtype}", lambda t: comm.alltoallv(t[:sum(send)], send, algorithm=algo), x)
print("PSRT-RESULT " + json.dumps({"rank": world.rank, "failures": failures, "checked": checked}), flush=True)
