"""A tour of the collectives: every operation on every rank, printed side by side.

    ./mpi_launch -np 4 python examples/collectives_tour.py [--algorithm ring]

Rank r starts with small tensors built from r, so each result can be checked by eye.
Output is gathered to rank 0 and printed in rank order (mpirun would interleave it).
"""
import argparse

import torch

import psrt


def show(world, group, title: str, before, after) -> None:
    """Print one line per rank: what it had and what it got."""
    lines = group.comm.gather(f"  {world.prefix():>16} {fmt(before):>26}  ->  {fmt(after)}", root=0)
    if world.rank == 0:
        print(f"\n{title}")
        print("\n".join(lines))


def fmt(t) -> str:
    if t is None:
        return "None"
    if isinstance(t, torch.Tensor):
        return str([round(v, 2) if isinstance(v, float) else v for v in t.tolist()])
    return str(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algorithm", default="auto", choices=psrt.ALL_ALGORITHMS)
    args = ap.parse_args()
    world = psrt.init()
    group = psrt.Communicator(world.comm, algorithm=args.algorithm)
    r, n = world.rank, world.size
    if r == 0:
        print(f"{n} ranks on {world.num_nodes} host(s); algorithm={args.algorithm}")

    x = torch.tensor([r + 1.0, 10.0 * (r + 1)])
    show(world, group, "allreduce(x, op='sum'): every rank gets the element-wise sum", x, group.allreduce(x))
    show(world, group, "allreduce(x, op='max')", x, group.allreduce(x, op="max"))
    show(world, group, "allreduce(x, op='avg')", x, group.allreduce(x, op="avg"))

    v = torch.arange(2 * n, dtype=torch.float32) + 100 * r
    show(world, group, "reduce_scatter(v): sum, then rank r keeps rows of block r", v, group.reduce_scatter(v))

    mine = torch.full((r + 1,), float(r))
    show(world, group, "allgather(t): concatenate (uneven sizes are fine)", mine, group.allgather(mine))

    b = torch.tensor([42.0, 7.0]) if r == 0 else torch.zeros(2)
    before = b.clone()
    show(world, group, "broadcast(b, root=0): root's tensor everywhere (in place)", before, group.broadcast(b, root=0))

    show(world, group, f"reduce(x, root={n - 1}): the sum only on the root", x, group.reduce(x, root=n - 1))
    show(world, group, "gather(t, root=0): concatenated on the root only", mine, group.gather(mine, root=0))

    whole = torch.arange(n * 2) if r == 0 else None
    show(world, group, "scatter(t, root=0): block r of the root's tensor to rank r", whole, group.scatter(whole, root=0))

    blocks = torch.tensor([10 * r + j for j in range(n)])
    show(world, group, "alltoall(t): block j goes to rank j (a transpose of the rank x block table)",
         blocks, group.alltoall(blocks))

    handle = group.allreduce(torch.ones(3) * r, async_op=True)   # returns at once
    show(world, group, "allreduce(..., async_op=True).wait(): non-blocking, then wait", torch.ones(3) * r,
         handle.wait())
    group.barrier()
    group.close()


if __name__ == "__main__":
    main()
