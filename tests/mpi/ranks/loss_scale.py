"""Rank-side check of fp16 loss scaling's agreement: one rank's gradient overflows at one step
and two finite gradients overflow only in their sum at another; every rank, servers included,
must skip both steps, halve the scale each time and stay equal to one process that skipped
them too.  Then every sharded state is loaded on 3 ranks (reshard on load): the parameters
and the scale carry over.

    mpirun -np 4 python loss_scale.py

At step POISON rank 1 alone finds an inf in its local gradient (element 0 of the first
parameter).  ring reduces it into every rank's gradient; zero1/2/3 check only their own shard,
so without the agreement the owner of that element would skip while the others stepped;
ps-sharded's servers each hold one slice and learn of it from the push headers.  At step
SUM_OVERFLOWS ranks 0 and 1 put 3e38 into that element: finite on each rank, inf once summed,
so only the rank or server that sums it can see it (ps-sharded's servers agree among
themselves).  The scale starts at 2^10 and grows after 3 good steps (GradScaler's rules with
a shorter interval), so 7 steps give scales 1024, 512, 512, 256, 256, 256, 512.  Every rank
prints one `PSRT-RESULT {json}` per strategy and one per reloaded state.
"""
import importlib.util
import json
import sys

import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import psrt
from psrt.dp import strategy_class
from psrt.dp.precision import LossScaler, scaled_factory

POISON, SUM_OVERFLOWS, STEPS, BATCH = 1, 3, 7, 12
BAD = {POISON: {1: float("inf")}, SUM_OVERFLOWS: {0: 3e38, 1: 3e38}}
CASES = [("ring", {}), ("zero1", {}), ("zero2", {"bucket_mb": 0.0005}), ("zero3", {}), ("ps", {}),
         ("ps-sharded", {"servers": 2}), ("ps-async", {"staleness": 0})]
if importlib.util.find_spec("horovod") is not None:
    CASES.append(("horovod", {}))            # last: Horovod starts once per process
RESHARDED = {"zero1": {}, "zero2": {"bucket_mb": 0.0005}, "zero3": {}, "ps-sharded": {"servers": 1}}


def make_scaler(comm) -> LossScaler:
    return LossScaler(comm, init_scale=2.0 ** 10, growth_interval=3)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def emit(record: dict) -> None:
    sys.stdout.write("PSRT-RESULT " + json.dumps(record) + "\n")
    sys.stdout.flush()


def train(world, name: str, options: dict, X, Y):
    """STEPS steps of `name` on every rank; returns (strategy, model, scaler, scales)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 5))
    step = [0]

    def poison(g):
        value = BAD.get(step[0], {}).get(world.rank)
        if value is None:
            return g
        g = g.clone()
        g.view(-1)[0] = value
        return g
    next(model.parameters()).register_hook(poison)
    comm = world.comm.Dup()
    scaler = make_scaler(comm)
    group = psrt.Communicator(world.comm)
    strategy = strategy_class(name)(model, scaled_factory(sgd, scaler), group, **options)
    scales = []
    if strategy.is_worker:
        per = BATCH // strategy.num_workers
        for s in range(STEPS):
            step[0] = s
            lo = s * BATCH + strategy.worker_rank * per
            strategy.step(lambda mb: scaler(F.cross_entropy(model(mb[0]), mb[1])),
                          [(X[lo:lo + per], Y[lo:lo + per])])
            scales.append(scaler.scale)
    strategy.finish()
    group.close()
    comm.Free()
    return strategy, model, scaler, scales


def reference(X, Y):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 5))
    opt = sgd(ref.parameters())
    for s in range(STEPS):
        if s in BAD:
            continue
        opt.zero_grad()
        F.cross_entropy(ref(X[s * BATCH:(s + 1) * BATCH]), Y[s * BATCH:(s + 1) * BATCH]).backward()
        opt.step()
    return ref


def reload(world, name: str, states: list, trained: list) -> None:
    """Load the states of 4 ranks on ranks 0-2 with a fresh scaler; report what came back."""
    sub = world.comm.Split(0 if world.rank < 3 else MPI.UNDEFINED, world.rank)
    if sub == MPI.COMM_NULL:
        return
    torch.manual_seed(1)                                       # other initial values
    model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 5))
    scaler = make_scaler(None)
    group = psrt.Communicator(sub)
    strategy = strategy_class(name)(model, scaled_factory(sgd, scaler), group, **RESHARDED[name])
    strategy.load_resharded(states)
    if hasattr(strategy, "full_parameters"):
        strategy.full_parameters()
    flat = torch.cat([t.reshape(-1) for t in trained])
    if strategy.is_worker:
        worst = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), trained))
    else:                                                      # a dedicated server: its slice
        lo, hi = strategy.shard_range
        worst = float((strategy.holder.param.detach() - flat[lo:hi]).abs().max())
    emit({"reloaded": name, "rank": sub.rank, "scaler": scaler.state_dict(), "max_abs": worst})
    strategy.finish()
    group.close()
    sub.Free()


def main() -> None:
    world = psrt.init()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    X, Y = torch.randn(STEPS * BATCH, 10, generator=g), torch.randint(0, 5, (STEPS * BATCH,), generator=g)
    ref = reference(X, Y)
    for name, options in CASES:
        strategy, model, scaler, scales = train(world, name, options, X, Y)
        record = {"dp": name, "rank": world.rank, "worker": strategy.is_worker, "scales": scales,
                  "scale": scaler.scale, "skipped": scaler.skipped}
        if strategy.is_worker:
            record["max_abs"] = max(float((p - q).detach().abs().max())
                                    for p, q in zip(model.parameters(), ref.parameters()))
        server = getattr(strategy, "server_scaler", None)
        if server is not None:
            record["server"] = server.state_dict()
        emit(record)
        if name in RESHARDED:
            states = world.comm.allgather(strategy.state_dict())
            trained = world.comm.bcast([p.detach().clone() for p in model.parameters()], root=0)
            reload(world, name, states, trained)
            world.comm.Barrier()


if __name__ == "__main__":
    main()
