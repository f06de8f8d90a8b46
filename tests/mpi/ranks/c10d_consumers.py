"""PyTorch's own distributed code, unmodified, on one backend: DDP (comm hook,
find_unused_parameters, no_sync), FSDP2 (reshard after forward on and off), DTensor tensor
parallel on a 2-D mesh, pipelining (GPipe and 1F1B), DCP save and load, object collectives;
DDP of a model whose bucket is larger than psrt's small-message path; on psrt also both DDPs
once per psrt algorithm, each on its own group, recording which algorithm and how many
bytes each of the group's all-reduces ran with.  Rank 0 saves every loss and final
parameter, so a test can require psrt's file to equal gloo's.

usage: mpirun -np N python c10d_consumers.py {psrt|gloo} OUT [CKPT_DIR]
"""
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn

backend, out = sys.argv[1], sys.argv[2]
ckpt_dir = sys.argv[3] if len(sys.argv) > 3 else tempfile.mkdtemp()
if backend == "psrt":
    import psrt.c10d  # noqa: F401 - registers the backend, publishes the rendezvous
    dist.init_process_group("psrt")
else:
    import psrt
    psrt.init()
    dist.init_process_group("gloo")
rank, n = dist.get_rank(), dist.get_world_size()
results: dict = {}
STEPS, BATCH, DIM = 3, 8, 12


def data(step: int, rows: int = BATCH):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n * rows, DIM, generator=g), torch.randn(n * rows, 1, generator=g)


class Net(nn.Module):
    def __init__(self, unused: bool = False, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b = nn.Linear(DIM, DIM), nn.Linear(DIM, 1)
        self.unused = nn.Linear(3, 3) if unused else None

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


# A middle layer of 1100 x 1024 fp32 weights (4.3 MiB): DDP puts it, with the layers after
# it, in one bucket larger than psrt's small-message path (psrt.collectives.small.SMALL_BYTES,
# 4 MiB; 1 MiB for ps), so each algorithm's full-size code runs under DDP.
class BigNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.mid, self.b = nn.Linear(DIM, 1024), nn.Linear(1024, 1100), nn.Linear(1100, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.mid(torch.tanh(self.a(x)))))


def params(model) -> dict:
    out = {}
    for k, v in model.state_dict().items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k] = v.detach().clone()
    return out


def ddp(tag: str, group=None, hook=None, unused=False, accum=1, net=Net):
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(net(unused=True) if unused else net(), process_group=group, find_unused_parameters=unused)
    if hook is not None:
        model.register_comm_hook(group, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        x, y = data(step, BATCH * accum)
        x, y = x[rank::n], y[rank::n]
        opt.zero_grad()
        for i in range(accum):
            mb = slice(i * BATCH, (i + 1) * BATCH)
            ctx = model.no_sync() if i < accum - 1 else torch.enable_grad()
            with ctx:
                loss = nn.functional.mse_loss(model(x[mb]), y[mb]) / accum
                loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    results[tag] = {"losses": torch.stack(losses), "params": params(model.module)}


def sharded(reshard: bool, seed: int = 0):
    """Net under FSDP2 (`fully_shard` on a layer and on the root) and its Adam."""
    from torch.distributed.fsdp import fully_shard
    model = Net(seed=seed)
    fully_shard(model.a, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def fsdp(tag: str, reshard: bool):
    model, opt = sharded(reshard)
    losses = []
    for step in range(STEPS):
        x, y = data(step)
        loss = nn.functional.mse_loss(model(x[rank::n]), y[rank::n])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    results[tag] = {"losses": torch.stack(losses), "params": params(model)}
    return model, opt


def tensor_parallel():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    dp = 2 if n % 2 == 0 and n > 2 else 1
    mesh = init_device_mesh("cpu", (dp, n // dp), mesh_dim_names=("dp", "tp"))
    model = Net()
    parallelize_module(model, mesh["tp"], {"a": ColwiseParallel(), "b": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dp_rank, dp_group = mesh["dp"].get_local_rank(), mesh["dp"].get_group()
    losses = []
    for step in range(STEPS):
        x, y = data(step)
        x, y = x[dp_rank::dp], y[dp_rank::dp]
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if dp > 1:   # data parallel over the other mesh dimension, by hand
            for p in model.parameters():
                dist.all_reduce(p.grad.to_local(), op=dist.ReduceOp.AVG, group=dp_group)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    results["tp"] = {"losses": torch.stack(losses), "params": params(model)}


def pipeline(schedule_name: str):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    torch.manual_seed(0)
    layers = [nn.Linear(DIM, DIM) for _ in range(n)]
    stage_mod = layers[rank]
    stage = PipelineStage(stage_mod, rank, n, torch.device("cpu"))
    loss_fn = nn.MSELoss()
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
    schedule = cls(stage, n_microbatches=4, loss_fn=loss_fn)
    opt = torch.optim.SGD(stage_mod.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        x, _ = data(step)
        y = torch.randn(x.shape, generator=torch.Generator().manual_seed(step))
        step_losses = []
        if rank == 0:
            schedule.step(x)
        elif rank == n - 1:
            schedule.step(target=y, losses=step_losses)
        else:
            schedule.step()
        opt.step()
        opt.zero_grad()
        if rank == n - 1:
            losses.append(torch.stack(step_losses).mean())
    mine = {f"{rank}.{k}": v.detach().clone() for k, v in stage_mod.state_dict().items()}
    every = [None] * n
    dist.all_gather_object(every, mine)
    last = [None]
    if rank == n - 1:
        last = [torch.stack(losses)]
    dist.broadcast_object_list(last, src=n - 1)
    results[f"pipeline-{schedule_name}"] = {"losses": last[0], "params": {k: v for d in every for k, v in d.items()}}


def optimizer_state(model, opt) -> dict:
    """Every parameter's optimizer state (Adam's step, exp_avg, exp_avg_sq), unsharded."""
    out = {}
    for name, p in model.named_parameters():
        for k, v in opt.state[p].items():
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[f"{name}.{k}"] = v.detach().clone()
    return out


def checkpoint(model, opt):
    """DCP save of FSDP2's sharded model and optimizer, then load into a model and optimizer
    that differ from them in every parameter and every optimizer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt_dir)
    saved = {"params": params(model), "optim": optimizer_state(model, opt)}
    fresh, fresh_opt = sharded(True, seed=1)
    state = dict(zip(("model", "optim"), get_state_dict(fresh, fresh_opt)))   # Adam's state made: step 0
    before = {"params": params(fresh), "optim": optimizer_state(fresh, fresh_opt)}
    dcp.load(state, checkpoint_id=ckpt_dir)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    after = {"params": params(fresh), "optim": optimizer_state(fresh, fresh_opt)}

    def equal(a, b):
        return all(a[part].keys() == b[part].keys() and all(torch.equal(a[part][k], b[part][k]) for k in b[part])
                   for part in ("params", "optim"))
    results["dcp"] = dict(after, same=equal(after, saved),
                          differed=[part for part in ("params", "optim")
                                    if all(not torch.equal(before[part][k], saved[part][k]) for k in saved[part])])


def objects():
    gathered = [None] * n
    dist.all_gather_object(gathered, {"rank": rank, "word": "x" * (rank + 1)})
    lst = [{"from": rank}, rank * 10] if rank == 1 % n else [None, None]
    dist.broadcast_object_list(lst, src=1 % n)
    at_root = [None] * n if rank == 0 else None
    dist.gather_object(("g", rank), at_root, dst=0)
    got = [None]
    dist.scatter_object_list(got, [("s", i) for i in range(n)] if rank == 0 else None, src=0)
    every_got = [None] * n
    dist.all_gather_object(every_got, got[0])
    results["objects"] = {"all_gather": gathered, "broadcast": lst, "gather": at_root,
                          "scatter": every_got}


from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402

results["init"] = params(Net())
ddp("ddp")
ddp("ddp-hook", hook=default_hooks.fp16_compress_hook)
ddp("ddp-unused", unused=True)
ddp("ddp-no_sync", accum=2)
model, opt = fsdp("fsdp-reshard", True)
fsdp("fsdp-keep", False)
checkpoint(model, opt)
tensor_parallel()
if n > 1:
    pipeline("gpipe")
    pipeline("1f1b")
objects()
big = n <= 3          # N = 2 and 3 (no fold, a fold) suffice; N = 4 oversubscribes most
if big:
    results["init-big"] = params(BigNet())
    ddp("ddp-big", net=BigNet)
if backend == "psrt":
    from psrt.c10d import Options
    from psrt.trace import Tracer
    results["ran"] = {}
    for algorithm in ("ring", "ps", "halving-doubling", "tree", "doubling", "native"):
        group = dist.new_group(list(range(n)), pg_options=Options(algorithm=algorithm))
        group.group.tracer = Tracer()      # what the group's Communicator ran, per call
        ddp(f"ddp-{algorithm}", group=group)
        if big:
            ddp(f"ddp-big-{algorithm}", group=group, net=BigNet)
        calls = [args for name, _, _, _, _, args in group.group.tracer.events if name == "allreduce"]
        results["ran"][algorithm] = {"algorithms": sorted({a["algorithm"] for a in calls}),
                                     "max_bytes": max(a["bytes"] for a in calls), "calls": len(calls)}
if rank == 0:
    torch.save(results, out)
dist.destroy_process_group()
if backend == "gloo":
    # Gloo's worker threads can still drop tensors while the interpreter finalizes, which
    # aborts the process ("terminate called without an active exception"): the results are
    # saved, so end MPI and leave without finalizing Python.
    from mpi4py import MPI
    sys.stdout.flush()
    MPI.Finalize()
    os._exit(0)
