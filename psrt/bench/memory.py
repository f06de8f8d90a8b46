"""`python -m psrt.bench memory` (under mpirun): ZeRO's memory table, measured, and the step of
psrt's zero3 against PyTorch's FSDP2.

One transformer of a few hundred MB (fp32, Adam) trained a few steps by each strategy on the
same data: DDP (psrt's ring; what one device holds too), zero1, zero2, zero3, and PyTorch's
fully_shard (FSDP2, on gloo, each block, the embedding and the head wrapped as zero3 wraps
them).  For each: the model-state bytes the busiest rank holds after its last step
(psrt.dp.memory: storages counted once), ZeRO's formula (Rajbhandari et al., SC 2020), the
ratio to one device, and the median step time of the slowest rank, zero3's against FSDP2's.
"""
from __future__ import annotations

HELP = "ZeRO memory table (one device, zero1/2/3, FSDP2), measured vs formula; zero3 vs FSDP2 step"

STRATEGIES = ("ring", "zero1", "zero2", "zero3")


def add_arguments(p) -> None:
    p.add_argument("--width", type=int, default=768, help="model dimension (default 768)")
    p.add_argument("--layers", type=int, default=8, help="transformer blocks (default 8: 57M parameters)")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=3, help="steps per strategy (the first is not timed)")
    p.add_argument("--json", help="write the rows as JSON")
    p.add_argument("--quiet", action="store_true")


def _model(args, seed: int = 0):
    import torch
    from psrt.train.models import TransformerLM
    torch.manual_seed(seed)
    return TransformerLM(vocab=256, dim=args.width, layers=args.layers, heads=8, max_len=args.seq_len)


def _batches(args, world):
    import torch
    g = torch.Generator().manual_seed(1 + world.rank)
    return [torch.randint(0, 256, (args.batch, args.seq_len + 1), generator=g) for _ in range(args.steps)]


def _loss_fn(model):
    import torch.nn.functional as F

    def loss(batch):
        return F.cross_entropy(model(batch[:, :-1]).reshape(-1, 256), batch[:, 1:].reshape(-1))
    return loss


def _timed(world, step, batches: list) -> float:
    """Median over the steps after the first of the slowest rank's time."""
    from psrt.bench import timing
    return timing.timed(world.comm, timing.cycling(batches, step), len(batches) - 1, warmup=1).median


def run_psrt(args, world, name: str) -> dict:
    import torch
    import psrt
    from psrt.dp import memory, strategy_class
    model = _model(args)
    group = psrt.Communicator(world.comm)
    strategy = strategy_class(name)(model, lambda ps: torch.optim.Adam(ps, lr=1e-4), group)
    loss = _loss_fn(model)
    step_s = _timed(world, lambda b: strategy.step(loss, [b]), _batches(args, world))
    held = memory.held(strategy)
    strategy.finish()
    group.close()
    return {"strategy": name, "step_s": step_s, **held}


def run_fsdp2(args, world) -> dict:
    import warnings

    import torch
    from torch.distributed.fsdp import fully_shard
    from psrt.dp import memory
    from psrt.dp.zero3 import wrap_units
    # The head's logits are a view; the loss reads them without an in-place op.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    model = _model(args)
    for unit in wrap_units(model):
        fully_shard(unit)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    loss = _loss_fn(model)

    def step(batch):
        loss(batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)      # keep the sharded gradients, as zero3 does
    step_s = _timed(world, step, _batches(args, world))
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    params = list(model.parameters())
    held = {"params": sum(memory.storages([local(p) for p in params]).values()),
            "grads": sum(memory.storages([local(p.grad) for p in params if p.grad is not None]).values()),
            "optimizer": sum(memory.storages([local(t) for t in memory.optimizer_tensors(opt)]).values()),
            "buffers": 0}
    return {"strategy": "fsdp2 (PyTorch)", "step_s": step_s, **held}


def command(args) -> int:
    import torch
    import psrt
    from psrt.bench import report
    from psrt.dp import memory
    from psrt.train.report import fmt_bytes
    world = psrt.init()
    psrt.init_torch_distributed(world)
    torch.set_num_threads(1)
    n = world.size
    phi = sum(p.numel() for p in _model(args).parameters())
    rows = []
    for name in STRATEGIES + ("fsdp2",):
        if world.rank == 0 and not args.quiet:
            print(f"# {name} ...", flush=True)
        row = run_fsdp2(args, world) if name == "fsdp2" else run_psrt(args, world, name)
        for part in memory.PARTS + ("buffers",):
            row[part] = max(world.comm.allgather(row[part]))
        rows.append(row)
    if world.rank != 0:
        return 0
    one_device = 16 * phi
    for r in rows:
        r["states"] = sum(r[p] for p in memory.PARTS)
        formula = memory.formula(r["strategy"] if r["strategy"] in STRATEGIES else "zero3", phi, n, 8)
        r["formula"] = sum(formula.values())
        r["vs_one_device"] = r["states"] / one_device
    fsdp = rows[-1]["step_s"]
    for r in rows:
        r["vs_fsdp2"] = r["step_s"] / fsdp
    rows[0]["strategy"] = "ring (DDP = one device)"
    if not args.quiet:
        print(f"# ZeRO's table, measured: a {phi / 1e6:.0f}M-parameter transformer ({fmt_bytes(4 * phi)} of fp32 "
              f"parameters), Adam, N = {n}; model states on the busiest rank after its last step, formula "
              f"16 Phi / 8 Phi + 8 Phi/N / 4 Phi + 12 Phi/N / 16 Phi/N (Rajbhandari et al., SC 2020); step = median "
              f"of the slowest rank over {args.steps - 1} steps of {args.batch} x {args.seq_len} tokens per rank")
        report.table(rows, [("strategy", "strategy", ""), ("params", "params", "bytes"), ("grads", "grads", "bytes"),
                            ("optimizer", "optimizer", "bytes"), ("states", "model states", "bytes"),
                            ("formula", "formula", "bytes"), ("vs_one_device", "x one device", ".2f"),
                            ("step_s", "step (s)", ".2f"), ("vs_fsdp2", "x fsdp2 step", ".2f")])
    if args.json:
        report.write_json(args.json, {"meta": {"world_size": n, "params": phi, "width": args.width,
                                               "layers": args.layers}, "rows": rows})
    return 0
