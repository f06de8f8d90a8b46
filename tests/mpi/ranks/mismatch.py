"""Rank-side: collectives called with disagreeing arguments fail on every rank, naming ranks.

Each case is run in a fresh Communicator so one failure does not leave the next half-done.
"""
import json
import time

import torch

import psrt
from psrt.errors import CollectiveMismatch

world = psrt.init()
r, n = world.rank, world.size
cases = {
    "shape": lambda c: c.allreduce(torch.ones(5 if r == 1 else 4)),
    "dtype": lambda c: c.allreduce(torch.ones(4, dtype=torch.float64 if r == n - 1 else torch.float32)),
    "op": lambda c: c.allreduce(torch.ones(4), op="max" if r == 0 else "sum"),
    "root": lambda c: c.broadcast(torch.ones(4), root=r % 2),
    "order": lambda c: (c.broadcast(torch.ones(4)) if r == 1 else c.allreduce(torch.ones(4))),
    "allgather-row": lambda c: c.allgather(torch.ones(2, 3 if r == 0 else 2)),
    "later-call": lambda c: [c.allreduce(torch.ones(4)) for _ in range(3)] + [c.allreduce(torch.ones(6 if r == 1 else 4))],
}
results = {}
for name, call in cases.items():
    mode = "all" if name == "later-call" else "cheap"
    comm = psrt.Communicator(world.comm, check=mode)
    t0 = time.monotonic()
    try:
        call(comm)
        results[name] = {"raised": False}
    except CollectiveMismatch as err:
        results[name] = {"raised": True, "message": str(err), "seconds": time.monotonic() - t0}
    comm.close()
# (a later disagreement under the default mode: mismatch_calls.py)
# Long lines from several ranks can be cut and interleaved by mpirun's output forwarding:
# rank 0 alone prints, one record per rank.
everyone = world.comm.gather(results, root=0)
if r == 0:
    for rank, res in enumerate(everyone):
        print("PSRT-RESULT " + json.dumps({"rank": rank, "results": res}), flush=True)
