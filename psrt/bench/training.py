"""Training benchmark: step time and samples/s of every data-parallel strategy on one model,
measured in one MPI job so the ratios are taken under the same conditions.

Every strategy trains its own copy of the same model (same seed) on the same batches.
Rounds are interleaved (ps, ring, ..., ps, ring, ...), as the collective benchmark does, so a
change of machine load hits all strategies alike.  A step's time is the slowest rank's (the
step is over when the last rank is), the median over rounds is reported, and the batch per
rank is fixed (weak scaling, as in Horovod's and PyTorch DDP's papers), so samples/s at N
ranks divided by N x samples/s of one process is the scaling efficiency.

`torch-ddp` is PyTorch's own torch.nn.parallel.DistributedDataParallel (gloo on CPU, its
default 25 MiB buckets): the peer psrt's ring DDP is measured against.  `torch` is psrt's
bucketed DDP reducing through torch.distributed.
"""
from __future__ import annotations

import contextlib
import sys
import time

import torch

from psrt.bench import timing
from psrt.bench.goal import Goal
from psrt.dp.base import DataParallel, StepStats
from psrt.dp.common import flatten
from psrt.trace import Tracer

DEFAULT_STRATEGIES = ("ps", "ps-sharded", "ring", "native", "torch", "torch-ddp", "horovod")
PEER = "torch-ddp"


class TorchDDPPeer(DataParallel):
    """torch.nn.parallel.DistributedDataParallel behind psrt's step contract (bench only)."""

    name = PEER
    composes = False               # its protocol owns the whole step (psrt.dp.base)

    def __init__(self, model, make_optimizer, group, **options):
        super().__init__(model, make_optimizer, group, **options)
        from torch.nn.parallel import DistributedDataParallel

        from psrt.dp.common import join_torch
        join_torch(group, model)
        self.ddp = DistributedDataParallel(model)
        self.optimizer = make_optimizer(model.parameters())

    def step(self, loss_fn, microbatches: list) -> StepStats:
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        n = len(microbatches)
        total, trace = 0.0, self.tracer
        for k, mb in enumerate(microbatches):
            # Only the last micro-batch's backward all-reduces (DDP's no_sync for the rest).
            with self.ddp.no_sync() if k < n - 1 else contextlib.nullcontext():
                with trace.span("forward", "compute", microbatch=k):
                    loss = loss_fn(mb)
                # gloo's all-reduces run inside, on torch's threads: this span holds them
                with trace.span("backward", "compute", microbatch=k):
                    (loss / n).backward()
            total += loss.item()
        with trace.span("optimizer", "compute"):
            self.optimizer.step()
        return StepStats(loss=total / n, compute_s=time.perf_counter() - start)


TRACED = "+trace"      # the same strategy, recording a timeline (bench training --trace)


def make_strategy(name: str, model, make_optimizer, group, bucket_mb: float | None = None):
    if name == PEER:
        return TorchDDPPeer(model, make_optimizer, group)
    from psrt.dp import strategy_class
    from psrt.dp.base import option_names
    cls = strategy_class(name)
    # --bucket-mb is for the bucketed strategies; the others would refuse it
    options = {"bucket_mb": bucket_mb} if bucket_mb is not None and "bucket_mb" in option_names(cls) else {}
    return cls(model, make_optimizer, group, **options)


def available(names: list[str]) -> list[str]:
    """`names` without horovod where it is not installed (said by the caller)."""
    from psrt.dp.horovod import import_horovod
    from psrt.errors import PsrtError
    if "horovod" in names:
        try:
            import_horovod()
        except PsrtError:
            return [n for n in names if n != "horovod"]
    return names


def measure(world, names: list[str], model_name: str = "mlp", width: int = 1024, layers: int = 2,
            per_rank_batch: int = 32, steps: int = 5, rounds: int = 3, warmup: int = 2,
            bucket_mb: float | None = None, progress=None, trace: str | None = None,
            device: torch.device = torch.device("cpu")) -> list[dict]:
    """One row per strategy, the same on every rank: step time (slowest and fastest rank),
    samples/s, the ratio to torch DDP, and how far its parameters ended from the first
    strategy's (max_param_diff).  A name ending in TRACED is that strategy recording a
    psrt.trace timeline, which `trace` names the file of.  On a CUDA `device` the models and
    batches are there and a step ends when the GPU is done."""
    from psrt.train.data import load
    dataset = load("synthetic" if model_name != "transformer" else "text")
    ctl = world.comm.Dup()
    # Each rank its own samples: a strategy that failed to average would drift apart.
    g = torch.Generator().manual_seed(1 + world.rank)
    idx = torch.randint(len(dataset), (steps, per_rank_batch), generator=g)
    data = [[(dataset.train_x[i].to(device), dataset.train_y[i].to(device))] for i in idx]
    build = Build(world, dataset, model_name, width, layers, bucket_mb, device)
    times, params = {}, {}
    tick = timing.ticker(progress)
    for phase in phases(names):
        strategies = build.phase(phase)
        calls = {name: timing.cycling(data, build.stepper(s)) for name, s in strategies.items()}
        # warm-up: buffers, buckets, threads; then interleaved rounds of `steps` steps
        times.update(timing.interleaved(ctl, calls, rounds, warmup, per_round=steps, on_round=tick))
        params.update(build.finish(strategies, ctl, trace))
    ctl.Free()
    return rows_of(world, names, times, params, per_rank_batch)


def phases(names: list[str]) -> list[list[str]]:
    """The strategies by runtime.  Horovod's background thread talks MPI every cycle even when
    idle, and gloo keeps threads of its own: each would tax the strategies measured beside it
    (an MPI ring DDP step on two emulated hosts went from 24 ms to 75 ms with gloo started in
    the same processes), so the MPI strategies run first, then the torch.distributed ones
    (gloo started only then), then Horovod."""
    on_gloo = ("torch", PEER)
    split = [[n for n in names if n not in on_gloo + ("horovod",)], [n for n in names if n in on_gloo],
             [n for n in names if n == "horovod"]]
    return [p for p in split if p]


class Build:
    """Makes each phase's strategies on their own copy of the same model, and ends them."""

    def __init__(self, world, dataset, model_name: str, width: int, layers: int, bucket_mb: float | None,
                 device: torch.device = torch.device("cpu")):
        self.world, self.dataset, self.bucket_mb, self.device = world, dataset, bucket_mb, device
        self.model_args = (model_name, dataset, width, layers)
        self.groups: list = []

    def phase(self, names: list[str]) -> dict:
        import psrt
        from psrt.train.models import build_model
        if names[0] in ("torch", PEER):
            psrt.init_torch_distributed(self.world)
        strategies = {}
        for name in names:
            base = name.removesuffix(TRACED)
            group = psrt.Communicator(self.world.comm, algorithm="auto", tracer=Tracer() if base != name else None)
            self.groups.append(group)
            torch.manual_seed(0)
            model = build_model(*self.model_args).to(self.device)
            strategies[name] = make_strategy(base, model, lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
                                             group, self.bucket_mb)
        return strategies

    def stepper(self, s):
        """One traced training step of strategy `s` on a batch."""
        from psrt.train.models import loss_and_correct
        forward = getattr(s, "ddp", s.model)        # torch's DDP must see the forward pass through its wrapper
        task = self.dataset.task

        cuda = self.device.type == "cuda"

        def step(batch):
            with s.tracer.span("step", "step"):
                s.step(lambda mb: loss_and_correct(forward, mb, task)[0], batch)
                if cuda:
                    torch.cuda.synchronize(self.device)
        return step

    def finish(self, strategies: dict, ctl, trace: str | None) -> dict:
        """{name: its parameters, flat}; the phase's groups closed, timelines written."""
        params = {}
        for name, s in strategies.items():
            s.finish()
            params[name] = flatten(list(s.model.parameters()))
        for group in self.groups:
            if group.tracer.on and trace:
                group.tracer.write(ctl, trace, self.world.hostname)
            group.close()
        self.groups = []
        if "horovod" in strategies:
            strategies["horovod"].hvd.shutdown()
        return params


def rows_of(world, names: list[str], times: dict, params: dict, per_rank_batch: int) -> list[dict]:
    nparams = params[names[0]].numel()
    workers = world.size   # no dedicated servers here: every rank trains (ps serves from rank 0)
    batch = per_rank_batch * workers
    rows = []
    for name in names:
        t = times[name].median
        # Same start, same samples, same number of steps: every strategy must end where the
        # first one does, on every rank (float32 sums in different orders: not bitwise).
        diff = max(world.comm.allgather(float((params[name] - params[names[0]]).abs().max())))
        rows.append({"dp": name, "ranks": world.size, "hosts": world.num_nodes, "workers": workers,
                     "params": nparams, "global_batch": batch, "step_s": t,
                     "step_min_s": times[name].fastest_median, "samples_per_s": batch / t,
                     "max_param_diff": diff})
    peer = next((r["step_s"] for r in rows if r["dp"] == PEER), None)
    for row in rows:
        row["vs_torch_ddp"] = peer / row["step_s"] if peer else None   # > 1: faster than torch DDP
    return rows


COLUMNS = [("dp", "strategy", ""), ("ranks", "ranks", "d"), ("hosts", "hosts", "d"),
           ("step_s", "step (ms)", ".1f", 1e3), ("step_min_s", "fastest rank (ms)", ".1f", 1e3),
           ("samples_per_s", "samples/s", ".0f"), ("efficiency", "scaling eff.", ".0%"),
           ("vs_torch_ddp", "x torch DDP", ".2f"), ("max_param_diff", "param diff", ".1e")]


def scaling(rows: list[dict], single: dict) -> None:
    """Add scaling efficiency: samples/s at N over N x one process's (weak scaling)."""
    for row in rows:
        row["efficiency"] = row["samples_per_s"] / (row["workers"] * single["samples_per_s"]) \
            if single else None


HELP = "step time and samples/s of every --dp strategy on one model (run under mpirun)"


def add_arguments(tr) -> None:
    tr.add_argument("--dp", default=None, help="strategies (default: ps,ps-sharded,ring,native,torch,"
                    "torch-ddp,horovod); torch-ddp is torch.nn.parallel.DistributedDataParallel")
    tr.add_argument("--model", default="mlp", choices=["mlp", "cnn", "transformer"])
    tr.add_argument("--width", type=int, default=1024)
    tr.add_argument("--layers", type=int, default=2)
    tr.add_argument("--batch", type=int, default=32, help="samples per rank per step (weak scaling)")
    tr.add_argument("--steps", type=int, default=5, help="steps per timed round")
    tr.add_argument("--bucket-mb", type=float, default=None,
                    help="gradient bucket size of psrt's DDP strategies (default: theirs)")
    tr.add_argument("--rounds", type=int, default=3)
    tr.add_argument("--trace", metavar="FILE", help="also time the ring with psrt.trace recording (row "
                    "ring+trace, the overhead) and write its Chrome-trace timeline to FILE")
    from psrt.dp import device
    device.add_argument(tr, "where the models and batches live")
    tr.add_argument("--json")
    tr.add_argument("--quiet", action="store_true")


def check(args) -> None:
    from psrt.bench.report import need
    from psrt.dp import STRATEGIES
    bad = [d for d in (args.dp or "").split(",") if d and d not in tuple(STRATEGIES) + (PEER,)]
    need(not bad, f"--dp {','.join(bad)}: choose from {', '.join(tuple(STRATEGIES) + (PEER,))}")
    for name in ("width", "layers", "batch", "steps", "rounds"):
        need(getattr(args, name) >= 1, f"--{name} {getattr(args, name)}: must be at least 1")


def command(args) -> int:
    """Step time of every strategy on one model, in one job (run under mpirun)."""
    check(args)
    import psrt
    from psrt.train.report import Progress
    from psrt.world import mpi_yields_when_idle

    world = psrt.init()
    asked = args.dp.split(",") if args.dp else list(DEFAULT_STRATEGIES)
    names = available(asked)
    if args.trace:      # the traced twin right after the ring, in the same phase
        names.insert(names.index("ring") + 1 if "ring" in names else len(names), "ring" + TRACED)
    if world.rank == 0 and len(names) < len(asked) and not args.quiet:
        print("psrt.bench: horovod is not installed, left out (scripts/install_horovod.sh)", file=sys.stderr)
    progress = Progress(len(names) * (args.rounds + 1), f"training np={world.size}",
                        enabled=world.rank == 0 and not args.quiet, unit="rounds")
    from psrt.dp.device import pick
    device = pick(args.device, world.local_rank)
    rows = measure(world, names, args.model, args.width, args.layers, args.batch, args.steps, args.rounds,
                   bucket_mb=args.bucket_mb, progress=progress, trace=args.trace, device=device)
    # whether each rank's MPI yielded, read back from the library: shows what a PSRT_YIELD did
    yield_when_idle = world.comm.gather(mpi_yields_when_idle(), root=0)
    if world.rank != 0:
        return 0
    if not args.quiet:
        print_rows(rows, args, world)
    if args.json:
        from psrt.bench import report
        report.write_json(args.json, {"meta": {"world_size": world.size, "num_nodes": world.num_nodes,
                                               "model": args.model, "width": args.width, "layers": args.layers,
                                               "batch_per_rank": args.batch, "mpi": report.mpi_version(),
                                               "device": str(device),
                                               "yield_when_idle": yield_when_idle},
                                      "rows": rows})
    return 0


def print_rows(rows: list[dict], args, world) -> None:
    from psrt.bench import goal, report
    print(f"# {args.model} ({rows[0]['params'] / 1e6:.2f} M parameters), {args.batch} samples per "
          f"rank, N={world.size} on {world.num_nodes} host(s); step = median of {args.rounds} rounds "
          f"of {args.steps} steps, slowest rank" + (f"; timeline in {args.trace}" if args.trace else ""))
    report.table(rows, COLUMNS)
    goal.print_goals(goals(rows))


TRACE_GOAL = 1.05       # the ring DDP step with psrt.trace recording, over the step without


def goals(rows: list[dict]) -> list[Goal]:
    """Per placement (a row's "where", if it has one) and world size: psrt's ring DDP step
    against torch DDP's, and the ring's step with a timeline recorded against without."""
    out = []
    for where in dict.fromkeys(r.get("where") for r in rows):
        for n in sorted({r["ranks"] for r in rows if r.get("where") == where and r["ranks"] > 1}):
            at = {r["dp"]: r["step_s"] for r in rows if r.get("where") == where and r["ranks"] == n}
            head = f"{where}, N={n}" if where else f"N={n}"
            if "ring" in at and PEER in at:
                out.append(Goal(f"{head}: ring DDP step <= torch DDP (gloo) step", "ring", PEER, ">=", 1.0,
                                at[PEER] / at["ring"]))
            if "ring" in at and "ring" + TRACED in at:
                out.append(Goal(f"{head}: ring DDP step with psrt.trace recording < {TRACE_GOAL:.2f}x the "
                                "step without", "ring" + TRACED, "ring", "<", TRACE_GOAL,
                                at["ring" + TRACED] / at["ring"], digits=3))
    return out
