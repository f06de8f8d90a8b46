"""Rank-side check of fp16 loss scaling's agreement: rank 1 alone finds an inf in its gradients
at one step; every rank must skip that step, halve the scale and stay equal to one process
that skipped it too.

    mpirun -np N python loss_scale.py

ring sees the same reduced gradients everywhere; zero2 and zero3 check only their own shard,
so without the agreement rank 0 would update while rank 1 skipped.  The scale starts at 2^10
and grows after 3 good steps (GradScaler's rules with a shorter interval), so 5 steps with the
inf at the second give scales 1024, 512, 512, 512, 1024.  Every rank prints one
`PSRT-RESULT {json}` per strategy.
"""
import copy
import json
import sys

import torch
import torch.nn.functional as F
from torch import nn

import psrt
from psrt.dp import strategy_class
from psrt.dp.precision import LossScaler, ScaledOptimizer

POISONED, STEPS, BATCH = 1, 5, 12


class Poisoned(ScaledOptimizer):
    """Puts an inf into this rank's first gradient element at step POISONED (rank 1 only)."""
    calls = 0

    def step(self, closure=None):
        if self.rank == 1 and self.calls == POISONED:
            g = next(p.grad for grp in self.param_groups for p in grp["params"]
                     if p.grad is not None and p.grad.numel())
            g.view(-1)[0] = float("inf")
        self.calls += 1
        return super().step()


def main() -> None:
    world = psrt.init()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    X, Y = torch.randn(STEPS * BATCH, 10, generator=g), torch.randint(0, 5, (STEPS * BATCH,), generator=g)
    per = BATCH // world.size
    for name in ("ring", "zero2", "zero3"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 5))
        ref = copy.deepcopy(model)
        comm = world.comm.Dup()
        scaler = LossScaler(comm, init_scale=2.0 ** 10, growth_interval=3)

        def make(params):
            opt = Poisoned(torch.optim.SGD(params, lr=0.1, momentum=0.9), scaler)
            opt.rank = world.rank
            return opt
        group = psrt.Communicator(world.comm)
        strategy = strategy_class(name)(model, make, group, **({"bucket_mb": 0.0005} if name == "zero2" else {}))
        scales = []
        for s in range(STEPS):
            lo = s * BATCH + world.rank * per
            strategy.step(lambda mb: scaler(F.cross_entropy(model(mb[0]), mb[1])), [(X[lo:lo + per], Y[lo:lo + per])])
            scales.append(scaler.scale)
        strategy.finish()
        group.close()
        comm.Free()
        opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        for s in range(STEPS):
            if s == POISONED:
                continue
            opt.zero_grad()
            F.cross_entropy(ref(X[s * BATCH:(s + 1) * BATCH]), Y[s * BATCH:(s + 1) * BATCH]).backward()
            opt.step()
        worst = max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
        sys.stdout.write("PSRT-RESULT " + json.dumps({"dp": name, "rank": world.rank, "scales": scales,
                                                      "skipped": scaler.skipped, "max_abs": worst}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
