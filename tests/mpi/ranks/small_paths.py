"""Rank-side: the small-message path (psrt/collectives/small.py on NumPy views, made ready by
psrt/collectives/ready.py) against the torch implementations of the same algorithms: the same
bits, and the two paths interoperate (a rank on one path and its peer on the other still
match messages).

For every algorithm, size (0, 1, 3, 1000 elements, and 1 MB for sums) and op: (1) every rank
runs the torch implementation on a clone; (2) every rank calls the Communicator in each way a
program does, three times each so that every kind of ready call runs (the first call of a
buffer on a plan of its shape, the second making one bound to the buffer, the third reusing
it): out of place (a fresh result), into a held output, in place, and in place non-blocking,
on a Communicator with plain and one with persistent requests; (3) even ranks run small.py
while odd ranks run the torch implementation.  All must equal (1) bitwise.
"""
import json

import torch

import psrt
from psrt.collectives import small
from psrt.collectives.implementations import ALLREDUCE as _ALLREDUCE
from psrt.transport import np_view

world = psrt.init()
comm = world.comm
groups = [psrt.Communicator(comm), psrt.Communicator(comm, persistent=True)]
r, n = world.rank, world.size
failures, checked = [], 0
for algo in small.ALLREDUCE:
    for numel in (0, 1, 3, 1000, 250_000):      # 250k floats: 1 MB, a step of many chunks
        for op in (("sum", "max", "prod") if numel < 250_000 else ("sum",)):
            for dtype in ((torch.float32, torch.int64) if numel < 250_000 else (torch.float32,)):
                g = torch.Generator().manual_seed(r * 7919 + numel)
                x = (torch.rand(numel, generator=g) * 3 + 0.5).to(dtype) if dtype.is_floating_point \
                    else torch.randint(1, 4, (numel,), generator=g)
                want = x.clone()
                _ALLREDUCE[algo](comm, want, op)
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
                mixed = x.clone()
                if r % 2 == 0:
                    small.allreduce(algo, comm, np_view(mixed), small.UFUNCS[op])
                else:
                    _ALLREDUCE[algo](comm, mixed, op)
                got.append(mixed)
                for i, t in enumerate(got):
                    checked += 1
                    if not torch.equal(t, want):
                        failures.append(f"{algo} n={numel} {op} {dtype} variant {i}")
bound = [len(group._ready.bound) for group in groups]
for group in groups:
    group.close()
print("PSRT-RESULT " + json.dumps({"rank": r, "failures": failures, "checked": checked, "bound": bound}),
      flush=True)
