"""`python -m psrt.bench backup`: what backup workers buy and what they cost the loss.

A synchronous parameter server waits for its slowest worker every step; with b backup
workers (`--dp ps --backup-workers b`) it takes the first N - 1 - b other gradients and leaves
the rest out (Chen et al., "Revisiting Distributed Synchronous SGD", 2016, who weigh the time
saved against the gradients dropped).  Here the default MLP trains on digits, in one job, with
b = 0, 1, ..., each on its own copy of the same model and the same batches, while a
straggler is made: each step one worker, drawn from a seeded generator that every rank
shares (so the same draw on every rank and every b), starts its step --late-ms late, as a
worker does behind a noisy neighbour.  Per b the table shows the median step (rank 0's, the
server's pace), the gradients left out, and the training and test loss and test accuracy
after the same number of steps.
"""
from __future__ import annotations

import random
import statistics
import time

HELP = "backup workers of the parameter server with a straggler: step time, gradients left out, loss"


def add_arguments(p) -> None:
    p.add_argument("--backups", default="0,1", help="backup workers to compare, comma list (default 0,1)")
    p.add_argument("--late-ms", type=float, default=20.0, help="how late the straggler of each step starts")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=64, help="global batch")
    from psrt.dp import device
    device.add_argument(p, "where the model and batches live")
    p.add_argument("--json", help="write the rows as JSON")
    p.add_argument("--quiet", action="store_true")


def check(args, size: int) -> list[int]:
    from psrt.bench.report import need
    try:
        backups = [int(b) for b in args.backups.split(",") if b]
    except ValueError:
        backups = []
    need(bool(backups) and min(backups) >= 0, f"--backups {args.backups}: expected whole numbers such as 0,1")
    need(max(backups) <= size - 2, f"--backups {args.backups}: {size} ranks leave at most {max(size - 2, 0)} "
                                   "backups (the server keeps its own gradient and at least one other)")
    need(args.steps >= 1 and args.late_ms >= 0, f"--steps {args.steps} / --late-ms {args.late_ms}: "
                                                "steps at least 1, lateness not negative")
    return backups


def train(world, dataset, backups: int, args, device) -> dict:
    """One run of `args.steps` steps with `backups` backup workers; the row on rank 0."""
    import torch

    import psrt
    from psrt.dp import strategy_class
    from psrt.dp.common import optimizer_factory
    from psrt.train.data import ShardedSampler
    from psrt.train.callbacks.evaluation import evaluate
    from psrt.train.models import build_model, loss_and_correct
    torch.manual_seed(0)
    model = build_model("mlp", dataset).to(device)
    group = psrt.Communicator(world.comm)
    s = strategy_class("ps")(model, optimizer_factory("sgd", lr=0.1), group, backup_workers=backups)
    sampler = ShardedSampler(len(dataset), args.batch_size, s.num_workers, s.worker_rank, seed=0)
    draw = random.Random(1)           # the same straggler on every rank and for every b
    steps, losses = [], []
    for step in range(args.steps):
        late = draw.randrange(1, world.size)          # never the server, rank 0
        mbs = [(dataset.train_x[i].to(device), dataset.train_y[i].to(device)) for i in sampler.microbatches(step)]
        t0 = time.perf_counter()
        if world.rank == late:
            time.sleep(args.late_ms / 1e3)
        stats = s.step(lambda mb: loss_and_correct(model, mb, dataset.task)[0], mbs)
        steps.append(time.perf_counter() - t0)
        losses.append(stats.loss)
    s.finish()
    left_out = s.server_totals.get("left_out", 0) if s.shard is not None else 0
    group.close()
    if world.rank != 0:
        return {}
    test_loss, test_acc = evaluate(model, dataset)
    tail = losses[-10:]
    return {"backups": backups, "step_s": statistics.median(steps), "left_out": left_out,
            "gradients": args.steps * (world.size - 1), "train_loss": sum(tail) / len(tail),
            "test_loss": test_loss, "test_acc": test_acc}


COLUMNS = [("backups", "backup workers", "d"), ("step_s", "step (ms)", ".2f", 1e3),
           ("vs_none", "x no backups", ".2f"), ("left_out", "gradients left out", "d"),
           ("gradients", "of", "d"), ("train_loss", "train loss (last 10)", ".4f"),
           ("test_loss", "test loss", ".4f"), ("test_acc", "test acc", ".1%")]


def command(args) -> int:
    import psrt
    from psrt.bench import report
    from psrt.train.data import load
    from psrt.dp.device import pick
    world = psrt.init()
    backups = check(args, world.size)
    device = pick(args.device, world.local_rank)
    dataset = load("digits")
    rows = [train(world, dataset, b, args, device) for b in backups]
    if world.rank != 0:
        return 0
    base = next((r["step_s"] for r in rows if r["backups"] == 0), None)
    for r in rows:
        r["vs_none"] = r["step_s"] / base if base else None
    if not args.quiet:
        print(f"# --dp ps with backup workers, N={world.size}, default MLP on digits ({device}), global batch "
              f"{args.batch_size}, {args.steps} steps; each step one worker (the same for every row) starts "
              f"{args.late_ms:g} ms late; step = rank 0's median")
        report.table(rows, COLUMNS)
    if args.json:
        report.write_json(args.json, {"rows": rows, "late_ms": args.late_ms, "ranks": world.size})
    return 0
