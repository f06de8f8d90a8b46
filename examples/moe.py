"""Mixture-of-Experts routing, step by step: which expert took how many tokens from which rank.

    ./mpi_launch -np 4 python examples/moe.py [--steps 4] [--top-k 2] [--capacity-factor 1.0]

A two-block MoE transformer learns the text corpus with 4 ranks of data parallelism and
expert parallelism over all of them (EP = 4, one expert per rank, top-1 by default).  After
each step rank 0 prints, for the first MoE layer, a table: one row per expert (and the rank
holding it), one column per rank whose tokens were sent to it by the all-to-all, then how
many choices were dropped over capacity, and the load-balancing loss.
"""
import argparse

import torch

import psrt
from psrt.ep.layer import moe_layers
from psrt.grid import Grid
from psrt.train.data import ShardedSampler, load
from psrt.train.models import build_model, loss_and_correct
from psrt.train.moe import MoETrainer

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--steps", type=int, default=4)
ap.add_argument("--top-k", type=int, default=1)
ap.add_argument("--capacity-factor", type=float, default=1.0)
args = ap.parse_args()

world = psrt.init()
grid = Grid.build(world.comm, ep=world.size)
data = load("text", 32)
torch.manual_seed(0)
model = build_model("moe", data, 32, 2, experts=world.size, top_k=args.top_k, capacity_factor=args.capacity_factor)
for layer in moe_layers(model):
    layer.shard(grid.ep_group, grid.dp_group, algorithm="pairwise")
trainer = MoETrainer(model, lambda ps: torch.optim.Adam(ps, lr=3e-3), grid, algorithm="ring")
sampler = ShardedSampler(len(data), 16 * world.size, grid.dp, grid.dp_rank, 1, 0)
first = moe_layers(model)[0]
for step in range(args.steps):
    mbs = [(data.train_x[i], data.train_y[i]) for i in sampler.microbatches(step)]
    stats = trainer.step(lambda mb: loss_and_correct(model, mb, "lm")[0], mbs)
    # The first layer's last forward: rows each local expert received from each rank.
    received = world.comm.gather(first.stats["received"].t().tolist(), root=0)
    if world.rank == 0:
        n = world.size
        print(f"step {step + 1}: loss {stats.loss:.3f}, balance loss {stats.extra['aux_loss']:.4f}, "
              f"dropped {int(first.stats['dropped'].sum())} of {first.stats['tokens'] * args.top_k} choices")
        print("  expert (rank)  " + "  ".join(f"from r{s:<3}" for s in range(n)) + "  total")
        for rank, experts in enumerate(received):
            for i, row in enumerate(experts):
                e = rank * len(experts) + i
                print(f"  e{e:<2} (r{rank})      " + "  ".join(f"{c:>7}" for c in row) + f"  {sum(row):>5}")
grid.free()
