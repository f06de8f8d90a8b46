"""psrt's data-parallel strategies on your own model, from your own training loop.

    mpirun -np 3 python examples/own_model.py --strategy ps                # rank 0 serves and trains
    mpirun -np 3 python examples/own_model.py --strategy ps --servers 1    # rank 2 only serves
    mpirun -np 3 python examples/own_model.py --strategy ring              # ring all-reduce

The model, the data set, the DataLoader and the loss are plain PyTorch.  psrt adds three
calls: `data_parallel` (pick a strategy; every rank starts from rank 0's model),
`dp.shard` (this worker's part of the data) and `dp.step` (forward, backward, communication
and update).  Every rank runs the same loop: a dedicated server gets an empty shard, so its
loop does nothing and `dp.finish()` serves the workers until they are done.
"""
import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import psrt


class RingClassifier(nn.Module):
    """Which of three rings around the origin a 2-D point lies on."""

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                 nn.Linear(hidden, 3))

    def forward(self, x):
        return self.net(x)


def rings(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    label = torch.randint(0, 3, (n,), generator=g)
    angle = torch.rand(n, generator=g) * 6.2832
    radius = 1.0 + label + 0.3 * torch.randn(n, generator=g)
    return TensorDataset(torch.stack([radius * angle.cos(), radius * angle.sin()], 1), label)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategy", default="ring", help="ps, ps-sharded, ps-async, ring, native, zero, ...")
    ap.add_argument("--servers", type=int, default=None, help="dedicated server ranks (ps strategies)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=48, help="global batch, split over the workers")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per step on each worker")
    ap.add_argument("--lr", type=float, default=0.1)
    args = ap.parse_args()

    world = psrt.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = RingClassifier()
    options = {} if args.servers is None else {"servers": args.servers}
    dp = psrt.data_parallel(model, lambda params: torch.optim.SGD(params, lr=args.lr, momentum=0.9),
                       strategy=args.strategy, world=world, accum=args.accum, **options)
    if args.batch % (dp.num_workers * args.accum):
        raise psrt.PsrtError(f"--batch {args.batch} does not split over {dp.num_workers} workers x "
                             f"--accum {args.accum}", everywhere=True)
    train, test = rings(1200, seed=1), rings(300, seed=2)
    loader = DataLoader(dp.shard(train), batch_size=args.batch // dp.num_workers)

    def loss_fn(batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    if world.rank == 0:
        role = "serves and trains" if args.strategy.startswith("ps") and not args.servers else "trains"
        print(f"{args.strategy}: {dp.num_workers} workers of {world.size} ranks, rank 0 {role}; "
              f"global batch {args.batch}", flush=True)
    for epoch in range(args.epochs):
        for batch in loader:                     # empty on a dedicated server
            stats = dp.step(loss_fn, batch)
        if world.rank == 0:
            print(f"epoch {epoch + 1}: loss {stats.loss:.4f}", flush=True)
    dp.finish()                                  # a dedicated server serves until here

    if world.rank == 0:
        with torch.no_grad():
            x, y = test.tensors
            accuracy = (model(x).argmax(1) == y).float().mean().item()
        print(f"done: {args.strategy}, {len(dp.stats)} steps, final loss {stats.loss:.4f}, "
              f"test accuracy {accuracy:.1%}", flush=True)


if __name__ == "__main__":
    main()
