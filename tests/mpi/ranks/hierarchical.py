"""Rank-side check of the hierarchical algorithm on a faked ragged placement.

Run with PSRT_HOSTS giving 3 + 2 + 1 ranks on three hosts, interleaved (e.g. 0,1,0,2,0,1 on
6 ranks).  Every collective hierarchical implements, every dtype and op, sizes from 0 to
more than one element per rank, on the world and on a sub-communicator of 2 hosts x 2 ranks:
small integer inputs make every reduction exact, so the result must equal the MPI library's
('native') bit for bit; random floats must match within rounding.  Also records what
'auto' picks.  Prints one PSRT-RESULT line per rank.
"""
import json

import torch
from mpi4py import MPI

import psrt
from psrt.collectives import Communicator

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
SIZES = [0, 1, 5, 37, 1000]


def values(rank: int, numel: int, dtype, case: int, op: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * case + rank)
    if op == "prod":
        return torch.randint(1, 3, (numel,), generator=g).to(dtype)
    return torch.randint(-3, 4, (numel,), generator=g).to(dtype)


def check(failures: list, what: str, got, want, exact: bool) -> None:
    if got is None and want is None:
        return
    same = torch.equal(got, want) if exact else torch.allclose(got.double(), want.double(), rtol=1e-5, atol=1e-5)
    if not same:
        failures.append(what)


def matrix(comm: Communicator, failures: list, ran: dict) -> None:
    r, n = comm.rank, comm.size
    case = 0
    for dtype in DTYPES:
        ops = ["sum", "max", "min", "prod"] + (["avg"] if dtype.is_floating_point else [])
        for numel in SIZES:
            for op in ops:
                case += 1
                x = values(r, numel, dtype, case, op)
                tag = f"n{n} {dtype} {numel} {op}"
                want = comm.allreduce(x, op=op, algorithm="native")
                check(failures, "allreduce " + tag, comm.allreduce(x, op=op, algorithm="hierarchical"), want, True)
                rows = torch.cat([x, x[: numel % 3]]) if numel else x
                want = comm.reduce_scatter(rows, op=op, algorithm="native")
                check(failures, "reduce_scatter " + tag,
                      comm.reduce_scatter(rows, op=op, algorithm="hierarchical"), want, True)
                ran["reductions"] += 2
            part = values(r, numel + r % 2, dtype, case, "sum")     # uneven rows per rank
            check(failures, f"allgather n{n} {dtype} {numel}", comm.allgather(part, algorithm="hierarchical"),
                  comm.allgather(part, algorithm="native"), True)
            for root in range(n):
                b = values(r, numel, dtype, case + root, "sum")
                want = comm.broadcast(b.clone(), root=root, algorithm="native")
                check(failures, f"broadcast n{n} {dtype} {numel} root {root}",
                      comm.broadcast(b.clone(), root=root, algorithm="hierarchical"), want, True)
            ran["movements"] += 1 + n
    for dtype, op in ((torch.int64, "sum"), (torch.bfloat16, "max"), (torch.float32, "prod")):
        # through the hosts' first ranks, psrt's ring between them; then in shards, pipelined in
        # segments between hosts
        for numel in ((128 << 10) // dtype.itemsize + 7, (5 << 20) // dtype.itemsize + 7):
            x = values(r, numel, dtype, 0, op)
            check(failures, f"allreduce n{n} {dtype} {numel} {op}",
                  comm.allreduce(x, op=op, algorithm="hierarchical"), comm.allreduce(x, op=op, algorithm="native"),
                  True)
            ran["reductions"] += 1
    for numel in (1000, 1 << 16):    # rounding: any order of a float sum is within tolerance
        x = torch.randn(numel, generator=torch.Generator().manual_seed(r))
        check(failures, f"float sum n{n} {numel}", comm.allreduce(x, algorithm="hierarchical"),
              comm.allreduce(x, algorithm="native"), False)


def main() -> int:
    world = psrt.init()
    failures: list = []
    ran = {"reductions": 0, "movements": 0}
    comm = Communicator(world.comm)
    matrix(comm, failures, ran)
    placement = list(comm.topology.placement.host_of)
    auto = {m: comm._pick("allreduce", None, m) for m in (8, 1 << 20, 16 << 20)}
    # A sub-communicator: world ranks 0, 1, 2, 5 sit on hosts 0, 1, 0, 1 (2 x 2, interleaved).
    sub_mpi = world.comm.Split(0 if world.rank in (0, 1, 2, 5) else MPI.UNDEFINED, world.rank)
    sub_placement = None
    if sub_mpi != MPI.COMM_NULL:
        sub = Communicator(sub_mpi)
        sub_placement = list(sub.topology.placement.host_of)
        matrix(sub, failures, ran)
        sub.close()
        sub_mpi.Free()
    comm.close()
    print("PSRT-RESULT " + json.dumps({"rank": world.rank, "failures": failures[:20], "ran": ran,
                                       "placement": placement, "sub_placement": sub_placement,
                                       "local_size": world.local_size, "auto": auto}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
