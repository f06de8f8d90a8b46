"""DP x PP x TP training of the character-level transformer.

    ./mpi_launch -np 8 python examples/hybrid.py --pp 2 --tp 2      # dp = 8 / (2 * 2) = 2

Runs with more ranks than cores need --oversubscribe --mca mpi_yield_when_idle 1 (or
./mpi_launch -np 8 python examples/hybrid.py).  Rank 0 prints the grid, each step's global
loss and timings; at the end it reassembles the model and prints its size.
"""
import argparse

import psrt
from psrt.errors import cli_main
from psrt.grid import Grid
from psrt.train.data import text
from psrt.train.hybrid import HybridConfig, run


@cli_main("examples/hybrid.py")
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved"))
    ap.add_argument("--virtual-stages", type=int, default=1)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--dp-algorithm", default="ring")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    args = ap.parse_args()
    world = psrt.init()
    grid = Grid.build(world.comm, pp=args.pp, tp=args.tp, algorithm="auto")
    cfg = HybridConfig(vocab=256, dim=64, layers=2, heads=4, seq_len=32, schedule=args.schedule,
                       virtual_stages=args.virtual_stages, microbatches=args.microbatches,
                       dp_algorithm=args.dp_algorithm, optimizer="adam", lr=3e-3)
    data = text(cfg.seq_len)
    batches = ((data.train_x[i * args.batch:(i + 1) * args.batch],
                data.train_y[i * args.batch:(i + 1) * args.batch]) for i in range(args.steps))
    if world.rank == 0:
        print(f"grid dp={grid.dp} x pp={grid.pp} x tp={grid.tp}; {cfg.schedule}, "
              f"{cfg.microbatches} micro-batches per dp rank, dp all-reduce: {cfg.dp_algorithm}")

    def report(step, st):
        if world.rank == 0:
            print(f"step {step}: loss {st.loss:.4f}  {st.extra['step_s'] * 1000:.0f} ms pipeline, "
                  f"{st.extra['dp_comm_s'] * 1000:.0f} ms dp all-reduce")
    trainer, _ = run(grid, cfg, batches, on_step=report)
    state = trainer.dense_state_dict()
    if state is not None:
        print(f"reassembled {len(state)} tensors, {sum(t.numel() for t in state.values()):,} parameters")
    grid.free()


if __name__ == "__main__":
    main()
