"""Does overlapping the all-reduce with backward pay?  Ring DDP with overlap vs. the same
buckets reduced after backward, in the same job, interleaved, on the same data.

    ./mpi_launch -np 2 python examples/ddp_overlap.py            # add --oversubscribe beyond the cores
    ./mpi_launch -np 4 python examples/ddp_overlap.py --layers 6 --width 768

Prints the median step time of each mode, their ratio (overlap / after-backward: below 1 means
overlap helps), and how many buckets started while backward was still running.  What to
expect: overlap hides communication behind the backward of earlier layers (Li et al., VLDB
2020, fig. 7), so the gain is at most min(compute, communication) per step; on a machine where
ranks share cores the reduction competes with backward for the same CPU and the gain shrinks.
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import psrt
from psrt.dp.ddp import RingDDP


def model_of(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods, nn.Linear(width, 10))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32, help="samples per rank")
    ap.add_argument("--bucket-mb", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per mode")
    ap.add_argument("--algorithm", default="ring")
    args = ap.parse_args()
    world = psrt.init()
    torch.set_num_threads(1)
    group = psrt.Communicator(world.comm)
    x = torch.randn(args.batch, args.width)
    y = torch.randint(0, 10, (args.batch,))
    runs = {}
    for overlap in (True, False):
        model = model_of(args.layers, args.width)
        ddp = RingDDP(model, lambda p: torch.optim.SGD(p, lr=1e-3), group, bucket_mb=args.bucket_mb,
                      overlap=overlap, algorithm=args.algorithm)
        runs[overlap] = (model, ddp, [], [])
    loss_fns = {k: (lambda m: lambda mb: F.cross_entropy(m(mb[0]), mb[1]))(v[0]) for k, v in runs.items()}
    for i in range(args.steps + 2):                 # 2 warm-up rounds, then timed
        for overlap in ((True, False) if i % 2 else (False, True)):   # alternate who goes first
            _, ddp, times, launched = runs[overlap]
            world.comm.Barrier()
            t0 = time.perf_counter()
            stats = ddp.step(loss_fns[overlap], [(x, y)])
            dt = time.perf_counter() - t0
            if i >= 2:
                times.append(max(world.comm.allgather(dt)))   # a step lasts as long as its slowest rank
                launched.append(stats.extra["launched_in_backward"])
    if world.rank == 0:
        params = sum(p.numel() for p in runs[True][0].parameters())
        on, off = statistics.median(runs[True][2]), statistics.median(runs[False][2])
        buckets = len(runs[True][1].buckets)
        print(f"{world.size} ranks, {params / 1e6:.1f} M parameters ({params * 4 / 2**20:.0f} MiB of "
              f"gradients) in {buckets} buckets of {args.bucket_mb:g} MiB, {args.algorithm} all-reduce")
        print(f"step with overlap        : {on * 1e3:8.1f} ms (median of {args.steps}; "
              f"{statistics.median(runs[True][3]):.0f}/{buckets} buckets started during backward)")
        print(f"step, reduce after bwd  : {off * 1e3:8.1f} ms (median of {args.steps})")
        print(f"ratio overlap / after   : {on / off:8.2f}")
    for _, ddp, _, _ in runs.values():
        ddp.finish()
    group.close()


if __name__ == "__main__":
    main()
