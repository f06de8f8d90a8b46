"""The training loop of `python -m psrt.train` (its entry point is psrt/train/__main__.py).

The loop is the same for every strategy: each worker takes its slice of the global batch
(data.ShardedSampler), hands its micro-batches to `strategy.step`, and the lead worker
prints progress and writes metrics.  Parameter-server ranks run `strategy.serve()`.  The
strategy is driven through psrt.dp.driver.Driver, the object psrt.data_parallel gives a
user's own loop.  --model/--data may name the user's own (imported.py).
See docs/training.md for flags, the sampler policy and learning-rate handling.
"""
from __future__ import annotations

import os
import sys
import time

import torch

import psrt
from psrt.dp import STRATEGIES, memory, precision, strategy_class
from psrt.dp.base import option_names
from psrt.dp.common import optimizer_factory, optimizer_state_bytes
from psrt.dp.driver import Driver
from psrt.errors import PsrtError, make_options
from psrt.grid import Grid
from psrt.train import checkpoint, imported, prediction, report
from psrt.train.config import STRATEGY_FLAGS, TrainConfig, flag
from psrt.train.data import ShardedSampler
from psrt.train.hybrid import HybridConfig, HybridTrainer
from psrt.train.models import build_model, loss_and_correct
from psrt.trace import OFF, Tracer
from psrt.watchdog import Watchdog


def make_optimizer(cfg: TrainConfig):
    return optimizer_factory(cfg.optimizer, cfg.lr, cfg.momentum, cfg.weight_decay)


def mixed_precision(cfg: TrainConfig, world):
    """(compute dtype or None, LossScaler or None, optimizer factory) of --precision: fp16's
    scaler agrees over the world and its optimizers unscale and skip with it."""
    scaler = precision.LossScaler(world.comm.Dup()) if cfg.precision == "fp16" else None
    make_opt = precision.scaled_factory(make_optimizer(cfg), scaler) if scaler else make_optimizer(cfg)
    return precision.DTYPES[cfg.precision], scaler, make_opt


def autocast_loss(loss_of, compute_dtype, scaler):
    """loss_of(mb) with the forward in the compute dtype, the loss fp32, scaled for fp16."""
    def loss_fn(mb):
        with torch.autocast("cpu", dtype=compute_dtype or torch.float32, enabled=compute_dtype is not None):
            loss = loss_of(mb).float()
        return scaler(loss) if scaler else loss
    return loss_fn


def strategy_options(cfg: TrainConfig, dp: str) -> dict:
    """The options strategy `dp` accepts, from the flags of the same name; those left unset
    are left out so the strategy's own default holds.  With --precision bf16 or fp16 and no
    --compress, gradients travel in the compute dtype where the strategy offers it."""
    cls = strategy_class(dp)
    options = {k: getattr(cfg, k) for k in option_names(cls) if getattr(cfg, k, None) is not None}
    if cfg.precision != "fp32" and "compress" in options and not cfg.given("compress"):
        try:
            cls.Options(compress=cfg.precision)
            options["compress"] = cfg.precision
        except PsrtError:
            pass                       # a strategy without that wire dtype keeps its own
    return options


def check_strategies(cfg: TrainConfig) -> None:
    """Before anything trains: every strategy can be loaded and takes its options, and a
    strategy flag the user set applies to at least one strategy of --dp (a --servers given
    to --dp ring alone would otherwise change nothing and say nothing).  Hybrid (--pp/--tp)
    and MoE runs reduce their gradients in flat buffers after backward, with --dp naming the
    all-reduce: of the strategy flags only --algorithm applies to them."""
    hybrid = cfg.pp * cfg.tp != 1
    grid_run = hybrid or cfg.model == "moe"
    accepted = {"algorithm"} if grid_run else set()
    for dp in cfg.dp_list:
        if hybrid:
            check_hybrid(cfg, dp)
        elif not grid_run:
            cls = strategy_class(dp)
            make_options(cls.Options, strategy_options(cfg, dp), f"--dp {dp}")   # values checked now
            accepted |= set(option_names(cls))
    for name in STRATEGY_FLAGS:
        if cfg.given(name) and name not in accepted:
            if grid_run:
                where = "--pp/--tp" if hybrid else "--model moe"
                raise PsrtError(f"{flag(name)} does not apply to --dp {cfg.dp} with {where}: the gradients "
                                "reduce in one flat all-reduce after backward, whose algorithm --algorithm "
                                "picks", everywhere=True)
            raise PsrtError(f"{flag(name)} does not apply to --dp {cfg.dp}: it is an option of "
                            f"{', '.join(takers(name)) or 'no strategy'}", everywhere=True)


def takers(option: str) -> list[str]:
    """The strategies that accept `option`."""
    return [dp for dp in STRATEGIES if option in option_names(strategy_class(dp))]


@torch.no_grad()
def evaluate(model, dataset, batch: int = 512, loss=None) -> tuple[float | None, float | None]:
    """(mean loss, accuracy) on the held-out set; for text, next-character accuracy.  None
    for what cannot be measured: an empty test set, accuracy of targets that are not classes."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for i in range(0, len(dataset.test_x), batch):
        x, y = dataset.test_x[i:i + batch], dataset.test_y[i:i + batch]
        value, c, n = loss_and_correct(model, (x, y), dataset.task, loss)
        loss_sum += float(value) * n
        correct = None if c is None or correct is None else correct + c
        count += n
    model.train()
    if not count:
        return None, None
    return loss_sum / count, None if correct is None else correct / count


def train_one(cfg: TrainConfig, dp: str, world, ctl, dataset, dog: Watchdog | None = None,
              tracer: Tracer = OFF) -> dict | None:
    """Train with strategy `dp`; returns the summary row on the lead worker, else None."""
    if cfg.pp * cfg.tp != 1:   # model parallelism
        return train_hybrid(cfg, dp, world, ctl, dataset, tracer)
    if cfg.model == "moe":     # expert parallelism
        return train_moe(cfg, dp, world, ctl, dataset, tracer)
    group = psrt.Communicator(world.comm, algorithm="auto", tracer=tracer)
    if dog is not None:
        dog.watch(group)
    torch.manual_seed(cfg.seed)
    model = imported.make_model(cfg, dataset)
    criterion = imported.loss_of(cfg, dataset)
    compute_dtype, scaler, make_opt = mixed_precision(cfg, world)
    strategy = Driver(model, make_opt, dp, group, **strategy_options(cfg, dp))
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

    loss_fn = autocast_loss(lambda mb: loss_and_correct(model, mb, dataset.task, criterion)[0],
                            compute_dtype, scaler)

    totals = strategy.totals
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
            stats = strategy.step(loss_fn, microbatches=mbs)
            if dog is not None:
                dog.step(step + 1)
            if is_lead:
                epoch, _ = sampler.position(step)
                metrics.write({"dp": dp, "step": step + 1, "epoch": epoch, "loss": report.finite(stats.loss),
                               "compute_s": stats.compute_s, "comm_s": stats.comm_s,
                               "bytes_sent": stats.bytes_sent, "time_s": time.perf_counter() - t0,
                               **({"loss_scale": scaler.scale} if scaler else {})})
                progress.update(step + 1 - start, f"loss {stats.loss:.4f}")
            if step + 1 in saves:
                checkpoint.save(ckpt_path, ctl, strategy, step + 1, sampler.steps_per_epoch, config)
        held = strategy.memory()                     # as the last step left it
        strategy.finish()
    else:
        # A dedicated server serves up to each checkpoint, joins it, and serves on.
        done = start
        for at in saves:
            strategy.serve(rounds=at - done)
            checkpoint.save(ckpt_path, ctl, strategy, at, sampler.steps_per_epoch, config)
            done = at
        strategy.serve()
        held = strategy.memory()
        strategy.finish()
    wall = time.perf_counter() - t0
    if cfg.checkpoint:
        checkpoint.save(ckpt_path, ctl, strategy, total, sampler.steps_per_epoch, config)
    test_loss, test_acc = evaluate(model, dataset, loss=criterion) if strategy.is_worker else (None, None)
    if strategy.is_worker:
        first = sampler.microbatches(0)[0]
        held["activations"] = activations(model, lambda: loss_fn((x_all[first], y_all[first])))
    mine = {"worker": strategy.is_worker, "compute_s": totals.compute_s, "comm_s": totals.comm_s,
            "bytes": strategy.bytes_sent, "opt": strategy.optimizer_state_bytes(), "steps": totals.steps,
            "loss": totals.loss, "test_loss": test_loss, "test_acc": test_acc, "wall": wall, "held": held}
    everyone = ctl.gather(mine, root=lead)
    group.close()
    if scaler:
        scaler.comm.Free()
    row = None
    if is_lead:
        if cfg.save:
            checkpoint.atomic_save(model.state_dict(), cfg.path_for(cfg.save, dp))
        row = summarize(dp, everyone, mine, cfg.batch_size)
        row["grad_bytes"] = wire_gradient_bytes(model, cfg, dp)
        row.update(memory_row(dp, everyone, model, cfg))
        if scaler:
            row.update(loss_scale=scaler.scale, skipped_steps=scaler.skipped)
    metrics.close()
    return row


def activations(model, forward) -> int:
    """Bytes autograd keeps for backward over one micro-batch's forward (psrt.dp.memory), the
    model's buffers and the random state left as they were."""
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    rng = torch.get_rng_state()
    try:
        return memory.activation_bytes(forward, exclude=list(model.parameters()))
    finally:
        torch.set_rng_state(rng)
        with torch.no_grad():
            for k, b in model.named_buffers():
                b.copy_(buffers[k])


def memory_row(dp: str, everyone: list[dict], model, cfg: TrainConfig) -> dict:
    """The ledger's columns: the most any rank holds of each part and where (host or device
    memory), the activations of one micro-batch, and ZeRO's formula for the model states
    (psrt.dp.memory)."""
    most = {part: max(r["held"][part] for r in everyone) for part in memory.PARTS + ("buffers", "host", "device")}
    phi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    k = memory.state_bytes_per_param(cfg.optimizer, cfg.momentum)
    d = next(model.parameters()).element_size()
    offload = bool(cfg.offload_optimizer) and "offload_optimizer" in option_names(strategy_class(dp))
    expect = memory.formula(dp, phi, sum(r["worker"] for r in everyone), k, d, offload)
    row = {f"mem_{part}": v for part, v in most.items()}
    row["mem_states"] = max(sum(r["held"][part] for part in memory.PARTS) for r in everyone)
    row["mem_activations"] = max(r["held"].get("activations", 0) for r in everyone)
    row["params"] = phi
    row["offload"] = offload
    if expect is not None:
        row["formula_states"] = sum(expect.values())
    if cfg.model == "transformer":
        blocks = model.blocks
        compute = precision.DTYPES[cfg.precision]
        row["formula_activations"] = memory.transformer_activations(
            cfg.seq_len, cfg.batch_size // max(1, sum(r["worker"] for r in everyone)) // cfg.accum,
            blocks[0].ln1.normalized_shape[0], len(blocks), model.head.out.out_features, d, cfg.recompute,
            compute=None if compute is None else torch.empty(0, dtype=compute).element_size())
    return row


def wire_gradient_bytes(model, cfg: TrainConfig, dp: str) -> int:
    """Bytes of gradients a step communicates: every trainable parameter, in the --compress
    dtype where the strategy takes it."""
    squeeze = cfg.compress != "none" and "compress" in option_names(strategy_class(dp))
    return sum(p.numel() * (2 if squeeze else p.element_size()) for p in model.parameters() if p.requires_grad)


def summarize(dp: str, everyone: list[dict], lead: dict, batch_size: int) -> dict:
    workers = [r for r in everyone if r["worker"]]
    mean = lambda key: sum(r[key] for r in workers) / len(workers)  # noqa: E731
    return {"dp": dp, "workers": len(workers), "ranks": len(everyone), "steps": lead["steps"],
            "train_loss": lead["loss"], "test_loss": lead["test_loss"], "test_acc": lead["test_acc"],
            "samples_per_s": lead["steps"] * batch_size / max(lead["wall"], 1e-9),
            "wall_s": lead["wall"], "compute_s": mean("compute_s"), "comm_s": mean("comm_s"),
            "bytes_per_rank": mean("bytes"), "bytes_max_rank": max(r["bytes"] for r in everyone),
            "opt_state_bytes": max(r["opt"] for r in everyone)}


def train_all(cfg: TrainConfig, world, watchdog: bool = True) -> list[dict] | None:
    """Check every strategy, then train each of --dp in turn; the summary rows, in --dp
    order, on rank 0 (None elsewhere).  The driver of python -m psrt.train and the examples."""
    check_strategies(cfg)
    imported.check(cfg)        # the user's --model/--data import before any data is loaded
    set_threads(world)
    ctl = world.comm.Dup()     # the loop's own messages never match a strategy's
    dataset = imported.load_data(cfg.data, cfg.seq_len)
    # A stuck collective or a silent rank ends the job with a report instead of a hang.
    dog = Watchdog(world, timeout_s=cfg.timeout_s).start() if watchdog else None
    tracer = Tracer() if cfg.trace else OFF
    mine = {}
    for dp in cfg.dp_list:
        row = train_one(cfg, dp, world, ctl, dataset, dog, tracer)
        if row is not None:
            mine[dp] = row
    # Each strategy's lead worker holds its row (a server may be rank 0): collect them.
    found = ctl.gather(mine, root=0)
    if cfg.trace:
        tracer.write(ctl, cfg.trace, world.hostname)      # rank 0 writes the whole job's timeline
    # Comparing strategies: the alpha-beta model of this run's link, beside the measurement,
    # or one line saying why the model does not apply.
    compare = len(cfg.dp_list) > 1
    not_covered = prediction.not_covered(cfg.pp, cfg.tp, cfg.model) if compare else None
    link = prediction.measure(world, ctl) if compare and not_covered is None else None
    if dog is not None:
        dog.stop()
    ctl.Free()
    if found is None:
        return None
    rows = [next(f[dp] for f in found if dp in f) for dp in cfg.dp_list]
    if link is not None:
        prediction.annotate(rows, link, cfg.servers)
    if not_covered is not None:
        rows[0]["no_prediction"] = not_covered
    # Each metrics file ends with its strategy's summary, the prediction included.
    for dp, row in zip(cfg.dp_list, rows):
        out = report.Metrics(cfg.path_for(cfg.metrics, dp), append=True)
        out.write({"summary": True, **{k: report.finite(v) for k, v in row.items() if k != "link"}})
        out.close()
    return rows


def set_threads(world) -> None:
    """One rank per core share: N ranks on a host must not each start a thread per core."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world.local_size))

# ------------------------------------------------------------------ --pp / --tp
# The transformer cut into pipeline stages, tensor-parallel inside each stage, data parallel
# over the remaining ranks (psrt.train.hybrid).  Every rank sees the same global batch from
# the sampler; the trainer slices it by data-parallel rank and micro-batch, weighting each by
# its share of the global batch, so the gradients are those of the global mean loss whatever
# the grid (tested against one process).

# --dp names the reducer over the dp axis; these are the ones a hybrid run can use.
HYBRID_DP = {"ring": "ring", "ps": "ps", "native": "native", "torch": "torch"}


def check_hybrid(cfg: TrainConfig, dp: str) -> None:
    if dp not in HYBRID_DP:
        raise PsrtError(f"--dp {dp} with --pp/--tp: the data-parallel axis of a hybrid run reduces "
                        f"with one of {', '.join(HYBRID_DP)}", everywhere=True)


def train_hybrid(cfg: TrainConfig, dp: str, world, ctl, dataset, tracer: Tracer = OFF) -> dict | None:
    """Train with a DP x PP x TP grid; returns the summary row on grid rank 0, else None."""
    check_hybrid(cfg, dp)
    # the grid's communicators record the DP and TP collectives into the timeline
    grid = Grid.build(world.comm, pp=cfg.pp, tp=cfg.tp, ep=cfg.ep, tracer=tracer)
    torch.manual_seed(cfg.seed)
    moe = moe_options(cfg) if cfg.model == "moe" else {}
    model = build_model("moe" if moe else "transformer", dataset, cfg.width, cfg.layers, cfg.recompute, **moe)
    hcfg = HybridConfig.for_model(model, schedule="1f1b", microbatches=cfg.accum,
                                  dp_algorithm=cfg.algorithm or HYBRID_DP[dp],
                                  sequence_parallel=cfg.sequence_parallel)
    compute_dtype, scaler, make_opt = mixed_precision(cfg, world)
    trainer = HybridTrainer(grid, hcfg, dense=model, make_optimizer=make_opt, tracer=tracer,
                            compute_dtype=compute_dtype, scaler=scaler)
    sampler = ShardedSampler(len(dataset), cfg.batch_size, grid.dp, grid.dp_rank, cfg.accum, cfg.seed)
    total = cfg.steps or cfg.epochs * sampler.steps_per_epoch
    lead = world.rank == 0
    label = f"{dp} dp{grid.dp}xpp{grid.pp}xtp{grid.tp}"
    progress = report.Progress(total, label, enabled=lead and not cfg.quiet)
    metrics = report.Metrics(cfg.path_for(cfg.metrics, dp) if lead else None)
    compute = comm = 0.0
    sent, loss = 0, float("nan")
    routing = RoutingTotals()
    ctl.Barrier()
    t0 = time.perf_counter()
    for step in range(total):
        idx = sampler.global_indices(step)
        with tracer.span("step", "step", step=step + 1):
            stats = trainer.step(dataset.train_x[idx], dataset.train_y[idx])
        compute, comm, sent, loss = compute + stats.compute_s, comm + stats.comm_s, sent + stats.bytes_sent, stats.loss
        routed = routing.add(cfg, stats.extra["moe"]) if moe else {}
        if lead:
            metrics.write({"dp": dp, "pp": grid.pp, "tp": grid.tp, "step": step + 1,
                           "loss": report.finite(stats.loss), **routed, "compute_s": stats.compute_s,
                           "comm_s": stats.comm_s, "bytes_sent": stats.bytes_sent,
                           "bubble": stats.extra.get("bubble"), "time_s": time.perf_counter() - t0})
            progress.update(step + 1, f"loss {stats.loss:.4f}")
    wall = time.perf_counter() - t0
    state = trainer.dense_state_dict()          # the whole model on grid rank 0
    mine = {"worker": True, "compute_s": compute, "comm_s": comm, "bytes": sent,
            "opt": optimizer_state_bytes(trainer.optimizer),
            "steps": total, "loss": float(loss), "test_loss": None, "test_acc": None, "wall": wall}
    if moe:
        mine["a2a"] = routing.a2a
    everyone = ctl.gather(mine, root=0)
    grid.free()
    if scaler:
        scaler.comm.Free()
    if not lead:
        metrics.close()
        return None
    model.load_state_dict(state)
    mine["test_loss"], mine["test_acc"] = evaluate(model, dataset)
    if cfg.save:
        checkpoint.atomic_save(model.state_dict(), cfg.path_for(cfg.save, dp))
    name = f"{dp} pp{grid.pp} tp{grid.tp}" + (f" ep{cfg.ep}" if moe else "")
    row = summarize(name, everyone, mine, cfg.batch_size)
    if scaler:
        row.update(loss_scale=scaler.scale, skipped_steps=scaler.skipped)
    if moe:
        row.update(moe_summary(cfg, grid.dp, routing, total, sum(r["a2a"] for r in everyone) / len(everyone),
                               model.embed.tok.embedding_dim, layers_per_rank=routing.layers / grid.pp))
    metrics.close()
    return row


# ------------------------------------------------------------------ --model moe
# The transformer with mixture-of-experts MLPs, experts spread over --ep ranks of each block
# of the data-parallel ranks (psrt.grid, psrt.ep).  Dense gradients reduce over all ranks with
# the algorithm of --dp, expert gradients over the ranks holding the same experts.

def moe_options(cfg: TrainConfig) -> dict:
    return {"experts": cfg.experts, "top_k": cfg.top_k, "capacity_factor": cfg.capacity_factor,
            "aux_alpha": cfg.aux_weight, "dispatch": cfg.moe_dispatch}


def train_moe(cfg: TrainConfig, dp: str, world, ctl, dataset, tracer: Tracer = OFF) -> dict | None:
    """Train --model moe; returns the summary row (with the routing) on rank 0, else None."""
    from psrt.ep.layer import moe_layers
    from psrt.train.moe import MoETrainer
    from psrt.train.config import MOE_DP
    grid = Grid.build(world.comm, ep=cfg.ep, tracer=tracer)
    torch.manual_seed(cfg.seed)
    model = build_model("moe", dataset, cfg.width, cfg.layers, cfg.recompute, **moe_options(cfg))
    layers = moe_layers(model)
    for layer in layers:
        layer.shard(grid.ep_group, grid.dp_group, algorithm="pairwise")
    compute_dtype, scaler, make_opt = mixed_precision(cfg, world)
    trainer = MoETrainer(model, make_opt, grid, algorithm=cfg.algorithm or MOE_DP[dp], scaler=scaler)
    loss_fn = autocast_loss(lambda mb: loss_and_correct(model, mb, dataset.task)[0], compute_dtype, scaler)

    sampler = ShardedSampler(len(dataset), cfg.batch_size, grid.dp, grid.dp_rank, cfg.accum, cfg.seed)
    total = cfg.steps or cfg.epochs * sampler.steps_per_epoch
    lead = world.rank == 0
    progress = report.Progress(total, f"{dp} moe ep{cfg.ep}", enabled=lead and not cfg.quiet)
    metrics = report.Metrics(cfg.path_for(cfg.metrics, dp) if lead else None)
    x_all, y_all = dataset.train_x, dataset.train_y
    compute = comm = 0.0
    sent, loss = 0, float("nan")
    routing = RoutingTotals()
    ctl.Barrier()
    t0 = time.perf_counter()
    for step in range(total):
        mbs = [(x_all[i], y_all[i]) for i in sampler.microbatches(step)]
        with tracer.span("step", "step", step=step + 1):
            stats = trainer.step(loss_fn, mbs)
        compute, comm, sent, loss = compute + stats.compute_s, comm + stats.comm_s, sent + stats.bytes_sent, stats.loss
        routed = routing.add(cfg, dict(stats.extra, layers=len(layers)))
        if lead:
            metrics.write({"dp": dp, "step": step + 1, "loss": report.finite(stats.loss), **routed,
                           "compute_s": stats.compute_s, "comm_s": stats.comm_s, "time_s": time.perf_counter() - t0})
            progress.update(step + 1, f"loss {stats.loss:.4f} dropped {routed['dropped']}")
    wall = time.perf_counter() - t0
    test_loss, test_acc = evaluate(model, dataset)    # every rank: the experts answer all of them
    mine = {"worker": True, "compute_s": compute, "comm_s": comm, "bytes": sent,
            "opt": optimizer_state_bytes(trainer.optimizer), "steps": total, "loss": float(loss),
            "test_loss": test_loss, "test_acc": test_acc, "wall": wall, "a2a": routing.a2a}
    everyone = ctl.gather(mine, root=0)
    grid.free()
    if scaler:
        scaler.comm.Free()
    metrics.close()
    if not lead:
        return None
    if cfg.save:
        checkpoint.atomic_save(model.state_dict(), cfg.path_for(cfg.save, dp))
    row = summarize(f"{dp} ep{cfg.ep}", everyone, mine, cfg.batch_size)
    if scaler:
        row.update(loss_scale=scaler.scale, skipped_steps=scaler.skipped)
    row.update(moe_summary(cfg, grid.dp, routing, total, sum(r["a2a"] for r in everyone) / len(everyone),
                           trainer.model_width()))
    return row


class RoutingTotals:
    """A MoE run's routing figures summed over its steps: routed and dropped per expert (every
    layer), the all-to-all bytes this rank sent, the model's number of MoE layers."""

    def __init__(self):
        self.routed = self.dropped = None
        self.a2a, self.layers = 0.0, 0

    def add(self, cfg: TrainConfig, step: dict) -> dict:
        """Add one step's figures (psrt.train.moe's step extra, or the hybrid step's extra
        "moe"); returns its fields of the --metrics line, the same for both."""
        self.routed = step["routed"].clone() if self.routed is None else self.routed + step["routed"]
        self.dropped = step["dropped"].clone() if self.dropped is None else self.dropped + step["dropped"]
        self.a2a += step["a2a_bytes"]
        self.layers = step["layers"]
        return {"ep": cfg.ep, "aux_loss": step["aux_loss"], "routed": step["routed"].tolist(),
                "dropped": int(step["dropped"].sum()), "a2a_bytes": step["a2a_bytes"]}


def moe_summary(cfg: TrainConfig, dp: int, routing: RoutingTotals, steps: int, a2a: float, width: int,
                layers_per_rank: float | None = None) -> dict:
    """The summary row's MoE fields: tokens routed per expert per step and layer, the dropped
    fraction, all-to-all bytes per rank and step (a2a: summed over the steps, mean of the
    ranks) beside the uniform-routing model, 4 all-to-alls per layer of T k h d (EP-1)/EP bytes,
    d the bytes of a value of the compute dtype, in which the rows travel (a pipeline rank
    holds layers / pp of the layers: layers_per_rank)."""
    tokens = cfg.batch_size // dp * cfg.seq_len          # per rank per step
    d = 4 if cfg.precision == "fp32" else 2
    layers = routing.layers
    layers_per_rank = layers if layers_per_rank is None else layers_per_rank
    routed, dropped = routing.routed, routing.dropped
    return dict(moe=True, experts=cfg.experts, ep=cfg.ep, top_k=cfg.top_k,
                routed_per_step=(routed / steps / max(layers, 1)).tolist(),
                dropped_frac=float(dropped.sum() / routed.sum()) if routed.sum() else 0.0,
                a2a_bytes_per_step=a2a / steps,
                a2a_uniform=4 * tokens * cfg.top_k * width * d * (cfg.ep - 1) / cfg.ep * layers_per_rank)
