"""Rank-side check: k steps of a data-parallel strategy on N ranks == one process on the
whole global batch.

Uses only the DataParallel contract and the registry (psrt.dp.strategy_class), so every
strategy, present or future, can be checked with it:

    mpirun -np 4 python tests/mpi/ranks/dp_equivalence.py --dp ring,zero --accum 2 --sizes 1,2,3,4

A name ending in "/offload" (zero1/offload) runs that strategy with offload_optimizer, so one
launch compares a sharded stage with and without the optimizer on the host.

Each rank builds the model from the same seed and keeps a deep copy as the single-process
reference; ranks other than 0 then perturb their replica, so the check also fails if the
strategy does not start every rank from rank 0's parameters.  The reference trains on the
whole global batch (its mean loss), the strategy on each worker's slice of it.  Every
worker prints one `PSRT-RESULT {json}` line per strategy with the largest deviation.

Tolerance: fp32 sums taken in a different order differ by a few ulps per reduction; a few
SGD/Adam steps amplify that only mildly, so rtol 1e-5 / atol 1e-6 holds for a correct
strategy while a wrong average (say a sum, or a missing micro-batch) is off by O(1).
"""
import argparse
import copy
import json
import sys

import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import psrt
from psrt.dp import strategy_class
from psrt.dp.base import option_names


class Net(nn.Module):
    """A small MLP plus a layer forward never uses (a parameter that gets no gradient)."""

    def __init__(self, unused: bool):
        super().__init__()
        self.fc1 = nn.Linear(10, 16)
        self.fc2 = nn.Linear(16, 16)
        self.out = nn.Linear(16, 5)
        self.spare = nn.Linear(4, 4) if unused else None

    def forward(self, x):
        return self.out(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def make_optimizer_factory(args):
    def make(params):
        if args.optimizer == "adam":
            return torch.optim.Adam(params, lr=args.lr)
        return torch.optim.SGD(params, lr=args.lr, momentum=args.momentum)
    return make


def loss_fn_for(model):
    def loss_fn(mb):
        x, y = mb
        return F.cross_entropy(model(x), y)
    return loss_fn


def run(name: str, args, comm, rank: int) -> list:
    torch.manual_seed(args.seed)
    model = Net(args.unused).to(args.device)
    ref = copy.deepcopy(model)
    if rank != 0:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    make_opt = make_optimizer_factory(args)
    strategy_name, _, variant = name.partition("/")
    options = dict(bucket_mb=args.bucket_mb, compress=args.compress, algorithm=args.algorithm,
                   servers=args.servers, staleness=args.staleness, overlap=not args.no_overlap,
                   offload_optimizer=(args.offload_optimizer or variant == "offload") or None)
    # Each strategy takes only its own options (an unknown one is an error, not ignored).
    cls = strategy_class(strategy_name)
    options = {k: v for k, v in options.items() if v is not None and k in option_names(cls)}
    strategy = cls(model, make_opt, comm, **options)

    g = torch.Generator().manual_seed(1)
    B = args.batch
    X = torch.randn(args.steps * B, 10, generator=g).to(args.device)
    Y = torch.randint(0, 5, (args.steps * B,), generator=g).to(args.device)

    losses, extra, devices = [], {}, []
    if strategy.is_worker:
        W, w = strategy.num_workers, strategy.worker_rank
        per = B // W
        for s in range(args.steps):
            lo = s * B + w * per
            x, y = X[lo:lo + per], Y[lo:lo + per]
            mbs = list(zip(x.chunk(args.accum), y.chunk(args.accum)))
            stats = strategy.step(loss_fn_for(model), mbs)
            losses.append((stats.loss, stats.extra.get("loss_scope", "global")))
            extra = {k: v for k, v in stats.extra.items() if isinstance(v, (int, float, str))}
        # Where the strategy keeps the parameters, gradients and its buffers (not the optimizer,
        # which --offload-optimizer puts on the host).
        held = strategy.memory()
        devices = sorted({t.device.type for part in ("params", "grads", "buffers") for t in held.get(part) or []
                          if t is not None and t.numel()})
        strategy.finish()
    else:
        strategy.serve()

    opt = make_opt(ref.parameters())
    ref_losses = []
    for s in range(args.steps):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ref(X[s * B:(s + 1) * B]), Y[s * B:(s + 1) * B])
        ref_losses.append(loss.item())
        loss.backward()
        opt.step()

    if not strategy.is_worker:
        return [{"dp": name, "rank": rank, "worker": False}]
    worst_abs, worst_rel, bad = 0.0, 0.0, []
    for (pname, p), q in zip(model.named_parameters(), ref.parameters()):
        diff = (p.detach() - q.detach()).abs()
        worst_abs = max(worst_abs, float(diff.max()))
        worst_rel = max(worst_rel, float((diff / q.detach().abs().clamp_min(1e-12)).max()))
        if not torch.allclose(p.detach(), q.detach(), rtol=args.rtol, atol=args.atol):
            bad.append(pname)
    loss_ok = all(scope != "global" or abs(l - r) <= args.atol + args.rtol * abs(r)
                  for (l, scope), r in zip(losses, ref_losses))
    return [{"dp": name, "rank": rank, "worker": True, "size": comm.size, "max_abs": worst_abs,
             "bad_params": bad, "ok": not bad, "loss_ok": loss_ok, "extra": extra, "devices": devices,
             "losses": [l for l, _ in losses], "ref_losses": ref_losses}]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", default="ring", help="strategies, comma separated, run in turn")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=24, help="global batch")
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--bucket-mb", type=float, default=0.001, help="small: several buckets")
    ap.add_argument("--compress", default=None)
    ap.add_argument("--algorithm", default=None)
    ap.add_argument("--servers", type=int, default=None)
    ap.add_argument("--staleness", type=int, default=None)
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--unused", action="store_true", help="add a parameter that gets no gradient")
    ap.add_argument("--offload-optimizer", action="store_true", help="zero1/2/3: the optimizer on the host")
    ap.add_argument("--device", default="cpu", help="where the model and data live (cuda: the GPU tests)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sizes", default="", help="run on sub-communicators of these sizes "
                    "(ranks 0..n-1), e.g. 1,2,3,4 in one launch of 4 ranks (default: all ranks)")
    ap.add_argument("--rtol", type=float, default=1e-5)
    ap.add_argument("--atol", type=float, default=1e-6)
    args = ap.parse_args()
    world = psrt.init()
    torch.set_num_threads(1)
    names = args.dp.split(",")
    sizes = [int(n) for n in args.sizes.split(",")] if args.sizes else [world.size]
    groups = {}
    if "torch" in names:
        import torch.distributed as dist
        psrt.init_torch_distributed(world)
        groups = {n: dist.new_group(list(range(n))) for n in sizes}   # collective: every rank
    # One launch covers every size: ranks 0..n-1 form a communicator of n ranks, which the
    # strategies receive explicitly; the other ranks skip ahead.
    for n in sizes:
        sub = world.comm.Split(0 if world.rank < n else MPI.UNDEFINED, world.rank)
        if sub != MPI.COMM_NULL:
            comm = psrt.Communicator(sub, torch_group=groups.get(n))
            for name in names:
                for rec in run(name, args, comm, sub.rank):
                    # One write per line: print() writes the newline separately, and mpirun
                    # may interleave another rank's output between the two.
                    sys.stdout.write("PSRT-RESULT " + json.dumps(rec) + "\n")
                    sys.stdout.flush()
                sub.Barrier()
            comm.close()
            sub.Free()
        world.comm.Barrier()


if __name__ == "__main__":
    main()
