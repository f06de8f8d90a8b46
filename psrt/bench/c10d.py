"""PyTorch's own DDP and FSDP2, unchanged, on psrt's torch.distributed backend against the same
on gloo and against psrt's own ring DDP (`--dp ring`), in one job per world size.

    python -m psrt.bench c10d --np 2,4             # launches one job per N, prints one table
    ./mpi_launch -np 4 python -m psrt.bench c10d   # one N, under a launcher

Rows:
  ddp/psrt-ring, ddp/psrt-auto, ddp/psrt-ps   torch DDP on a psrt group of that algorithm
  ddp/gloo                                    torch DDP on gloo (the peer)
  psrt --dp ring                              psrt's own bucketed ring DDP strategy
  fsdp2/psrt-ring, fsdp2/psrt-auto, fsdp2/psrt-ps, fsdp2/gloo
                                              FSDP2 `fully_shard` per layer, on each backend
  all-reduce/psrt-auto, all-reduce/gloo       the gradients' all-reduce alone: what a DDP step
                                              adds to the compute, which it cannot hide on a
                                              machine whose cores all train

Every row trains its own copy of the same model (same seed) on the same batches, SGD.  With
`--device cuda` the models and batches are on each rank's GPU (torch.distributed moves CUDA
tensors: psrt staged through host memory or through a CUDA-aware MPI, gloo its own way), and a
step ends when the GPU is done.  Rounds
are interleaved within a phase (a change of machine load hits every row alike), step time is
the slowest rank's, the median over rounds is reported.  gloo's groups start only after the
psrt rows are measured, as in `bench training`: gloo's threads would tax MPI rows beside them.
"""
from __future__ import annotations

import sys

from psrt.bench.goal import Goal

MB = 1 << 20
PSRT_DDP = ("ring", "auto", "ps")      # the psrt algorithms DDP and FSDP2 are timed on
WAYS = (("all-reduce/psrt-auto",) + tuple(f"ddp/psrt-{a}" for a in PSRT_DDP) + ("psrt --dp ring",)
        + tuple(f"fsdp2/psrt-{a}" for a in PSRT_DDP) + ("all-reduce/gloo", "ddp/gloo", "fsdp2/gloo"))


def build_model(grad_mb: float, width: int):
    """An MLP of `grad_mb` MiB of fp32 gradients in layers of width x width."""
    import torch
    from torch import nn
    layers = max(1, round(grad_mb * MB / 4 / (width * width + width)))
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*mods)


def measure(grad_mb: float, width: int = 1024, batch: int = 32, steps: int = 3, rounds: int = 3,
            progress=None, device: str = "cpu") -> list[dict]:
    """One row per way of training, the same on every rank (run after init_process_group('psrt'))."""
    import torch

    from psrt.bench import timing
    from psrt.c10d import job_world

    from psrt.dp.device import pick
    world = job_world()
    on = pick(device, world.local_rank)
    g = torch.Generator().manual_seed(1 + world.rank)
    data = [(torch.randn(batch, width, generator=g).to(on), torch.randn(batch, width, generator=g).to(on))
            for _ in range(steps)]
    ways = Ways(world, grad_mb, width, on)
    times: dict[str, timing.Timing] = {}
    tick = timing.ticker(progress)
    for phase in (ways.psrt_phase, ways.gloo_phase):
        runners = {name: timing.cycling(data, step) for name, step in phase().items()}
        # one warm-up round of the same steps, then the timed rounds, interleaved
        times.update(timing.interleaved(world.comm, runners, rounds, warmup=len(data), per_round=len(data),
                                        on_round=tick))
    return rows_of(times, world.size, ways.params, on.type)


def rows_of(times: dict, n: int, params: int, device: str = "cpu") -> list[dict]:
    """The rows with their ratios to the same on gloo and to psrt's own ring DDP."""
    rows = [{"way": name, "ranks": n, "grad_mib": params * 4 / MB, "step_s": t.median, "device": device}
            for name, t in times.items()]
    by = {r["way"]: r["step_s"] for r in rows}
    for row in rows:
        kind = row["way"].split("/")[0] if "/" in row["way"] else "ddp"
        row["vs_gloo"] = by[f"{kind}/gloo"] / row["step_s"]       # > 1: faster than the same on gloo
        row["vs_psrt_ring"] = None if kind == "all-reduce" else by["psrt --dp ring"] / row["step_s"]
    return rows


def _loss(model, mb):
    import torch
    x, y = mb
    return torch.nn.functional.mse_loss(model(x), y)


class Ways:
    """The ways of training one model, each a step function of a batch, built per phase."""

    def __init__(self, world, grad_mb: float, width: int, device=None):
        import torch
        self.world, self.grad_mb, self.width = world, grad_mb, width
        self.device = device or torch.device("cpu")
        self.params = sum(p.numel() for p in build_model(grad_mb, width).parameters())

    def model(self):
        return build_model(self.grad_mb, self.width).to(self.device)

    def finished(self, step):
        """`step`, ending when the GPU has done its work (a CPU step ends when it returns)."""
        import torch
        if self.device.type != "cuda":
            return step

        def run(mb):
            step(mb)
            torch.cuda.synchronize(self.device)
        return run

    def torch_runner(self, wrap):
        import torch
        model = wrap(self.model())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step(mb):
            opt.zero_grad(set_to_none=True)
            _loss(model, mb).backward()
            opt.step()
        return self.finished(step)

    def fsdp(self, group):
        import torch
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        def wrap(model):
            mesh = DeviceMesh.from_group(group, self.device.type)
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            return fully_shard(model, mesh=mesh)
        return wrap

    def psrt_ring(self):
        import torch

        import psrt
        from psrt.dp import strategy_class
        group = psrt.Communicator(self.world.comm, algorithm="ring")
        dp = strategy_class("ring")(self.model(), lambda p: torch.optim.SGD(p, lr=0.01), group)
        return self.finished(lambda mb: dp.step(lambda b: _loss(dp.model, b), [mb]))

    def allreduce(self, group):
        """The gradients' all-reduce alone (the communication a DDP step adds)."""
        import torch
        import torch.distributed as dist
        buf = torch.ones(self.params, device=self.device)
        return self.finished(lambda mb: dist.all_reduce(buf, group=group))

    def psrt_phase(self) -> dict:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        from psrt.c10d import Options
        n = self.world.size
        rows = {"all-reduce/psrt-auto": self.allreduce(dist.group.WORLD)}
        groups = {a: dist.new_group(list(range(n)), pg_options=Options(algorithm=a)) for a in PSRT_DDP}
        for algorithm, group in groups.items():
            rows[f"ddp/psrt-{algorithm}"] = self.torch_runner(lambda m, g=group: DDP(m, process_group=g))
        rows["psrt --dp ring"] = self.psrt_ring()
        for algorithm, group in groups.items():
            rows[f"fsdp2/psrt-{algorithm}"] = self.torch_runner(self.fsdp(group))
        return rows

    def gloo_phase(self) -> dict:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        group = dist.new_group(list(range(self.world.size)), backend="gloo")
        return {"all-reduce/gloo": self.allreduce(group),
                "ddp/gloo": self.torch_runner(lambda m: DDP(m, process_group=group)),
                "fsdp2/gloo": self.torch_runner(self.fsdp(group))}


COLUMNS = [("way", "training", ""), ("ranks", "N", "d"), ("grad_mib", "gradients (MiB)", ".1f"),
           ("step_s", "step or call (ms)", ".1f", 1e3), ("vs_gloo", "x same on gloo", ".2f"),
           ("vs_psrt_ring", "x psrt --dp ring", ".2f")]


def goals(rows: list[dict]) -> list[Goal]:
    out = []
    for (n, mib) in sorted({(r["ranks"], r["grad_mib"]) for r in rows}):
        by = {r["way"]: r for r in rows if (r["ranks"], r["grad_mib"]) == (n, mib)}
        where = f"N={n}, {mib:.0f} MiB"
        best = max((by[f"ddp/psrt-{a}"] for a in ("ring", "auto")), key=lambda r: r["vs_gloo"])
        if best.get("device") == "cuda":    # on a GPU: at most 0.9x gloo's step
            out.append(Goal(f"{where}, CUDA: DDP on psrt at most 0.9x the step of DDP on gloo", best["way"],
                            "ddp/gloo", "<=", 0.9, 1 / best["vs_gloo"], detail=f"({best['way']})"))
            continue
        out.append(Goal(f"{where}: DDP on psrt >= 1.25x faster per step than DDP on gloo", best["way"],
                        "ddp/gloo", ">=", 1.25, best["vs_gloo"], detail=f"({best['way']})"))
        out.append(Goal(f"{where}: DDP on psrt within 1.15x of psrt --dp ring", best["way"], "psrt --dp ring",
                        "<=", 1.15, 1 / best["vs_psrt_ring"]))
        f = max((by[f"fsdp2/psrt-{a}"] for a in ("ring", "auto")), key=lambda r: r["vs_gloo"])
        out.append(Goal(f"{where}: FSDP2 on psrt no slower than on gloo", f["way"], "fsdp2/gloo", ">=", 1.0,
                        f["vs_gloo"], detail=f"({f['way']})"))
    return out


HELP = "torch DDP and FSDP2 on psrt's backend vs gloo vs psrt's own ring DDP"


def add_arguments(ap) -> None:
    ap.add_argument("--np", default=None, help="world sizes, e.g. 2,4: launch one job per size "
                    "(default: run in the current job, under a launcher)")
    ap.add_argument("--grad-mb", default="4,16", help="gradient sizes in MiB, comma list (default 4,16)")
    ap.add_argument("--width", type=int, default=1024, help="layer width (default 1024)")
    ap.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    ap.add_argument("--steps", type=int, default=3, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (median)")
    from psrt.dp import device
    device.add_argument(ap, "where the models and batches live")
    ap.add_argument("--json", metavar="FILE", help="also write the rows and goals as JSON")
    ap.add_argument("--quiet", action="store_true")


def _numbers(text: str, what: str, cast=int) -> list:
    from psrt.bench.report import need
    try:
        values = [cast(v) for v in text.split(",") if v]
    except ValueError:
        values = []
    need(bool(values) and min(values) > 0, f"--{what} {text}: expected positive numbers such as 2,4")
    return values


def report_rows(rows: list[dict], args, show: bool) -> None:
    """The table and the goals if `show`, and --json."""
    from psrt.bench import goal, report
    found = goals(rows)
    if show:
        print(f"# torch DDP / FSDP2 on psrt vs gloo on {args.device}; MLP of width {args.width}, {args.batch} samples "
              f"per rank, SGD; step = median of {args.rounds} rounds of {args.steps} steps, slowest rank")
        report.table(rows, COLUMNS)
        goal.print_goals(found)
    if args.json:
        report.write_json(args.json, {"rows": rows, "goals": goal.rows(found), "mpi": report.mpi_version()})


def check(args) -> list[float]:
    """The gradient sizes; bad values refused in one line."""
    from psrt.bench.report import need
    for name in ("width", "batch", "steps", "rounds"):
        need(getattr(args, name) >= 1, f"--{name} {getattr(args, name)}: must be at least 1")
    if args.np:
        _numbers(args.np, "np")
    return _numbers(args.grad_mb, "grad-mb", float)


def command(args) -> int:
    sizes = check(args)
    if args.np:
        report_rows(launch(args), args, show=True)   # --quiet: no progress lines
        return 0
    import torch.distributed as dist

    import psrt.c10d
    from psrt.train.report import Progress
    psrt.c10d.init_process_group()
    world = psrt.c10d.job_world()
    progress = Progress(len(sizes) * (args.rounds + 1) * len(WAYS), f"c10d np={world.size}",
                        enabled=world.rank == 0 and not args.quiet, unit="rounds")
    rows = []
    for grad_mb in sizes:
        rows += measure(grad_mb, args.width, args.batch, args.steps, args.rounds, progress, args.device)
    if world.rank == 0:
        report_rows(rows, args, show=not args.quiet)
    dist.destroy_process_group()
    return 0


def launch(args) -> list[dict]:
    """--np: one job of this command per world size; their rows."""
    from psrt.bench import jobs
    rows = []
    for np_ in _numbers(args.np, "np"):
        rank_args = ["c10d", "--grad-mb", args.grad_mb, "--width", str(args.width), "--batch",
                     str(args.batch), "--steps", str(args.steps), "--rounds", str(args.rounds),
                     "--device", args.device]
        if not args.quiet:
            print(f"psrt.bench c10d: {np_} ranks ...", file=sys.stderr, flush=True)
        rows += jobs.local(np_, rank_args + ["--quiet"], timeout_s=1200)["rows"]
    return rows
