"""The training loop of `python -m psrt.train` (its entry point is psrt/train/__main__.py).

The loop is the same for every strategy: each worker takes its slice of the global batch
(data.ShardedSampler), hands its micro-batches to `strategy.step`, and the lead worker
prints progress and writes metrics.  Parameter-server ranks run `strategy.serve()`.  The
strategy is driven through psrt.dp.driver.Driver, the object psrt.data_parallel gives a
user's own loop.  --model/--data may name the user's own (imported.py).
See docs/training.md for flags, the sampler policy and learning-rate handling.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch

import psrt
from psrt import env, faults
from psrt.dp import STRATEGIES, memory, precision, strategy_class
from psrt.dp.base import option_names
from psrt.dp.common import optimizer_factory
from psrt.dp.driver import AXIS_BYTES, Totals
from psrt.errors import PsrtError, make_options
from psrt.grid import Grid
from psrt.train import checkpoint, imported, layout, prediction, report
from psrt.train.ledger import activations, device_of, held_by, memory_row
from psrt.train.in_job import FULL_REPLICA, InJob
from psrt.train.in_job import refusal as in_job_refusal
from psrt.train.recovery import Recovery
from psrt.train.config import STRATEGY_FLAGS, TrainConfig, flag
from psrt.train.data import ShardedSampler
from psrt.dp.device import pick as pick_device
from psrt.dp.device import to as to_device
from psrt.train.models import build_model, loss_and_correct
from psrt.train.routing import RoutingTotals, moe_options, moe_summary
from psrt.trace import OFF, Tracer
from psrt.watchdog import Watchdog
from psrt.world import lost_peer, ulfm_refusal


def make_optimizer(cfg: TrainConfig):
    return optimizer_factory(cfg.optimizer, cfg.lr, cfg.momentum, cfg.weight_decay)


def mixed_precision(cfg: TrainConfig, world):
    """(compute dtype or None, LossScaler or None, optimizer factory) of --precision: fp16's
    scaler agrees over the world and its optimizers unscale and skip with it."""
    scaler = precision.LossScaler(world.comm.Dup()) if cfg.precision == "fp16" else None
    make_opt = precision.scaled_factory(make_optimizer(cfg), scaler) if scaler else make_optimizer(cfg)
    return precision.DTYPES[cfg.precision], scaler, make_opt


def autocast_loss(loss_of, compute_dtype, scaler, device=torch.device("cpu")):
    """loss_of(mb) with mb on `device`, the forward in the compute dtype, the loss fp32,
    scaled for fp16."""
    def loss_fn(mb):
        with torch.autocast(device.type, dtype=compute_dtype or torch.float32, enabled=compute_dtype is not None):
            loss = loss_of(to_device(mb, device)).float()
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
    """Before anything trains: every strategy can be loaded, takes its options and trains in
    this layout (psrt.train.layout.refusal), and a strategy flag the user set applies to at
    least one strategy of --dp (a --servers given to --dp ring alone would otherwise change
    nothing and say nothing)."""
    accepted = set()
    for dp in cfg.dp_list:
        cls = strategy_class(dp)
        make_options(cls.Options, strategy_options(cfg, dp), f"--dp {dp}")   # values checked now
        why = layout.refusal(dp, cfg.pp, cfg.tp, cfg.model == "moe", ep=cfg.ep, sequence_parallel=cfg.sequence_parallel,
                             precision=cfg.precision, servers=cfg.servers)
        if env.in_job_recovery() and not why:
            why = in_job_refusal(dp, bool(layout.axes(cfg.pp, cfg.tp, cfg.model == "moe")), cfg.precision,
                                 ulfm_refusal(), checkpoint=bool(cfg.checkpoint), servers=cfg.servers)
        if why:
            raise PsrtError(why, everywhere=True)
        accepted |= set(option_names(cls))
    for name in STRATEGY_FLAGS:
        if cfg.given(name) and name not in accepted:
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
    device = next(model.parameters()).device
    for i in range(0, len(dataset.test_x), batch):
        x, y = to_device((dataset.test_x[i:i + batch], dataset.test_y[i:i + batch]), device)
        value, c, n = loss_and_correct(model, (x, y), dataset.task, loss)
        loss_sum += float(value) * n
        correct = None if c is None or correct is None else correct + c
        count += n
    model.train()
    if not count:
        return None, None
    return loss_sum / count, None if correct is None else correct / count


def build_layout(cfg: TrainConfig, dp: str, world, dataset, tracer: Tracer, make_opt, compute_dtype, scaler):
    """(the layout, its Communicator to close or None, the loss of a micro-batch for the
    activations probe) of this run: the whole model on every rank, or the transformer on a
    grid (psrt.train.layout)."""
    device = pick_device(cfg.device, world.local_rank)
    torch.manual_seed(cfg.seed)
    if not layout.axes(cfg.pp, cfg.tp, cfg.model == "moe"):
        group = psrt.Communicator(world.comm, algorithm="auto", tracer=tracer)
        model = imported.make_model(cfg, dataset).to(device)
        criterion = imported.loss_of(cfg, dataset)
        loss_fn = autocast_loss(lambda mb: loss_and_correct(model, mb, dataset.task, criterion)[0],
                                compute_dtype, scaler, device)
        return layout.Plain(model, make_opt, dp, group, loss_fn, strategy_options(cfg, dp)), group, criterion
    grid = Grid.build(world.comm, pp=cfg.pp, tp=cfg.tp, ep=cfg.ep, tracer=tracer)
    moe = moe_options(cfg) if cfg.model == "moe" else {}
    dense = build_model("moe" if moe else "transformer", dataset, cfg.width, cfg.layers, cfg.recompute, **moe)
    on_grid = layout.OnGrid(grid, dense, dp, strategy_options(cfg, dp), make_opt, cfg.accum, compute_dtype,
                            scaler, cfg.sequence_parallel, tracer, device=device)
    return on_grid, None, None


@dataclass
class Job:
    """What every strategy of a run shares: the World, the loop's own communicator (a Dup, so
    its messages never match a strategy's) and the watchdog.  In-job recovery replaces all
    three with the survivors' (psrt.train.in_job)."""
    world: object
    ctl: object
    dog: Watchdog | None = None


def build_run(cfg: TrainConfig, dp: str, job: Job, dataset, tracer: Tracer) -> SimpleNamespace:
    """Strategy `dp` in this run's layout on job.world: the layout (`run`), its Communicator
    (`group`, None on a grid), `criterion`, fp16's `scaler`, the `sampler`, the `lead` worker."""
    compute_dtype, scaler, make_opt = mixed_precision(cfg, job.world)
    run, group, criterion = build_layout(cfg, dp, job.world, dataset, tracer, make_opt, compute_dtype, scaler)
    if job.dog is not None and group is not None:
        job.dog.watch(group)
    roles = job.ctl.allgather(run.worker_rank if run.is_worker else -1)
    sampler = ShardedSampler(len(dataset), cfg.batch_size, run.num_workers, run.worker_rank, cfg.accum, cfg.seed)
    return SimpleNamespace(run=run, group=group, criterion=criterion, scaler=scaler, sampler=sampler,
                           lead=roles.index(0))


def recover(cfg: TrainConfig, dp: str, job: Job, dataset, tracer: Tracer, b: SimpleNamespace,
            in_job: InJob, error: str) -> tuple[SimpleNamespace, int]:
    """After a lost rank: the survivors' run, rebuilt on their shrunk world with the state of
    the step they agreed on (or of the last checkpoint, for a state a lost rank held alone),
    and that step (psrt.train.in_job)."""
    world = job.world
    comms = [job.ctl, world.comm, world.local_comm] + ([b.scaler.comm] if b.scaler else [])
    comms += [getattr(c, name) for c in b.run.components for name in ("pcomm", "scomm")
              if getattr(c, name, None) is not None]   # the parameter servers' own channels
    job.world = in_job.shrink(error, world, comms, [b.group] if b.group else [], job.dog)
    for close in (b.run.finish, b.group.close):
        with contextlib.suppress(Exception):     # on revoked communicators: nothing left to do
            close()
    job.ctl = job.world.comm.Dup()
    if job.dog is not None:
        job.dog = Watchdog(job.world, timeout_s=cfg.timeout_s).start()
    if in_job.keep:
        step, state = in_job.agree(job.world)
        b = build_run(cfg, dp, job, dataset, tracer)
        b.run.state.load_state_dict(state)
    else:
        b = build_run(cfg, dp, job, dataset, tracer)
        path, config = cfg.path_for(cfg.checkpoint, dp), dict(cfg.as_dict(), dp=dp)
        step = in_job.reload(job.world, lambda: checkpoint.load(path, job.ctl, b.run.state, config))
    in_job.commit(step, b.run.state)
    in_job.started(b.run.label(dp), job.ctl.rank == b.lead)
    return b, step


def train_one(cfg: TrainConfig, dp: str, job: Job, dataset, tracer: Tracer = OFF) -> dict | None:
    """Train with strategy `dp` in this run's layout; returns the summary row on the lead
    worker, else None."""
    b = build_run(cfg, dp, job, dataset, tracer)
    run, group, sampler, ctl, dog, scaler, criterion = b.run, b.group, b.sampler, job.ctl, job.dog, b.scaler, b.criterion
    lead = b.lead
    is_lead = ctl.rank == lead
    total = cfg.steps or cfg.epochs * sampler.steps_per_epoch
    config = dict(cfg.as_dict(), dp=dp)
    ckpt_path = cfg.path_for(cfg.checkpoint, dp)
    recovery = Recovery(ckpt_path, cfg.checkpoint_every, total, is_lead)
    resume = recovery.resume(cfg.resume, ctl)
    start = checkpoint.load(ckpt_path, ctl, run.state, config) if resume else 0
    recovery.started(start, dp)
    if cfg.resume and is_lead and not cfg.quiet:
        print(f"psrt.train: resuming {dp} from {ckpt_path} at step {start}", file=sys.stderr, flush=True)
    in_job = InJob(is_lead, keep=dp in FULL_REPLICA) if env.in_job_recovery() else None

    metrics = report.Metrics(cfg.path_for(cfg.metrics, dp) if is_lead else None, append=resume)
    progress = report.Progress(total, run.label(dp), enabled=is_lead and not cfg.quiet, first=start)
    x_all, y_all = dataset.train_x, dataset.train_y
    every = recovery.every
    saves = [k for k in range(start + 1, total) if every and k % every == 0]  # after step k
    totals = Totals()
    routing = RoutingTotals()
    memory.reset_peak(device_of(run))
    ctl.Barrier()
    t0 = time.perf_counter()
    if run.is_worker:
        step = start
        if in_job is not None:
            in_job.commit(step, run.state)
        while step < total:
            mbs = [(x_all[i], y_all[i]) for i in sampler.microbatches(step)]
            faults.kill_if_asked(step + 1)
            try:
                with tracer.span("step", "step", step=step + 1) if group is None else contextlib.nullcontext():
                    stats = run.step(mbs)
            except Exception as err:
                error = lost_peer(err) if in_job is not None else None
                if error is None:
                    raise
                b, step = recover(cfg, dp, job, dataset, tracer, b, in_job, error)
                run, group, sampler, ctl, dog, scaler = b.run, b.group, b.sampler, job.ctl, job.dog, b.scaler
                if (ctl.rank == b.lead) != is_lead:      # the lead worker was lost: a new one writes
                    is_lead = ctl.rank == b.lead
                    metrics = report.Metrics(cfg.path_for(cfg.metrics, dp) if is_lead else None, append=True)
                    progress = report.Progress(total, run.label(dp), enabled=is_lead and not cfg.quiet, first=step)
                lead = b.lead
                continue
            if in_job is not None:
                in_job.commit(step + 1, run.state)
            totals.add(stats)
            routed = routing.add(cfg, stats.extra["moe"]) if "moe" in stats.extra else {}
            if dog is not None:
                dog.step(step + 1)
            recovered = {**recovery.step_done(step + 1), **(in_job.step_done(step + 1) if in_job else {})}
            if is_lead:
                epoch, _ = sampler.position(step)
                metrics.write({"dp": dp, "step": step + 1, "epoch": epoch, "loss": report.finite(stats.loss),
                               **({"pp": cfg.pp, "tp": cfg.tp} if group is None else {}), **routed,
                               "compute_s": stats.compute_s, "comm_s": stats.comm_s,
                               "bytes_sent": stats.bytes_sent, "time_s": time.perf_counter() - t0,
                               **{k: stats.extra[k] for k in AXIS_BYTES + ("bubble",) if k in stats.extra},
                               **({"loss_scale": scaler.scale} if scaler else {}), **recovered})
                note = f" dropped {routed['dropped']}" if routed else ""
                progress.update(step + 1, f"loss {stats.loss:.4f}{note}")
            if step + 1 in saves:
                checkpoint.save(ckpt_path, ctl, run.state, step + 1, sampler.steps_per_epoch, config)
            step += 1
        held = held_by(run)                           # as the last step left it
        run.finish()
    else:
        # A dedicated server serves up to each checkpoint, joins it, and serves on.
        done = start
        for at in saves:
            run.serve(rounds=at - done)
            checkpoint.save(ckpt_path, ctl, run.state, at, sampler.steps_per_epoch, config)
            done = at
        run.serve()
        held = held_by(run)
        run.finish()
    wall = time.perf_counter() - t0
    if cfg.checkpoint:
        checkpoint.save(ckpt_path, ctl, run.state, total, sampler.steps_per_epoch, config)
    model = run.whole()          # the one-process model: on every rank of a plain run, rank 0 of a grid
    test_loss, test_acc = evaluate(model, dataset, loss=criterion) if is_lead else (None, None)
    if run.is_worker and group is not None:
        first = sampler.microbatches(0)[0]
        held["activations"] = activations(model, lambda: run.loss_fn((x_all[first], y_all[first])))
    if not run.is_worker:
        totals.bytes_sent = run.bytes_sent()
    mine = {"worker": run.is_worker, "compute_s": totals.compute_s, "comm_s": totals.comm_s,
            "bytes": totals.bytes_sent, "axis_bytes": totals.axis_bytes,
            "opt": sum(c.optimizer_state_bytes() for c in run.components), "steps": totals.steps,
            "loss": totals.loss, "test_loss": test_loss, "test_acc": test_acc, "wall": wall, "held": held,
            "params": run.params_count(), "a2a": routing.a2a,
            "left_out": sum(getattr(c, "server_totals", {}).get("left_out", 0) for c in run.components)}
    everyone = ctl.gather(mine, root=lead)
    if group is not None:
        group.close()
    run.free()
    if scaler:
        scaler.comm.Free()
    row = None
    if is_lead:
        if cfg.save:
            checkpoint.atomic_save({k: v.cpu() for k, v in model.state_dict().items()}, cfg.path_for(cfg.save, dp))
        name = dp if group is not None else (f"{dp} pp{cfg.pp} tp{cfg.tp}" if cfg.pp * cfg.tp > 1 else dp) \
            + (f" ep{cfg.ep}" if routing.layers else "")
        row = summarize(name, everyone, mine, cfg.batch_size)
        # the step the run reached, a resumed one's earlier steps included (samples/s and the
        # times are this run's own)
        row.update(steps=total, steps_run=totals.steps)
        if cfg.backup_workers and "ps" in dp:
            row.update(left_out=sum(r["left_out"] for r in everyone), backup_workers=cfg.backup_workers)
        row["grad_bytes"] = wire_gradient_bytes(model, cfg, dp)
        row.update(memory_row(dp, everyone, model, cfg, dp_size=run.num_workers if group is None else None))
        if scaler:
            row.update(loss_scale=scaler.scale, skipped_steps=scaler.skipped)
        if routing.layers:
            g = run.grid
            row.update(moe_summary(cfg, g.dp, routing, total - start, sum(r["a2a"] for r in everyone) / len(everyone),
                                   model.embed.tok.embedding_dim, layers_per_rank=routing.layers / g.pp))
    metrics.close()
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
    dataset = imported.load_data(cfg.data, cfg.seq_len)
    # A stuck collective or a silent rank ends the job with a report instead of a hang: the
    # world's watchdog (psrt.init), on --timeout, else one of the run's own.
    given = world.watchdog if world.watchdog is not None and world.watchdog.running() else None
    dog = None
    if watchdog:
        dog = given or Watchdog(world, timeout_s=cfg.timeout_s).start()
        if given is not None and cfg.timeout_s is not None:
            given.retime(cfg.timeout_s)
    job = Job(world, world.comm.Dup(), dog)
    mine = {}
    for dp in cfg.dp_list:
        # one timeline per strategy (FILE.<dp>.json with several, as --metrics), so that two
        # strategies' steps are never drawn or summed as one run's
        tracer = Tracer() if cfg.trace else OFF
        row = train_one(cfg, dp, job, dataset, tracer)
        if row is not None:
            mine[dp] = row
        if cfg.trace:
            tracer.write(job.ctl, cfg.path_for(cfg.trace, dp), job.world.hostname)   # rank 0 writes every rank's
    # Each strategy's lead worker holds its row (a server may be rank 0): collect them.
    world, ctl = job.world, job.ctl
    found = ctl.gather(mine, root=0)
    # Comparing strategies: the alpha-beta model of this run's link, beside the measurement,
    # or one line saying why the model does not apply.
    compare = len(cfg.dp_list) > 1
    not_covered = prediction.not_covered(cfg.pp, cfg.tp, cfg.model) if compare else None
    link = prediction.measure(world, ctl) if compare and not_covered is None else None
    if job.dog is not None and job.dog is not given:
        job.dog.stop()       # the world's own says farewell when the program ends
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
