"""Rank-side: a divergence at call 1, 3 or 100 of the same all-reduce, under the default check.

usage: mpirun -np 2 python mismatch_calls.py matrix
    Every algorithm (psrt's and the MPI library's), on psrt.Communicator and on
    torch.distributed's psrt backend: calls 1..K-1 agree, at call K rank 1 passes one element
    more (tensors of 4 and of 4M floats; K = 100 with 4M floats for the MPI library's only,
    whose heap it corrupted).  Each rank records, per case, the error it got and
    whether any call before it returned a wrong sum; rank 0 prints every rank's record.
usage: mpirun -np 2 python mismatch_calls.py script ALGORITHM
    A user's script on psrt.c10d whose third all-reduce of 4M floats diverges (an uneven
    last batch), error not caught: the job must end with one line, not a crash.
"""
import json
import sys
import time

import torch
import torch.distributed as dist

import psrt
import psrt.c10d
from psrt.errors import CollectiveMismatch

ALGORITHMS = ("native", "ring", "doubling", "halving-doubling", "tree", "ps")
BIG = 4 << 20

if sys.argv[1] == "script":
    psrt.c10d.init_process_group(pg_options=psrt.c10d.Options(algorithm=sys.argv[2]))
    rank = dist.get_rank()
    for step in range(3):
        n = BIG + (rank if step == 2 else 0)
        t = torch.ones(n)
        dist.all_reduce(t)
        print(f"step {step}: sum {t[0].item()} of {n} floats", flush=True)
    dist.destroy_process_group()
    sys.exit(0)

world = psrt.init()
r, n = world.rank, world.size
psrt.c10d.init_process_group()
results = {}


def case(name, call, at, base):
    """Calls 1..at of `call`; rank 1 adds an element at call `at`."""
    wrong, t0 = 0, None
    try:
        for i in range(1, at + 1):
            size = base + (1 if i == at and r == 1 else 0)
            t0 = time.monotonic()
            got = call(torch.ones(size))
            if not torch.all(got == n):
                wrong += 1
        results[name] = {"raised": None, "wrong": wrong}
    except Exception as err:  # noqa: BLE001 - recorded for the test
        results[name] = {"raised": type(err).__name__, "message": str(err), "wrong": wrong,
                         "seconds": time.monotonic() - t0}


def c10d_call(algo):
    group = dist.new_group(backend="psrt", pg_options=psrt.c10d.Options(algorithm=algo))

    def call(t):
        dist.all_reduce(t, group=group)
        return t
    return call


for algo in ALGORITHMS:
    comm = psrt.Communicator(world.comm, algorithm=algo)
    for at in (1, 3, 100):
        case(f"communicator {algo} call {at} small", comm.allreduce, at, 4)
        if at < 100 or algo == "native":     # 100 calls of 16 MB: the MPI library's alone
            case(f"communicator {algo} call {at} 4M", lambda t: comm.allreduce(t, out=t), at, BIG)
    comm.close()
    call = c10d_call(algo)
    for at in (1, 3):
        case(f"c10d {algo} call {at} small", call, at, 4)
    case(f"c10d {algo} call 3 4M", call, 3, BIG)
    case(f"c10d {algo} call 100 small", call, 100, 4)
# after a caught mismatch the communicator is still in step on every rank
results["after"] = {"sum": psrt.Communicator(world.comm).allreduce(torch.ones(3)).tolist()}
everyone = world.comm.gather(results, root=0)
if r == 0:
    for rank, res in enumerate(everyone):
        print("PSRT-RESULT " + json.dumps({"rank": rank, "results": res}), flush=True)
dist.destroy_process_group()
