"""Rank-side check of psrt.data_parallel: a user's model (user_model.Tagger), the user's own
DataLoader over `dp.shard(...)`, every strategy on 2 and 3 ranks (sub-communicators of one
launch of 3), with and without a dedicated server, ends with the parameters of one process
training on the whole batch.

    mpirun -np 3 python tests/mpi/ranks/dp_api.py [--only ps,ring]

Ranks other than 0 perturb their parameters and buffers first, so a strategy that did not
start every rank from rank 0's would fail.  Two loops, the same on every rank:
- "loader": `for batch in DataLoader(dp.shard(train), batch_size=B // W): dp.step(loss_fn,
  batch)` with accum=2 cutting each batch in two; a server's shard is empty, so its loop does
  nothing and `finish()` serves;
- "steps": a fixed number of steps, each worker taking every W-th sample of the global batch
  and giving two micro-batches; on a server `step()` serves one update per call.
Each rank prints one `PSRT-RESULT {json}` line per (size, strategy, options, loop).
Tolerance as in dp_equivalence.py (rtol 1e-5, atol 1e-6, fp32).
"""
import argparse
import importlib.util
import json
import sys

import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch.utils.data import DataLoader
from user_model import Points, Tagger

import psrt
from psrt.dp.driver import data_parallel

B, STEPS, ACCUM = 12, 3, 2
# (strategy, options, loops): every strategy of psrt.dp.STRATEGIES; servers=1 is a dedicated
# server rank (ps-async always has one).
CONFIGS = [
    ("ps", {}, ("loader",)),
    ("ps", {"servers": 1}, ("loader", "steps")),
    ("ps-sharded", {}, ("loader",)),
    ("ps-sharded", {"servers": 1}, ("loader",)),
    ("ps-async", {}, ("loader", "steps")),
    ("ring", {"bucket_mb": 0.0005}, ("loader", "steps")),
    ("native", {}, ("loader",)),
    ("torch", {}, ("loader",)),
    ("zero1", {}, ("loader",)),
    ("zero2", {}, ("loader",)),
    ("zero3", {}, ("loader", "steps")),
    ("horovod", {}, ("loader",)),
]


def make_opt(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference(train) -> tuple[torch.nn.Module, list[float]]:
    """One process, the whole global batch at each step."""
    torch.manual_seed(0)
    model = Tagger()
    opt = make_opt(model.parameters())
    losses = []
    for x, y in DataLoader(train, batch_size=B):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def run(name, options, loop, where: dict, train, rank: int) -> dict:
    torch.manual_seed(0)
    model = Tagger()
    if rank != 0:
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                t.mul_(2.0).add_(1.0)

    def loss_fn(mb):
        x, y = mb
        return F.cross_entropy(model(x), y)

    dp = data_parallel(model, make_opt, strategy=name, accum=ACCUM, **where, **options)
    W = dp.num_workers
    if loop == "loader":
        for batch in DataLoader(dp.shard(train), batch_size=B // W):
            dp.step(loss_fn, batch)
    else:
        X, Y = train.x, train.y
        for s in range(STEPS):
            mine = slice(s * B + max(dp.worker_rank, 0), (s + 1) * B, W)   # every W-th sample
            dp.step(loss_fn, microbatches=list(zip(X[mine].chunk(ACCUM), Y[mine].chunk(ACCUM))))
    dp.finish()
    rec = {"dp": name, "options": options, "loop": loop, "rank": rank, "server": dp.is_server,
           "workers": W, "worker_rank": dp.worker_rank, "steps": len(dp.stats),
           "state_keys": sorted(dp.state_dict())}
    if dp.is_server:
        rec["served"] = sum(1 for s in dp.stats if s.extra.get("served"))
        return rec
    ref, ref_losses = REF
    bad = [n for (n, p), q in zip(model.named_parameters(), ref.parameters())
           if not torch.allclose(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)]
    bad += [n for (n, b), c in zip(model.named_buffers(), ref.buffers()) if not torch.equal(b, c)]
    worst = max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
    losses = [(s.loss, s.extra.get("loss_scope", "global")) for s in dp.stats]
    rec.update(bad=bad, max_abs=worst, losses=[l for l, _ in losses], ref_losses=ref_losses,
               loss_ok=all(scope != "global" or abs(l - r) <= 1e-6 + 1e-5 * abs(r)
                           for (l, scope), r in zip(losses, ref_losses)))
    return rec


REF = None


def main() -> None:
    global REF
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="strategies to run, comma separated (default: all)")
    ap.add_argument("--sizes", default="2,3")
    args = ap.parse_args()
    world = psrt.init()
    torch.set_num_threads(1)
    train = Points(B * STEPS, seed=1)
    REF = reference(train)
    only = set(args.only.split(",")) - {""}
    have_horovod = importlib.util.find_spec("horovod") is not None   # optional: tests skip it
    configs = [c for c in CONFIGS if (not only or c[0] in only) and (c[0] != "horovod" or have_horovod)]
    import torch.distributed as dist
    psrt.init_torch_distributed(world)
    sizes = [int(n) for n in args.sizes.split(",")]
    torch_groups = {n: dist.new_group(list(range(n))) for n in sizes}   # collective: every rank
    for n in sizes:
        sub = world.comm.Split(0 if world.rank < n else MPI.UNDEFINED, world.rank)
        if sub != MPI.COMM_NULL:
            sub_world = psrt.init(comm=sub, export_env=False)
            for name, options, loops in configs:
                for loop in loops:
                    # The default: data_parallel makes its own communicator of the world's
                    # ranks.  torch reduces through a torch.distributed group: given with it.
                    group = psrt.Communicator(sub.Dup(), torch_group=torch_groups[n]) if name == "torch" else None
                    where = {"group": group} if group else {"world": sub_world}
                    rec = dict(run(name, options, loop, where, train, sub.rank), size=n)
                    if group:
                        comm = group.comm
                        group.close()
                        comm.Free()
                    if name == "horovod":
                        import horovod.torch as hvd
                        hvd.shutdown()      # Horovod runs on one set of ranks at a time
                    # One write per line, so mpirun cannot interleave another rank's output.
                    sys.stdout.write("PSRT-RESULT " + json.dumps(rec) + "\n")
                    sys.stdout.flush()
                    sub.Barrier()
            sub_world.free()
            sub.Free()
        world.comm.Barrier()


if __name__ == "__main__":
    main()
