"""The same model, the same data, the same global batch: parameter server vs. ring all-reduce.

    ./mpi_launch -np 4 python examples/ps_vs_ring.py
    ./mpi_launch -np 4 python examples/ps_vs_ring.py --servers 1     # a dedicated server rank

Both strategies come from the registry (psrt.dp.strategy_class) and train an MLP on the
digits for a few steps from the same initial parameters.  Because a step's gradient is the
average over the GLOBAL batch whatever the number of workers, the two loss curves agree (to
float rounding) even when the parameter server takes one rank away from training.  What
differs is the cost: a server receives every worker's gradient and sends every worker the
parameters, (N-1) x M each way, while each ring rank sends 2 (N-1)/N x M.
"""
import argparse
import time

import torch

import psrt
from psrt.dp import strategy_class
from psrt.train.data import ShardedSampler, digits
from psrt.train.models import build_model, loss_and_correct
from psrt.train.report import fmt_bytes


def train(dp: str, args, world, dataset) -> dict | None:
    group = psrt.Communicator(world.comm)
    torch.manual_seed(args.seed)
    model = build_model("mlp", dataset, width=args.width)
    make_opt = lambda p: torch.optim.SGD(p, lr=args.lr, momentum=0.9)  # noqa: E731
    options = {"servers": args.servers} if dp.startswith("ps") else {}
    s = strategy_class(dp)(model, make_opt, group, **options)
    losses, sent, busy = [], 0, 0.0
    world.comm.Barrier()
    t0 = time.perf_counter()
    if s.is_worker:
        sampler = ShardedSampler(len(dataset), args.batch, s.num_workers, s.worker_rank, seed=args.seed)
        loss_fn = lambda mb: loss_and_correct(model, mb, dataset.task)[0]  # noqa: E731
        for step in range(args.steps):
            idx = sampler.indices(step)
            stats = s.step(loss_fn, [(dataset.train_x[idx], dataset.train_y[idx])])
            losses.append(stats.loss)
            sent += stats.bytes_sent
            busy += stats.comm_s
        s.finish()
    else:
        s.serve()
        sent = getattr(s, "server_totals", {}).get("bytes_sent", 0)
    wall = time.perf_counter() - t0
    everyone = world.comm.gather({"worker": s.is_worker, "wr": s.worker_rank, "sent": sent,
                                  "comm_s": busy, "losses": losses, "wall": wall}, root=0)
    group.close()
    if world.rank != 0:
        return None
    lead = next(r for r in everyone if r["wr"] == 0)
    return {"losses": lead["losses"], "wall": max(r["wall"] for r in everyone),
            "workers": sum(r["worker"] for r in everyone),
            "sent_max": max(r["sent"] for r in everyone),
            "sent_worker": max(r["sent"] for r in everyone if r["worker"] and r["wr"] != 0)
            if sum(r["worker"] for r in everyone) > 1 else 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=48, help="global batch (divisible by 2, 3, 4)")
    ap.add_argument("--width", type=int, default=512, help="MLP hidden units (more = more bytes)")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--servers", type=int, default=0, help="0: rank 0 serves and trains; 1: a dedicated rank")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    world = psrt.init()
    torch.set_num_threads(1)
    dataset = digits()
    ps, ring = train("ps", args, world, dataset), train("ring", args, world, dataset)
    if world.rank != 0:
        return
    print(f"MLP (width {args.width}) on digits, global batch {args.batch}, {world.size} ranks; "
          f"ps: {ps['workers']} workers, ring: {ring['workers']} workers\n")
    print(f"{'step':>4}  {'ps loss':>10}  {'ring loss':>10}  {'|diff|':>8}")
    for i, (a, b) in enumerate(zip(ps["losses"], ring["losses"]), 1):
        if i <= 5 or i % 5 == 0:
            print(f"{i:>4}  {a:>10.6f}  {b:>10.6f}  {abs(a - b):>8.1e}")
    worst = max(abs(a - b) for a, b in zip(ps["losses"], ring["losses"]))
    print(f"\nlargest loss difference over {args.steps} steps: {worst:.1e}\n")
    print(f"{'':26}{'ps':>12}{'ring':>12}")
    print(f"{'time per step':26}{ps['wall'] / args.steps * 1e3:>10.1f}ms{ring['wall'] / args.steps * 1e3:>10.1f}ms")
    print(f"{'bytes sent, busiest rank':26}{fmt_bytes(ps['sent_max']):>12}{fmt_bytes(ring['sent_max']):>12}")
    print(f"{'bytes sent, a worker':26}{fmt_bytes(ps['sent_worker']):>12}{fmt_bytes(ring['sent_worker']):>12}")


if __name__ == "__main__":
    main()
