"""psrt.train's runs put together: the strategies checked, each one's layout built, its
components (psrt/train/callbacks/) given to the loop core (psrt/train/core.py), and the
strategies trained in turn (its entry point is psrt/train/__main__.py).

Each worker takes its slice of the global batch (data.ShardedSampler) and hands its
micro-batches to the layout's step; parameter-server ranks serve.  A plain layout drives its
strategy through psrt.dp.driver.Driver, the object psrt.data_parallel gives a user's own
loop.  --model/--data may name the user's own (imported.py), --callback the user's own
components.  See docs/how-to/training.md for flags, the sampler policy and learning-rate handling.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch

import psrt
from psrt import env
from psrt.collectives.p2p import barrier
from psrt.dp import STRATEGIES, precision, strategy_class
from psrt.dp.base import option_names
from psrt.dp.common import optimizer_factory
from psrt.dp.device import pick as pick_device
from psrt.dp.device import to as to_device
from psrt.errors import PsrtError, make_options
from psrt.grid import Grid
from psrt.train import core, emulated, imported, layout, prediction, report
from psrt.train.callbacks import user
from psrt.train.callbacks.checkpoints import Checkpoints
from psrt.train.callbacks.cpu_load import CpuLoad
from psrt.train.callbacks.evaluation import Evaluation
from psrt.train.callbacks.heartbeat import Heartbeat
from psrt.train.callbacks.in_job import InJobRecovery
from psrt.train.callbacks.ledger import MemoryLedger
from psrt.train.callbacks.metrics import Metrics
from psrt.train.callbacks.progress import Progress
from psrt.train.callbacks.restarts import Restarts
from psrt.train.callbacks.routing import Routing
from psrt.train.callbacks.saving import SaveModel
from psrt.train.callbacks.summary import Summary
from psrt.train.callbacks.tensorboard import TensorBoard
from psrt.train.callbacks.timeline import Timeline
from psrt.train.config import STRATEGY_FLAGS, TrainConfig, flag
from psrt.train.data import ShardedSampler
from psrt.train.events import Events
from psrt.train.in_job import refusal as in_job_refusal
from psrt.train.models import build_model, loss_and_correct
from psrt.train.routing import moe_options
from psrt.train.state import RunState
from psrt.trace import OFF, Tracer
from psrt.watchdog import Watchdog
from psrt.world import ulfm_refusal


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


def build_layout(cfg: TrainConfig, dp: str, world, dataset, tracer: Tracer, make_opt, compute_dtype, scaler):
    """(the layout, its Communicator to close or None, the loss of a micro-batch for the
    activations probe) of this run: the whole model on every rank, or the transformer on a
    grid (psrt.train.layout)."""
    device = pick_device(cfg.device, world.local_rank)
    torch.manual_seed(cfg.seed)
    if not layout.axes(cfg.pp, cfg.tp, cfg.model == "moe"):
        group = psrt.Communicator(world.comm, algorithm="auto", tracer=tracer)
        model = emulated.build_model(cfg, dataset).to(device)
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
    # this process is rank 0 of the survivors of an in-job recovery: it says, when leaving,
    # that they have all finished (psrt.train.in_job.leave)
    speaks_for_survivors: bool = False


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


def components(cfg: TrainConfig) -> list:
    """The components of one strategy's run, in the order they hear each event: those that
    note a step's fields before metrics and progress write them, the summary row before the
    components that add columns to it, the user's own after psrt's, the timeline last."""
    out = [Restarts()] + ([InJobRecovery()] if env.in_job_recovery() else [])
    out += [Heartbeat(), Summary(), CpuLoad(), Routing(), Metrics(), Progress(cfg.quiet), Checkpoints(),
            MemoryLedger(), Evaluation(), SaveModel()]
    out += [TensorBoard(cfg.tensorboard)] if cfg.tensorboard else []
    return out + user.load(cfg.callback) + [Timeline()]


def train_one(cfg: TrainConfig, dp: str, job: Job, dataset, tracer: Tracer = OFF) -> dict | None:
    """Train with strategy `dp` in this run's layout (psrt.train.core and its components);
    returns the summary row on the lead worker, else None."""
    run = RunState(cfg, dp, job, dataset, tracer, build=lambda: build_run(cfg, dp, job, dataset, tracer))
    row = core.train(run, Events(components(cfg)))
    if run.group is not None:
        run.group.close()
    run.layout.free()
    if run.scaler:
        run.scaler.comm.Free()
    # The ranks leave together, the others having waited asleep for the lead worker's
    # evaluation and files: waiting by polling inside MPI (in the next strategy's first
    # collective) took the lead's core on a shared CPU, a third of the CPU time of a 4-rank
    # run of 7 strategies on 2 cores.
    barrier(job.ctl, job.dog.timeout_s if job.dog is not None else env.timeout_s(),
            f"the end of --dp {dp}'s run")
    return row


def train_all(cfg: TrainConfig, world, watchdog: bool = True) -> list[dict] | None:
    """Check every strategy, then train each of --dp in turn; the summary rows, in --dp
    order, on rank 0 (None elsewhere).  The driver of the examples."""
    return run_job(cfg, world, watchdog)[0]


def run_job(cfg: TrainConfig, world, watchdog: bool = True) -> tuple[list[dict] | None, Job]:
    """train_all's rows, and the Job they ran in (after an in-job recovery: the survivors'):
    the driver of python -m psrt.train."""
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
        row = train_one(cfg, dp, job, dataset, Tracer() if cfg.trace else OFF)
        if row is not None:
            mine[dp] = row
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
        return None, job
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
    return rows, job


def set_threads(world) -> None:
    """One rank per core share: N ranks on a host must not each start a thread per core."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world.local_size))
