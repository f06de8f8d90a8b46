"""Rank-side soak: many mixed collectives of random sizes, every result verified, memory flat.

    soak.py OPS SECONDS

All ranks draw the same sequence of (collective, algorithm, size, blocking?) from one seed, so
they agree on what to call; each rank's data depends on its rank, so results are checkable.
Stops after OPS operations or SECONDS, whichever comes first (rank 0 decides, every 50 ops).
"""
import ctypes
import gc
import json
import resource
import sys
import time

import numpy as np
import torch

import psrt
from psrt.collectives import ALGORITHMS
from psrt.collectives.algorithms import THROUGH_TORCH

ops_max, seconds = int(sys.argv[1]), float(sys.argv[2])
world = psrt.init()
comm = psrt.Communicator(world.comm)
control = world.comm.Dup()   # the stop vote must not share a communicator with in-flight ops
r, n = world.rank, world.size
rng = np.random.default_rng(2024)          # same stream on every rank
tri = n * (n + 1) / 2
kinds = ["allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall"]


# Sub-communicators, datatypes and torch's own caches are made on first use of each
# (collective, algorithm) pair: memory is compared from here on.
WARMUP_OPS = 1000


def rss_mb() -> float:
    """Resident memory in MiB, of live objects: freed memory the allocator keeps for reuse
    (glibc's arenas grow with the random sizes) is handed back first, so that what is left
    to grow is a leak, not the allocator's cache."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):     # not glibc: RSS as it is
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def one(kind, algo, numel, async_op):
    """Run one collective; return whether its result is right."""
    x = torch.full((numel,), float(r + 1))
    if kind == "allreduce":
        res = comm.allreduce(x, algorithm=algo, async_op=async_op)
        return lambda: bool(torch.all((res.wait() if async_op else res) == tri))
    if kind == "reduce_scatter":
        res = comm.reduce_scatter(x, algorithm=algo, async_op=async_op)
        want = psrt.collectives.even_counts(numel, n)[r]
        return lambda: (lambda y: y.numel() == want and bool(torch.all(y == tri)))(res.wait() if async_op else res)
    if kind == "allgather":
        res = comm.allgather(x, algorithm=algo, async_op=async_op, counts=[numel] * n)
        want = torch.arange(1, n + 1, dtype=torch.float32).repeat_interleave(numel)
        return lambda: bool(torch.equal(res.wait() if async_op else res, want))
    if kind == "broadcast":
        root = numel % n
        res = comm.broadcast(x, root=root, algorithm=algo, async_op=async_op)
        return lambda: bool(torch.all((res.wait() if async_op else res) == root + 1))
    if kind == "reduce":
        root = numel % n
        res = comm.reduce(x, root=root, algorithm=algo, async_op=async_op)
        return lambda: (lambda y: y is None if r != root else bool(torch.all(y == tri)))(res.wait() if async_op else res)
    blocks = torch.arange(n, dtype=torch.float32).repeat_interleave(max(numel // n, 1)) + 100 * r
    res = comm.alltoall(blocks, async_op=async_op)
    want = (torch.full((n,), float(r)) + 100 * torch.arange(n)).repeat_interleave(max(numel // n, 1))
    return lambda: bool(torch.equal(res.wait() if async_op else res, want))


t0, done, wrong, pending, rss = time.monotonic(), 0, 0, [], {}
while done < ops_max:
    kind = kinds[rng.integers(len(kinds))]
    algos = ALGORITHMS.get(kind, ("native",))
    algo = [a for a in algos if a not in THROUGH_TORCH][rng.integers(len([a for a in algos if a not in THROUGH_TORCH]))] \
        if kind != "alltoall" else None
    numel = int(rng.choice([0, 1, 3, 17, 1000, 4099, 65536, 300_000], p=[.05, .1, .1, .15, .2, .2, .15, .05]))
    async_op = bool(rng.integers(2))
    check = one(kind, algo, numel, async_op) if kind != "alltoall" else one(kind, None, numel, async_op)
    pending.append((check, f"{kind} {algo} n={numel} async={async_op}"))
    if len(pending) >= 8 or not async_op:
        for c, what in pending:
            if not c():
                wrong += 1
        pending.clear()
    done += 1
    if done == WARMUP_OPS:
        rss["after_warmup"] = rss_mb()
    if done % 50 == 0 and control.bcast(time.monotonic() - t0 > seconds, root=0):
        break
for c, _ in pending:
    wrong += 0 if c() else 1
rss["end"] = rss_mb()
comm.barrier()
print("PSRT-RESULT " + json.dumps({"rank": r, "ops": done, "wrong": wrong, "rss": rss,
                                   "seconds": time.monotonic() - t0}), flush=True)
comm.close()
