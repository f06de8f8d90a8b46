"""Rank-side: the MoE transformer with experts spread over EP ranks ends with the parameters
of one process holding every expert and training on the whole batch.

usage: mpirun -np N python moe_equivalence.py   (N = 4: EP = 1, 2 and 4 inside DP = 4)

The one-process reference is computed on every rank without communication: the same seed,
the global batch (the ranks' slices in rank order), routing with token_groups = N so that each
rank's tokens get the same expert places and drops as in the parallel run.  Cases: top-1 and
top-2, variable and padded dispatch, a capacity with room for every token and one that drops,
--recompute (whose first forward records no graph for the balance loss), and fp16's loss
scaling (the balance loss scaled alike).  The run's balance loss is also checked against
alpha E sum f_i P_i computed from the reference's gate logits over the whole batch.
Prints one PSRT-RESULT line per rank.
"""
import json

import torch
import torch.nn.functional as F

import psrt
from psrt.dp.precision import LossScaler, scaled_factory
from psrt.ep.layer import aux_loss, moe_layers
from psrt.train.moe import MoETrainer
from psrt.grid import Grid
from psrt.train.data import load
from psrt.train.models import build_model
from moe_reference import balance_loss, record_gates

world = psrt.init()
N, r = world.size, world.rank
data = load("text", seq_len=16)
B, STEPS = 4 * N, 3
g = torch.Generator().manual_seed(5)
batches = [torch.randint(len(data), (B,), generator=g) for _ in range(STEPS)]


def make(opts, recompute=False):
    torch.manual_seed(11)
    return build_model("moe", data, width=32, layers=2, recompute=recompute, **opts)


def loss_of(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def reference(opts):
    model = make(opts)
    layers = moe_layers(model)
    gate_logits = record_gates(model)
    for layer in layers:
        layer.token_groups = N
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    drops, losses, balance = [], [], []
    for idx in batches:
        opt.zero_grad()
        gate_logits.clear()
        loss = loss_of(model, data.train_x[idx], data.train_y[idx])
        (loss + aux_loss(model)).backward()
        opt.step()
        losses.append(float(loss))
        drops.append(sum(float(m.stats["dropped"].sum()) for m in layers))
        balance.append(balance_loss(layers[0].aux_alpha, gate_logits))
    return model, drops, losses, balance


failures, checked = [], 0
for ep in (1, 2, 4):
    if N % ep:
        continue
    for opts in ({"experts": 4, "top_k": 1, "capacity_factor": 8.0},
                 {"experts": 4, "top_k": 2, "capacity_factor": 8.0, "dispatch": "padded"},
                 {"experts": 8, "top_k": 2, "capacity_factor": 0.5},          # drops tokens
                 {"experts": 4, "top_k": 1, "capacity_factor": 0.5, "dispatch": "padded"},
                 {"experts": 4, "top_k": 2, "capacity_factor": 0.5, "recompute": True},
                 {"experts": 4, "top_k": 1, "capacity_factor": 1.0, "scaled": True}):
        opts = dict(opts)
        recompute = opts.pop("recompute", False)      # the balance loss must survive it
        # fp16's loss scaling without autocast: scaling by 2^16 and back is exact, so the
        # result is one process's only if the balance loss is scaled alike
        scaler = LossScaler(None) if opts.pop("scaled", False) else None
        ref, ref_drops, ref_losses, ref_balance = reference(opts)
        grid = Grid.build(world.comm, ep=ep)
        model = make(opts, recompute)
        for layer in moe_layers(model):
            layer.shard(grid.ep_group, grid.dp_group, algorithm="pairwise" if ep == 2 else "native")
        sgd = lambda p: torch.optim.SGD(p, lr=0.5)      # noqa: E731
        trainer = MoETrainer(model, scaled_factory(sgd, scaler) if scaler else sgd, grid, algorithm="ring",
                             scaler=scaler)
        drops, losses, balance = [], [], []
        for idx in batches:
            mine = idx[r * (B // N):(r + 1) * (B // N)]
            stats = trainer.step(lambda mb: scaler(loss_of(model, *mb)) if scaler else loss_of(model, *mb),
                                 [(data.train_x[mine], data.train_y[mine])])
            drops.append(float(stats.extra["dropped"].sum()))
            losses.append(stats.loss)
            balance.append(stats.extra["aux_loss"])
        name = f"ep={ep} {opts} recompute={recompute} scaled={scaler is not None}"
        local = len(moe_layers(model)[0].experts)
        want = dict(ref.named_parameters())
        for pname, p in model.named_parameters():
            ref_name = pname
            if ".experts." in pname:           # local expert i is global expert ep_rank * local + i
                head, _, tail = pname.partition(".experts.")
                i, _, rest = tail.partition(".")
                ref_name = f"{head}.experts.{grid.ep_rank * local + int(i)}.{rest}"
            checked += 1
            if not torch.allclose(p, want[ref_name], rtol=1e-4, atol=1e-5):
                failures.append(f"{name}: {pname} differs by {float((p - want[ref_name]).abs().max()):.2e}")
        if drops != ref_drops:
            failures.append(f"{name}: dropped {drops}, one process {ref_drops}")
        if max(abs(a - b) for a, b in zip(losses, ref_losses)) > 1e-5:
            failures.append(f"{name}: losses {losses}, one process {ref_losses}")
        if max(abs(a - b) for a, b in zip(balance, ref_balance)) > 1e-7:
            failures.append(f"{name}: balance loss {balance}, global-batch value {ref_balance}")
        if opts["capacity_factor"] < 1 and not any(ref_drops):
            failures.append(f"{name}: the small capacity dropped nothing")
        grid.free()
print("PSRT-RESULT " + json.dumps({"rank": r, "failures": failures, "checked": checked}), flush=True)
