"""Pipeline-parallel training of the character-level transformer over all ranks.

    ./mpi_launch -np 4 python examples/pipeline.py [--schedule 1f1b|gpipe|interleaved]
                                             [--microbatches 8] [--virtual-stages 2]

Rank 0 prints the schedule as a rank x time table and how the model was split, then each
step's loss and the measured bubble.  (More ranks than cores: add --oversubscribe --mca
mpi_yield_when_idle 1, or start it with ./mpi_launch -np 4 python examples/pipeline.py.)
"""
import argparse

import torch
import torch.nn.functional as F

import psrt
from psrt.errors import cli_main
from psrt.grid import Grid
from psrt.pp import PipelineRuntime, build_stages, make_schedule, split_batch, table
from psrt.pp.partition import describe
from psrt.train.data import text
from psrt.train.models import TransformerLM


@cli_main("examples/pipeline.py")
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved"))
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--virtual-stages", type=int, default=1)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    v = args.virtual_stages if args.schedule == "interleaved" else 1
    if args.schedule == "interleaved" and v == 1:
        v = 2
    world = psrt.init()
    grid = Grid.build(world.comm, pp=world.size)
    sched = make_schedule(args.schedule, grid.pp, args.microbatches, v)
    torch.manual_seed(0)
    model = TransformerLM(vocab=256, dim=64, layers=args.layers, heads=4, max_len=32)
    blocks = [model.embed, *model.blocks, model.head]
    if world.rank == 0:
        print(f"{sched.name}: {grid.pp} ranks, {sched.num_stages} stages, {args.microbatches} micro-batches")
        print(table(sched))
        print(describe(blocks, sched.num_stages))
    stages = build_stages(blocks, sched.num_stages, sched.stages_of(grid.pp_rank))
    rt = PipelineRuntime(stages, sched, grid.pp_comm,
                         lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()))
    opt = torch.optim.Adam(rt.parameters(), lr=3e-3)
    data = text(32)
    for step in range(args.steps):
        idx = torch.arange(step * args.batch, (step + 1) * args.batch)
        xs, ys, w = split_batch(data.train_x[idx], data.train_y[idx], args.microbatches)
        opt.zero_grad()
        st = rt.step(xs, ys, w)
        opt.step()
        bubble = grid.pp_comm.gather(st.bubble)
        if world.rank == 0:
            print(f"step {step}: loss {st.loss:.4f}  {st.total_s * 1000:.0f} ms  idle share per "
                  f"rank {' '.join(f'{b:.2f}' for b in bubble)}")
    grid.free()


if __name__ == "__main__":
    main()
