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

The staged path of CUDA all-reduces (psrt/collectives/staged.py) on the CPU, its copy lanes
running every copy late (late_lanes.py): every algorithm, dtype, op, a partial last chunk, no
elements, non-contiguous input and output, against the same reference, reduced on the host
and (PSRT_STAGED_REDUCE=gpu) all-gathered and reduced on the device; and every other
collective's staged path against the same call unstaged (staged_calls.py).

Then which entry of the all-reduce table (psrt/collectives/paths.py) ran each kind of call, as
the trace names it, and that an entry put first in a Communicator's table runs the calls it
is enabled for, with the bookkeeping around it (count, state, span).
"""
import json

import numpy as np
import torch

import psrt
from psrt.trace import Tracer
from psrt.collectives import paths, small
from psrt.collectives.algorithms import THROUGH_TORCH
from psrt.collectives.implementations import ALLREDUCE
from psrt.collectives.staged import Pool, Stager
from late_lanes import LateLanes
import staged_calls

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


class StagedOnCpu(paths.Staged):
    """The staged entry taking CPU tensors too, so that its schedule runs here."""
    def enabled(self, group, call) -> bool:
        return call.algo not in THROUGH_TORCH


staged = psrt.Communicator(comm)
staged.paths = (StagedOnCpu(),)
for reduce_on, algo in ((w, a) for w in ("host", "gpu") for a in ALLREDUCE if a not in THROUGH_TORCH):
    staged._stager = Stager(Pool(chunk_bytes=256, pin=False), lanes_for=LateLanes, reduce_on=reduce_on)
    for numel in (0, 1, 37, 300):       # 300 float32 = 1200 bytes: 4 chunks and a partial fifth
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            for op in ("sum", "max") + (("avg",) if dtype.is_floating_point else ()):
                every = np.stack([values(q, numel, op, torch.float64).numpy() for q in range(n)])
                want = torch.from_numpy(every.sum(0) / n if op == "avg" else REDUCE[op](every, axis=0)).to(dtype)
                wide = torch.zeros(numel, 2, dtype=dtype)
                wide[:, 1] = values(r, numel, op, dtype)
                out = torch.full((numel, 2), 7, dtype=dtype)[:, 0]
                got = staged.allreduce(wide[:, 1], op=op, out=out, algorithm=algo)
                checked += 1
                if not (got is out and torch.allclose(got.double(), want.double(), rtol=1e-2)):
                    failures.append(f"staged {algo} reduced on {reduce_on} n={numel} {op} {dtype}")
staged.close()
staged_failures, staged_checked = staged_calls.check(comm)
failures += staged_failures


class Counted:
    """An entry for the 'tree' algorithm only, delegating to the general path."""
    name = "counted"

    def __init__(self):
        self.ran = 0

    def enabled(self, group, call) -> bool:
        return call.algo == "tree"

    def run(self, group, call):
        self.ran += 1
        return paths.General().run(group, call)


traced = psrt.Communicator(comm, algorithm="ring", tracer=Tracer())
counted = Counted()
traced.paths = (counted,) + traced.paths
x = torch.ones(4)
calls = [traced.allreduce(x, out=x.clone()),                  # made ready (shape)
         traced.allreduce(x),                                  # ready
         traced.allreduce(torch.ones(4, 2)[:, 0]),             # not contiguous: once
         traced.allreduce(torch.ones(4, dtype=torch.bfloat16)),  # no NumPy dtype: general
         traced.allreduce(x, algorithm="native", out=x.clone()),  # made ready
         traced.allreduce(torch.ones(small.SMALL_BYTES // 4 + 1), algorithm="native"),  # MPI's, into the output
         traced.allreduce(x, algorithm="tree"),                # the entry put first
         traced.allreduce(x, algorithm="tree", async_op=True).wait()]
if any(not torch.equal(c.float().reshape(-1), torch.full((c.numel(),), float(n))) for c in calls):
    failures.append(f"traced calls: {calls}")
ran_paths = [args.get("path") for name, _, _, _, _, args in traced.tracer.events if name == "allreduce"]
state = traced.state
traced.close()
bound = [len(group._ready.bound) for group in groups]
for group in groups:
    group.close()
print("PSRT-RESULT " + json.dumps({"rank": r, "failures": failures, "checked": checked, "staged_calls": staged_checked, "bound": bound,
                                   "paths": ran_paths, "counted": counted.ran, "state": list(state)}),
      flush=True)
