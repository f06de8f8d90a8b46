"""The --pp/--tp path of `python -m psrt.train`: the transformer cut into pipeline stages,
tensor-parallel inside each stage, data parallel over the remaining ranks (psrt.train.hybrid).

Every rank sees the same global batch from the sampler; the trainer slices it by data-parallel
rank and micro-batch, weighting each by its share of the global batch, so the gradients are
those of the global mean loss whatever the grid (tested against one process).
"""
from __future__ import annotations

import time

import torch

from psrt.train import checkpoint, report
from psrt.train.data import ShardedSampler
from psrt.errors import PsrtError
from psrt.train.models import build_model

# --dp names the reducer over the dp axis; these are the ones a hybrid run can use.
HYBRID_DP = {"ring": "ring", "ps": "ps", "native": "native", "torch": "torch"}


def train_hybrid(cfg, dp: str, world, ctl, dataset, make_optimizer, evaluate, summarize) -> dict | None:
    """Train with a DP x PP x TP grid; returns the summary row on grid rank 0, else None."""
    from psrt.grid import Grid
    from psrt.train.hybrid import HybridConfig, HybridTrainer

    if cfg.model != "transformer":
        raise PsrtError(f"--pp {cfg.pp} --tp {cfg.tp}: model parallelism splits the transformer; "
                        f"use --model transformer (got --model {cfg.model})", everywhere=True)
    if dp not in HYBRID_DP:
        raise PsrtError(f"--dp {dp} with --pp/--tp: the data-parallel axis of a hybrid run reduces "
                        f"with one of {', '.join(HYBRID_DP)}", everywhere=True)
    if cfg.resume or cfg.checkpoint:
        raise PsrtError("--checkpoint/--resume are not available with --pp/--tp", everywhere=True)
    grid = Grid.build(world, pp=cfg.pp, tp=cfg.tp)
    torch.manual_seed(cfg.seed)
    model = build_model("transformer", dataset, cfg.width, cfg.layers)
    hcfg = HybridConfig.for_model(model, schedule="1f1b", microbatches=cfg.accum,
                                  dp_algorithm=cfg.algorithm or HYBRID_DP[dp])
    trainer = HybridTrainer(grid, hcfg, dense=model, make_optimizer=make_optimizer)
    sampler = ShardedSampler(len(dataset), cfg.batch_size, grid.dp, grid.dp_rank, cfg.accum, cfg.seed)
    total = cfg.steps or cfg.epochs * sampler.steps_per_epoch
    lead = world.rank == 0
    label = f"{dp} dp{grid.dp}xpp{grid.pp}xtp{grid.tp}"
    progress = report.Progress(total, label, enabled=lead and not cfg.quiet)
    metrics = report.Metrics(cfg.path_for(cfg.metrics, dp) if lead else None)
    compute = comm = 0.0
    sent, loss = 0, float("nan")
    ctl.Barrier()
    t0 = time.perf_counter()
    for step in range(total):
        idx = sampler.global_indices(step)
        stats = trainer.step(dataset.train_x[idx], dataset.train_y[idx])
        compute, comm, sent, loss = compute + stats.compute_s, comm + stats.comm_s, sent + stats.bytes_sent, stats.loss
        if lead:
            metrics.write({"dp": dp, "pp": grid.pp, "tp": grid.tp, "step": step + 1,
                           "loss": report.finite(stats.loss), "compute_s": stats.compute_s,
                           "comm_s": stats.comm_s, "bytes_sent": stats.bytes_sent,
                           "bubble": stats.extra.get("bubble"), "time_s": time.perf_counter() - t0})
            progress.update(step + 1, f"loss {stats.loss:.4f}")
    wall = time.perf_counter() - t0
    state = trainer.dense_state_dict()          # the whole model on grid rank 0
    mine = {"worker": True, "compute_s": compute, "comm_s": comm, "bytes": sent, "opt": 0,
            "steps": total, "loss": float(loss), "test_loss": None, "test_acc": None, "wall": wall}
    everyone = ctl.gather(mine, root=0)
    grid.free()
    if not lead:
        metrics.close()
        return None
    model.load_state_dict(state)
    mine["test_loss"], mine["test_acc"] = evaluate(model, dataset)
    if cfg.save:
        checkpoint.atomic_save(model.state_dict(), cfg.path_for(cfg.save, dp))
    row = summarize(f"{dp} pp{grid.pp} tp{grid.tp}", everyone, mine, cfg.batch_size)
    metrics.write(dict({"summary": True}, **{k: report.finite(v) for k, v in row.items()}))
    metrics.close()
    return row
