"""Rank-side: the MoE transformer on a DP x PP x TP grid with expert parallelism ends with the
parameters, losses, dropped counts and balance loss of one process holding every expert.

usage: mpirun -np 4 python moe_hybrid_equivalence.py   (or -np 8)

Grids on 4 ranks: pp 2 x dp 2 with ep 2 and with ep 1, tp 2 x dp 2 with ep 2 and with ep 1,
dp 4 with ep 2, pp 2 x tp 2; on 8 ranks: pp 2 x dp 4 with ep 2 and with ep 4.  Where ep < dp
the expert-data-parallel group has several ranks, so the expert gradients are summed over it.
2 micro-batches per data-parallel rank.  The one-process reference runs micro-batch i of
every data-parallel rank as one batch (ranks in order), routed with token_groups = dp so that
each rank's tokens get the places and drops they get in the parallel run, and backpropagates
(loss_i + balance loss_i) / 2; its balance loss is written out again from the gates' logits
over the whole micro-batch (moe_reference.py).  Cases: top-1 with room for every token (with
--recompute and fp16's loss scaling under the pipeline), top-2 with a capacity that drops
tokens, padded dispatch.  Every rank checks its own shards (experts by their global index)
and each step's dropped count and balance loss (every layer, every rank's tokens); grid rank
0 also checks the assembled state dict.  One PSRT-RESULT line per rank.
"""
import json

import torch
import torch.nn.functional as F

import psrt
from psrt.dp.precision import LossScaler, scaled_factory
from psrt.ep.layer import aux_loss, moe_layers
from psrt.grid import Grid
from psrt.tp.model import take
from psrt.train.data import load
from psrt.train.hybrid import HybridConfig, HybridTrainer
from psrt.train.models import build_model
from moe_reference import balance_loss, record_gates

world = psrt.init()
r = world.rank
data = load("text", seq_len=16)
MB, PER, STEPS, LR = 2, 2, 3, 0.5
g = torch.Generator().manual_seed(7)


def make(opts, layers, recompute=False):
    torch.manual_seed(3)
    return build_model("moe", data, width=32, layers=layers, recompute=recompute, **opts)


def reference(opts, layers, dp, batches):
    model = make(opts, layers)
    gate_logits = record_gates(model)
    for layer in moe_layers(model):
        layer.token_groups = dp
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, drops, balance = [], [], []
    for idx in batches:
        opt.zero_grad()
        gate_logits.clear()
        total, dropped = 0.0, 0.0
        per_rank = idx.view(dp, MB, PER)               # rank d's micro-batch i = per_rank[d, i]
        for i in range(MB):
            rows = per_rank[:, i].reshape(-1)
            logits = model(data.train_x[rows])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), data.train_y[rows].reshape(-1))
            ((loss + aux_loss(model)) / MB).backward()
            total += float(loss.detach()) / MB
            dropped += sum(float(m.stats["dropped"].sum()) for m in moe_layers(model))
        opt.step()
        losses.append(total)
        drops.append(dropped)
        balance.append(balance_loss(moe_layers(model)[0].aux_alpha, gate_logits) / MB)
    return model, losses, drops, balance


failures, checked = [], 0
TOP1 = {"experts": 4, "top_k": 1, "capacity_factor": 8.0}
DROPS = {"experts": 4, "top_k": 2, "capacity_factor": 0.5}
PADDED = {"experts": 4, "top_k": 2, "capacity_factor": 0.5, "dispatch": "padded"}
if world.size == 8:
    CASES = [({"pp": 2, "ep": 2}, DROPS, False),                  # edp 2 inside each stage
             ({"pp": 2, "ep": 4, "scaled": True}, TOP1, True)]    # EP 4 on a pipeline
else:
    CASES = [({"pp": 2, "ep": 2, "scaled": True}, TOP1, True),
             ({"pp": 2, "ep": 2}, DROPS, False),
             ({"pp": 2, "ep": 1}, DROPS, False),                  # edp 2: experts replicated over dp
             ({"tp": 2, "ep": 2}, PADDED, False),
             ({"tp": 2, "ep": 1}, PADDED, True),
             ({"ep": 2}, DROPS, False),                           # dp 4: ep 2 x edp 2
             ({"pp": 2, "tp": 2}, TOP1, False)]
for axes, opts, recompute in CASES:
    grid = Grid.build(world.comm, pp=axes.get("pp", 1), tp=axes.get("tp", 1), ep=axes.get("ep", 1))
    layers = 2
    B = grid.dp * MB * PER
    batches = [torch.randint(len(data), (B,), generator=g) for _ in range(STEPS)]
    ref, ref_losses, ref_drops, ref_balance = reference(opts, layers, grid.dp, batches)
    dense = make(opts, layers, recompute)
    cfg = HybridConfig.for_model(dense, schedule="1f1b", microbatches=MB, dp_algorithm="ring")
    # fp16's loss scaling without autocast: exact, if the balance loss is scaled alike
    scaler = LossScaler(None) if axes.get("scaled") else None
    sgd = lambda p: torch.optim.SGD(p, lr=LR)      # noqa: E731
    trainer = HybridTrainer(grid, cfg, dense=dense, make_optimizer=scaled_factory(sgd, scaler) if scaler else sgd,
                            scaler=scaler)
    steps = [trainer.step(data.train_x[idx], data.train_y[idx]) for idx in batches]
    losses = [s.loss for s in steps]
    drops = [float(s.extra["moe"]["dropped"].sum()) for s in steps]
    balance = [s.extra["moe"]["aux_loss"] for s in steps]
    name = f"{axes} {opts} recompute={recompute}"
    want = dict(ref.named_parameters())
    for pname, p in trainer.named_parameters():
        spec = trainer.specs[pname]
        checked += 1
        expected = take(spec, want[spec[0]])
        if not torch.allclose(p, expected, rtol=1e-4, atol=1e-5):
            failures.append(f"{name}: {pname} ({spec[0]}) differs by {float((p - expected).abs().max()):.2e}")
    if max(abs(a - b) for a, b in zip(losses, ref_losses)) > 1e-5:
        failures.append(f"{name}: losses {losses}, one process {ref_losses}")
    if drops != ref_drops:
        failures.append(f"{name}: dropped {drops}, one process {ref_drops}")
    if max(abs(a - b) for a, b in zip(balance, ref_balance)) > 1e-7:
        failures.append(f"{name}: balance loss {balance}, global-batch value {ref_balance}")
    if opts["capacity_factor"] < 1 and not any(ref_drops):
        failures.append(f"{name}: the small capacity dropped nothing")
    state = trainer.dense_state_dict()
    if state is not None:
        missing = set(want) ^ set(state)
        if missing:
            failures.append(f"{name}: the assembled state dict differs in names {sorted(missing)[:4]}")
        for k in set(want) & set(state):
            checked += 1
            if not torch.allclose(state[k], want[k], rtol=1e-4, atol=1e-5):
                failures.append(f"{name}: assembled {k} differs")
    grid.free()
print("PSRT-RESULT " + json.dumps({"rank": r, "failures": failures, "checked": checked}), flush=True)
