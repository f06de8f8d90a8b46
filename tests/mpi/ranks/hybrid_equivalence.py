"""Rank side of tests/mpi/test_hybrid.py: DP x PP x TP training against one process.

On 8 ranks as dp=2 x pp=2 x tp=2, two configurations train the transformer LM for a few
steps: (1F1B, ring all-reduce over dp, 3 micro-batches) and (interleaved 1F1B with 2
virtual stages, parameter-server all-reduce over dp, 2 micro-batches).  Each rank also
trains the dense model whole, in this process, and compares: the loss of every step, each
of its own parameter shards after the last step, and (on rank 0) the whole model assembled
from all shards.  It also reports its grid coordinates and the members of its sub-
communicators.  Prints one PSRT-RESULT line per rank and configuration.
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F

import psrt
from psrt.grid import Grid
from psrt.train.hybrid import HybridConfig, dense_model, run
from psrt.tp.model import take

RTOL, ATOL = 1e-5, 4e-5


def batches(cfg, steps, batch):
    gen = torch.Generator().manual_seed(1234)
    for _ in range(steps):
        seq = torch.randint(0, cfg.vocab, (batch, cfg.seq_len + 1), generator=gen)
        yield seq[:, :-1], seq[:, 1:]


class SGD:
    """SGD with momentum, torch.optim.SGD's update rule (dampening 0, no Nesterov).  Used on
    both sides instead of torch.optim, whose first use imports torch._dynamo: seconds of
    CPU per rank on a small shared machine."""

    def __init__(self, params, lr, momentum):
        self.params, self.lr, self.momentum = list(params), lr, momentum
        self.buf = [None] * len(self.params)

    @torch.no_grad()
    def step(self):
        for i, p in enumerate(self.params):
            b = self.buf[i]
            self.buf[i] = b = p.grad.clone() if b is None else b.mul_(self.momentum).add_(p.grad)
            p.add_(b, alpha=-self.lr)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def reference(cfg, steps, batch):
    model = dense_model(cfg)
    opt = SGD(model.parameters(), cfg.lr, cfg.momentum)
    losses = []
    for x, y in batches(cfg, steps, batch):
        opt.zero_grad()
        loss = F.cross_entropy(model(x).reshape(-1, cfg.vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def close(a, b):
    return a.shape == b.shape and torch.allclose(a, b, rtol=RTOL, atol=ATOL)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    args = ap.parse_args()
    world = psrt.init()
    grid = Grid(args.dp, args.pp, args.tp, world.comm)
    layout = {"coords": grid.coords,
              "tp_members": grid.tp_comm.allgather(grid.rank),
              "dp_members": grid.dp_comm.allgather(grid.rank),
              "pp_members": grid.pp_comm.allgather(grid.rank),
              "pp_prev": grid.pp_prev, "pp_next": grid.pp_next}
    configs = [("1f1b", 1, "ring", 3, 9), ("interleaved", 2, "ps", 2, 8)]
    steps = 3
    for sched, v, algo, m, batch in configs:
        cfg = HybridConfig(vocab=24, dim=16, layers=2, heads=4, seq_len=8, schedule=sched,
                           virtual_stages=v, microbatches=m, dp_algorithm=algo, lr=0.5,
                           momentum=0.9, seed=7)
        trainer, history = run(grid, cfg, batches(cfg, steps, batch),
                               make_optimizer=lambda ps, c=cfg: SGD(ps, c.lr, c.momentum))
        ref, ref_losses = reference(cfg, steps, batch)
        errors = []
        for i, (st, want) in enumerate(zip(history, ref_losses)):
            if abs(st.loss - want) > ATOL + RTOL * abs(want):
                errors.append(f"step {i} loss {st.loss} != {want}")
            if not 0 <= st.extra["dp_comm_s"] <= st.extra["step_s"] + st.comm_s:
                # examples/hybrid.py prints it: a time, so never negative
                errors.append(f"step {i}: dp all-reduce {st.extra['dp_comm_s']:.4f} s")
        dense = dict(ref.named_parameters())
        for name, p in trainer.named_parameters():
            spec = trainer.specs[name]
            if not close(p.detach(), take(spec, dense[spec[0]])):
                errors.append(f"{name} differs from the single-process model")
        full = trainer.dense_state_dict()
        if full is not None:
            if sorted(full) != sorted(dense):
                errors.append(f"assembled state has {len(full)} tensors, the model {len(dense)}")
            errors += [f"assembled {k} differs" for k in dense
                       if k in full and not close(full[k], dense[k].detach())]
        rec = {"rank": world.rank, "cpu_s": time.process_time(), "schedule": sched,
               "algorithm": algo, "errors": errors,
               "checked": len(trainer.named_parameters()), "losses": [s.loss for s in history],
               "ref_losses": ref_losses, **layout}
        print("PSRT-RESULT " + json.dumps(rec), flush=True)
    grid.free()


if __name__ == "__main__":
    main()
