"""Rank-side check of every collective x algorithm x op x dtype x size.

Inputs are small integers chosen per (rank, case), so every reduction is exact in every dtype
(bfloat16 included: sums stay below 2**8 and products below 2**8) and each algorithm must
match the NumPy reference bit for bit, whatever its reduction order.  A second pass with
random normal floats checks the usual rounding tolerance.  Prints one PSRT-RESULT line per
rank: counts of cases run and a list of failures.
"""
import argparse
import json
import sys

import numpy as np
import torch

import psrt
from psrt.collectives import ALGORITHMS
from psrt.collectives.algorithms import THROUGH_TORCH

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
          torch.int64, torch.uint8]
OPS = ["sum", "avg", "max", "min", "prod"]
# bitwise ops (torch's ReduceOp.BAND/BOR/BXOR) on one integer dtype: their kernels are
# dtype-generic, and tests/unit/test_transport.py covers every integer dtype
BITWISE = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}
BITWISE_DTYPE = torch.int64


def inputs(rank: int, n: int, numel: int, op: str, dtype, case: int) -> np.ndarray:
    """This rank's values, as float64 so the reference can be computed exactly."""
    rng = np.random.default_rng(1000 * case + rank)
    if op == "prod":
        # at most one factor of 2 from each of the first 7 ranks: |product| <= 2**7
        choices = [1.0, 2.0] if rank < 7 else [1.0]
        if dtype != torch.uint8:
            choices.append(-1.0)
        return rng.choice(choices, size=numel)
    if op in BITWISE:
        return rng.integers(0, 16, size=numel).astype(np.float64)
    low = 0 if dtype == torch.uint8 else -3
    return rng.integers(low, 4, size=numel).astype(np.float64)


def reference(all_inputs: list, op: str) -> np.ndarray:
    stack = np.stack(all_inputs)
    if op in BITWISE:
        return BITWISE[op].reduce(stack.astype(np.int64), axis=0).astype(np.float64)
    return {"sum": stack.sum(0), "avg": stack.mean(0), "max": stack.max(0), "min": stack.min(0),
            "prod": stack.prod(0)}[op]


def close(got: torch.Tensor, want: np.ndarray, dtype, op: str) -> bool:
    g = got.to(torch.float64).numpy()
    w = torch.tensor(want).to(dtype).to(torch.float64).numpy() if op != "avg" else want
    if op == "avg":
        tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2}.get(dtype, 1e-6)
        return g.shape == w.shape and np.allclose(g, w, rtol=tol, atol=tol)
    return g.shape == w.shape and np.array_equal(g, w)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--large", type=int, default=(1 << 20) + 3)
    ap.add_argument("--torch", action="store_true", help="include the torch.distributed backend")
    ap.add_argument("--dtypes", default=",".join(str(d).replace("torch.", "") for d in DTYPES),
                    help="comma list (large world sizes test topology, not every dtype)")
    args = ap.parse_args()
    world = psrt.init()
    n, rank = world.size, world.rank
    if args.torch:
        psrt.init_torch_distributed(world)
    comm = psrt.Communicator(world.comm)
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    sizes = sorted({0, 1, max(n - 1, 0), 3 * n + 1})
    failures, ran = [], {}
    case = 0

    def record(name, ok, detail):
        ran[name] = ran.get(name, 0) + 1
        if not ok and len(failures) < 50:
            failures.append(detail)

    def algos(coll):
        return [a for a in ALGORITHMS[coll] if a not in THROUGH_TORCH or (a == "torch" and args.torch)] + ["auto"]

    # ---------------------------------------------------------- allreduce, reduce, reduce_scatter
    for dtype in dtypes:
        for op in OPS + (list(BITWISE) if dtype == BITWISE_DTYPE else []):
            if op == "avg" and not dtype.is_floating_point:
                continue
            # ~1M elements: enough to cross every algorithm's segment and window sizes
            large = [args.large] if op == "sum" and dtype in (torch.float32, torch.bfloat16) else []
            for numel in sizes + large:
                case += 1
                mine = [inputs(r, n, numel, op, dtype, case) for r in range(n)]
                want = reference(mine, op)
                x = torch.tensor(mine[rank]).to(dtype)
                for algo in algos("allreduce"):
                    got = comm.allreduce(x, op=op, algorithm=algo)
                    record("allreduce", close(got, want, dtype, op) and torch.equal(x, torch.tensor(mine[rank]).to(dtype)),
                           f"allreduce {algo} {op} {dtype} n={numel}")
                counts = psrt.collectives.even_counts(numel, n)
                lo = sum(counts[:rank])
                for algo in algos("reduce_scatter"):
                    got = comm.reduce_scatter(x, op=op, algorithm=algo)
                    record("reduce_scatter", close(got, want[lo:lo + counts[rank]], dtype, op),
                           f"reduce_scatter {algo} {op} {dtype} n={numel}")
                root = case % n
                for algo in algos("reduce"):
                    got = comm.reduce(x, root=root, op=op, algorithm=algo)
                    ok = close(got, want, dtype, op) if rank == root else got is None
                    record("reduce", ok, f"reduce {algo} root={root} {op} {dtype} n={numel}")

    # ---------------------------------------------------------- data movement
    for dtype in dtypes:
        for numel in sizes + ([args.large] if dtype == torch.float32 else []):
            case += 1
            base = [torch.tensor(inputs(r, n, numel, "sum", dtype, case)).to(dtype) for r in range(n)]
            root = case % n
            for algo in algos("broadcast"):
                t = base[rank].clone()
                comm.broadcast(t, root=root, algorithm=algo)
                record("broadcast", torch.equal(t, base[root]), f"broadcast {algo} root={root} {dtype} n={numel}")
            # uneven allgather: rank r contributes (r + numel) % 3 rows of width 2
            rows = [(r + numel) % 3 for r in range(n)]
            parts = [torch.full((rows[r], 2), r % 100, dtype=dtype) for r in range(n)]
            for algo in algos("allgather"):
                got = comm.allgather(parts[rank], algorithm=algo)
                record("allgather", torch.equal(got, torch.cat(parts)), f"allgather uneven {algo} {dtype}")
                got = comm.allgather(base[rank], algorithm=algo, counts=[numel] * n)
                record("allgather", torch.equal(got, torch.cat(base)), f"allgather {algo} {dtype} n={numel}")
            got = comm.gather(parts[rank], root=root)
            record("gather", torch.equal(got, torch.cat(parts)) if rank == root else got is None,
                   f"gather {dtype} root={root}")
            whole = torch.cat(parts)
            got = comm.scatter(whole if rank == root else None, root=root, counts=rows)
            record("scatter", torch.equal(got, parts[rank]), f"scatter {dtype} root={root}")
            blocks = torch.stack([torch.full((3,), 10 * rank + j, dtype=torch.float64) for j in range(n)]).to(dtype)
            got = comm.alltoall(blocks)
            want = torch.stack([torch.full((3,), 10 * j + rank, dtype=torch.float64) for j in range(n)]).to(dtype)
            record("alltoall", torch.equal(got, want), f"alltoall {dtype}")

    # ---------------------------------------------------------- in place, non-contiguous, non-blocking
    for algo in algos("allreduce"):
        t = torch.full((5, 4), float(rank + 1))
        res = comm.allreduce(t, out=t, algorithm=algo)
        record("inplace", res is t and torch.all(t == n * (n + 1) / 2).item(), f"in-place allreduce {algo}")
        nc = torch.arange(40, dtype=torch.float32).reshape(5, 8)[:, ::2] * (rank + 1)  # not contiguous
        want = torch.arange(40, dtype=torch.float32).reshape(5, 8)[:, ::2] * (n * (n + 1) / 2)
        record("noncontiguous", torch.equal(comm.allreduce(nc, algorithm=algo), want), f"non-contiguous {algo}")
        nc2 = nc.clone().t()  # in place into a non-contiguous tensor must write through
        comm.allreduce(nc2, out=nc2, algorithm=algo)
        record("noncontiguous", torch.equal(nc2, want.t()), f"non-contiguous in place {algo}")
        handles = [comm.allreduce(torch.full((1000 + i,), float(rank + i)), algorithm=algo, async_op=True)
                   for i in range(4)]
        blocking = comm.allreduce(torch.ones(3), algorithm=algo)  # must queue behind the handles
        for i, h in enumerate(handles):
            want_i = sum(r + i for r in range(n))
            record("nonblocking", torch.all(h.wait(timeout=60) == want_i).item(), f"non-blocking {algo} #{i}")
        record("nonblocking", torch.all(blocking == n).item(), f"blocking after non-blocking {algo}")
    h = comm.barrier(async_op=True)
    h.wait(timeout=60)
    record("barrier", h.is_completed(), "barrier")

    # ---------------------------------------------------------- rounding: random floats
    for algo in algos("allreduce"):
        rng = np.random.default_rng(7 + rank)
        x = torch.tensor(rng.standard_normal(4099), dtype=torch.float32)
        got = comm.allreduce(x, algorithm=algo).double()
        ref = comm.allreduce(x.double(), algorithm="native")
        record("float-rounding", torch.allclose(got, ref, rtol=1e-5, atol=1e-5), f"fp32 rounding {algo}")
        # every rank must hold the very same bits (data-parallel replicas rely on it)
        bits = comm.comm.allgather(got.numpy().tobytes())
        record("float-rounding", all(b == bits[0] for b in bits), f"identical bits on all ranks {algo}")

    print("PSRT-RESULT " + json.dumps({"rank": rank, "size": n, "ran": ran, "failures": failures}), flush=True)
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
