"""`python -m psrt.train`: train a model with any data-parallel strategy over MPI ranks.

    mpirun -np 8 python -m psrt.train                      # ring all-reduce, MLP on digits
    mpirun -np 4 python -m psrt.train --dp ps,ring         # both in turn, compared side by side

The loop is the same for every strategy: each worker takes its slice of the global batch
(data.ShardedSampler), hands its micro-batches to `strategy.step`, and the lead worker
prints progress and writes metrics.  Parameter-server ranks run `strategy.serve()`.
See docs/training.md for flags, the sampler policy and learning-rate handling.
"""
from __future__ import annotations

import os
import sys
import time

import torch

import psrt
from psrt import faults
from psrt.train import checkpoint, report
from psrt.train.config import TrainConfig, parse_args
from psrt.train.data import ShardedSampler, load
from psrt.dp import strategy_class
from psrt.dp.base import StepStats
from psrt.errors import PsrtError, cli_main
from psrt.train.models import build_model, loss_and_correct
from psrt.train.hybrid_loop import train_hybrid
from psrt.watchdog import Watchdog


def make_optimizer_factory(cfg: TrainConfig):
    def make(params):
        if cfg.optimizer == "adam":
            return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return make


def strategy_options(cfg: TrainConfig) -> dict:
    """Every strategy option; those left unset are left out so each strategy's default holds."""
    options = {"bucket_mb": cfg.bucket_mb, "overlap": cfg.overlap, "compress": cfg.compress,
               "algorithm": cfg.algorithm, "servers": cfg.servers, "staleness": cfg.staleness}
    return {k: v for k, v in options.items() if v is not None}


@torch.no_grad()
def evaluate(model, dataset, batch: int = 512) -> tuple[float, float]:
    """(mean loss, accuracy) on the held-out set; for text, next-character accuracy."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for i in range(0, len(dataset.test_x), batch):
        x, y = dataset.test_x[i:i + batch], dataset.test_y[i:i + batch]
        loss, c, n = loss_and_correct(model, (x, y), dataset.task)
        loss_sum += float(loss) * n
        correct += c
        count += n
    model.train()
    return loss_sum / max(count, 1), correct / max(count, 1)


def check_paths(cfg: TrainConfig) -> None:
    """Fail before training, not after it, when an output cannot be written."""
    for name in ("metrics", "save", "checkpoint"):
        path = getattr(cfg, name)
        if path:
            directory = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(directory):
                raise PsrtError(f"--{name} {path}: directory {directory} does not exist", everywhere=True)
            if os.path.isdir(path):
                raise PsrtError(f"--{name} {path}: is a directory, expected a file name", everywhere=True)


class Totals:
    """Per-rank sums over the steps of one run."""

    def __init__(self):
        self.steps, self.compute_s, self.comm_s, self.bytes_sent, self.loss = 0, 0.0, 0.0, 0, float("nan")

    def add(self, s: StepStats) -> None:
        self.steps += 1
        self.compute_s += s.compute_s
        self.comm_s += s.comm_s
        self.bytes_sent += s.bytes_sent
        self.loss = s.loss


def train_one(cfg: TrainConfig, dp: str, world, ctl, dataset, dog: Watchdog | None = None) -> dict | None:
    """Train with strategy `dp`; returns the summary row on the lead worker, else None."""
    if cfg.pp * cfg.tp != 1:   # model parallelism: psrt/train_hybrid.py
        return train_hybrid(cfg, dp, world, ctl, dataset, make_optimizer_factory(cfg), evaluate, summarize)
    comm = psrt.Communicator(world.comm, algorithm="auto")
    if dog is not None:
        dog.watch(comm)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, dataset, cfg.width, cfg.layers)
    strategy = strategy_class(dp)(model, make_optimizer_factory(cfg), comm, **strategy_options(cfg))
    roles = ctl.allgather(strategy.worker_rank)
    lead = roles.index(0)
    is_lead = ctl.rank == lead
    sampler = ShardedSampler(len(dataset), cfg.batch_size, strategy.num_workers,
                             max(strategy.worker_rank, 0), cfg.accum, cfg.seed)
    total = cfg.steps or cfg.epochs * sampler.steps_per_epoch
    config = dict(cfg.as_dict(), dp=dp)
    ckpt_path = cfg.path_for(cfg.checkpoint, dp)
    start = checkpoint.load(ckpt_path, ctl, strategy, config) if cfg.resume else 0
    if cfg.resume and is_lead and not cfg.quiet:
        print(f"psrt.train: resuming {dp} from {ckpt_path} at step {start}", file=sys.stderr, flush=True)

    def loss_fn(mb):
        return loss_and_correct(model, mb, dataset.task)[0]

    totals = Totals()
    metrics = report.Metrics(cfg.path_for(cfg.metrics, dp) if is_lead else None, append=cfg.resume)
    progress = report.Progress(total - start, f"{dp} x{strategy.num_workers}", enabled=is_lead and not cfg.quiet)
    x_all, y_all = dataset.train_x, dataset.train_y
    every = cfg.checkpoint_every
    saves = [k for k in range(start + 1, total) if every and k % every == 0]  # after step k
    ctl.Barrier()
    t0 = time.perf_counter()
    if strategy.is_worker:
        for step in range(start, total):
            mbs = [(x_all[i], y_all[i]) for i in sampler.microbatches(step)]
            stats = strategy.step(loss_fn, mbs)
            if dog is not None:
                dog.step(step + 1)
            totals.add(stats)
            if is_lead:
                epoch, _ = sampler.position(step)
                metrics.write({"dp": dp, "step": step + 1, "epoch": epoch, "loss": report.finite(stats.loss),
                               "compute_s": stats.compute_s, "comm_s": stats.comm_s,
                               "bytes_sent": stats.bytes_sent, "time_s": time.perf_counter() - t0})
                progress.update(step + 1 - start, f"loss {stats.loss:.4f}")
            if step + 1 in saves:
                checkpoint.save(ckpt_path, ctl, strategy, step + 1, sampler.steps_per_epoch, config)
        strategy.finish()
    else:
        # A dedicated server serves up to each checkpoint, joins it, and serves on.
        done = start
        for at in saves:
            strategy.serve(rounds=at - done)
            checkpoint.save(ckpt_path, ctl, strategy, at, sampler.steps_per_epoch, config)
            done = at
        strategy.serve()
        strategy.finish()
    wall = time.perf_counter() - t0
    if cfg.checkpoint:
        checkpoint.save(ckpt_path, ctl, strategy, total, sampler.steps_per_epoch, config)
    test_loss, test_acc = evaluate(model, dataset) if strategy.is_worker else (None, None)
    # A dedicated server takes no steps; its traffic is kept by the strategy itself.
    sent = totals.bytes_sent if strategy.is_worker else getattr(strategy, "server_totals", {}).get("bytes_sent", 0)
    mine = {"worker": strategy.is_worker, "compute_s": totals.compute_s, "comm_s": totals.comm_s,
            "bytes": sent, "opt": strategy.optimizer_state_bytes(), "steps": totals.steps,
            "loss": totals.loss, "test_loss": test_loss, "test_acc": test_acc, "wall": wall}
    everyone = ctl.gather(mine, root=lead)
    comm.close()
    row = None
    if is_lead:
        if cfg.save:
            checkpoint.atomic_save(model.state_dict(), cfg.path_for(cfg.save, dp))
        row = summarize(dp, everyone, mine, cfg.batch_size)
        metrics.write(dict({"summary": True}, **{k: report.finite(v) for k, v in row.items()}))
    metrics.close()
    return row


def summarize(dp: str, everyone: list[dict], lead: dict, batch_size: int) -> dict:
    workers = [r for r in everyone if r["worker"]]
    mean = lambda key: sum(r[key] for r in workers) / len(workers)  # noqa: E731
    return {"dp": dp, "workers": len(workers), "ranks": len(everyone), "steps": lead["steps"],
            "train_loss": lead["loss"], "test_loss": lead["test_loss"], "test_acc": lead["test_acc"],
            "samples_per_s": lead["steps"] * batch_size / max(lead["wall"], 1e-9),
            "wall_s": lead["wall"], "compute_s": mean("compute_s"), "comm_s": mean("comm_s"),
            "bytes_per_rank": mean("bytes"), "bytes_max_rank": max(r["bytes"] for r in everyone),
            "opt_state_bytes": max(r["opt"] for r in everyone)}


def set_threads(world) -> None:
    """One rank per core share: N ranks on a host must not each start a thread per core."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world.local_size))


@cli_main("psrt.train")
def main(argv=None) -> int:
    cfg = parse_args(argv)
    check_paths(cfg)
    world = psrt.init()
    faults.install("psrt.train")
    set_threads(world)
    ctl = world.comm.Dup()     # the loop's own messages never match a strategy's
    dataset = load(cfg.data, cfg.seq_len)
    # A stuck collective or a silent rank ends the job with a report instead of a hang.
    dog = Watchdog(world, timeout=cfg.timeout).start()
    mine = {}
    for dp in cfg.dp_list:
        row = train_one(cfg, dp, world, ctl, dataset, dog)
        if row is not None:
            mine[dp] = row
    # Each strategy's lead worker holds its row (a server may be rank 0): collect them.
    found = ctl.gather(mine, root=0)
    if ctl.rank == 0:
        rows = [next(f[dp] for f in found if dp in f) for dp in cfg.dp_list]
        print(f"\n{cfg.model} on {cfg.data}: global batch {cfg.batch_size}, {world.size} "
              f"rank{'s' * (world.size != 1)}, "
              f"{cfg.optimizer} lr {cfg.lr:g}")
        print(report.table(rows))
        if not cfg.quiet:
            print(report.LEGEND)
        sys.stdout.flush()
    dog.stop()
    ctl.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
