"""Rank-side: the small-message path's ready calls (psrt/collectives/ready.py, plans of
psrt/collectives/small.py) against an exact reference, for every algorithm of that path.

For every algorithm, size (0, 1, 3, 1000 elements, and 1 MB for sums) and op, every rank calls
the Communicator in each way a program does, three times each so that every kind of ready call
runs (the first call of a buffer on a plan of its shape, the second making one bound to the
buffer, the third reusing it): out of place (a fresh result), into a held output, in place,
and in place non-blocking, on a Communicator with plain and one with persistent requests;
and the torch path's function of the algorithm (collectives/implementations.py) once.  Run
with a small PSRT_RING_SEGMENT, the ring's chunks are cut into many segments (and windows, on
the torch path).  Inputs are small integers, so every order of reduction gives the same bits as the reference.
"""
import json

import numpy as np
import torch

import psrt
from psrt.collectives import small
from psrt.collectives.implementations import ALLREDUCE

world = psrt.init()
comm = world.comm
groups = [psrt.Communicator(comm), psrt.Communicator(comm, persistent=True)]
r, n = world.rank, world.size
REDUCE = {"sum": np.sum, "max": np.max, "prod": np.prod}
failures, checked = [], 0


def values(rank: int, numel: int, op: str, dtype) -> torch.Tensor:
    rng = np.random.default_rng(rank * 7919 + numel)
    # products of n factors in {1, 2} stay exact in every dtype up to 8 ranks
    v = rng.integers(1, 3, numel) if op == "prod" else rng.integers(-3, 4, numel)
    return torch.from_numpy(v).to(dtype)


for algo in small.ALLREDUCE:
    for numel in (0, 1, 3, 1000, 250_000):      # 250k floats: 1 MB, a step of many chunks
        for op in (("sum", "max", "prod") if numel < 250_000 else ("sum",)):
            for dtype in ((torch.float32, torch.int64) if numel < 250_000 else (torch.float32,)):
                x = values(r, numel, op, dtype)
                every = np.stack([values(q, numel, op, dtype).numpy() for q in range(n)])
                want = torch.from_numpy(np.asarray(REDUCE[op](every, axis=0), dtype=every.dtype))
                got = []
                for group in groups:
                    held, own = torch.empty_like(x), torch.empty_like(x)
                    for _ in range(3):
                        got.append(group.allreduce(x, op=op, algorithm=algo))
                        got.append(group.allreduce(x, op=op, out=held, algorithm=algo).clone())
                        own.copy_(x)
                        got.append(group.allreduce(own, op=op, out=own, algorithm=algo).clone())
                        own.copy_(x)
                        got.append(group.allreduce(own, op=op, out=own, algorithm=algo, async_op=True).wait().clone())
                eager = x.clone()
                ALLREDUCE[algo](comm, eager, op)
                got.append(eager)
                for i, t in enumerate(got):
                    checked += 1
                    if not torch.equal(t, want):
                        failures.append(f"{algo} n={numel} {op} {dtype} variant {i}")
bound = [len(group._ready.bound) for group in groups]
for group in groups:
    group.close()
print("PSRT-RESULT " + json.dumps({"rank": r, "failures": failures, "checked": checked, "bound": bound}),
      flush=True)
