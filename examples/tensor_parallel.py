"""Tensor-parallel training of the character-level transformer over all ranks.

    ./mpi_launch -np 2 python examples/tensor_parallel.py [--steps 5]

Every rank holds 1/t of each layer (heads, MLP columns/rows, vocabulary rows); no rank ever
holds the full logits.  Rank 0 checks the first loss against the dense model run whole and
prints each step's loss and the all-reduce traffic per step.
"""
import argparse

import torch
import torch.nn.functional as F

import psrt
from psrt.errors import cli_main
from psrt.grid import Grid
from psrt.tp import CountingGroup, shard_dense
from psrt.train.data import text
from psrt.train.models import TransformerLM


@cli_main("examples/tensor_parallel.py")
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    world = psrt.init()
    grid = Grid.build(world.comm, tp=world.size)
    torch.manual_seed(0)
    dense = TransformerLM(vocab=256, dim=64, layers=args.layers, heads=4, max_len=32)
    group = CountingGroup(grid.tp_group)
    model = shard_dense(dense, group)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    data = text(32)
    local = sum(p.numel() for p in model.parameters())
    full = sum(p.numel() for p in dense.parameters())
    if world.rank == 0:
        print(f"tp={grid.tp}: {local:,} of {full:,} parameters on each rank")
    for step in range(args.steps):
        idx = torch.arange(step * args.batch, (step + 1) * args.batch)
        x, y = data.train_x[idx], data.train_y[idx]
        group.reset()
        opt.zero_grad()
        loss = model.loss(model(x), y)
        loss.backward()
        opt.step()
        if step == 0:
            want = F.cross_entropy(dense(x).flatten(0, 1), y.flatten()).item()
            if world.rank == 0:
                print(f"first loss {loss.item():.6f}, dense model {want:.6f}")
        if world.rank == 0:
            print(f"step {step}: loss {loss.item():.4f}  all-reduces {group.calls.get('allreduce', 0)} "
                  f"({sum(group.bytes.values()) / 1024:.0f} KiB payload)")
    grid.free()


if __name__ == "__main__":
    main()
