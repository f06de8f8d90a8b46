"""A plain PyTorch DDP training script: DistributedSampler, the DDP wrapper, rank-0 printing.

It runs unchanged on gloo under torchrun and on psrt under an MPI launcher:

    torchrun --nproc-per-node 4 examples/torch_ddp.py              # gloo
    mpirun -np 4 python examples/torch_ddp.py                       # psrt (rank, rendezvous from MPI)
    PSRT_ALGORITHM=ps mpirun -np 4 python examples/torch_ddp.py     # the same job, parameter-server all-reduce

The only psrt lines are `import psrt.c10d` and the default of --backend.
"""
import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import psrt.c10d


def dataset(n: int = 4096, dim: int = 32, classes: int = 4) -> TensorDataset:
    """Gaussian blobs: overlapping, so the loss keeps falling for a few epochs."""
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(classes, dim, generator=g) * 0.25
    y = torch.randint(classes, (n,), generator=g)
    x = centres[y] + torch.randn(n, dim, generator=g)
    return TensorDataset(x, y)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="psrt" if psrt.c10d.launched_by_mpi() else "gloo")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64, help="per rank")
    ap.add_argument("--lr", type=float, default=0.05)
    args = ap.parse_args()

    dist.init_process_group(args.backend)
    train(args)
    # The DDP model is gone by now (train returned): its reducer must not be what holds the
    # process group last.  Dropped from the reducer, a gloo group's destructor waits for its
    # worker threads while holding the GIL, which a worker freeing a tensor also needs: a
    # hang now and then (pytorch/pytorch#56297).  Dropped here, it waits without the GIL.
    dist.destroy_process_group()


def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    data = dataset()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if rank == 0:
        print(f"DDP on {args.backend}: {world} ranks, {len(loader)} steps per epoch")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        start, total, correct, seen = time.perf_counter(), torch.zeros(1), torch.zeros(1), torch.zeros(1)
        for x, y in loader:
            opt.zero_grad()
            out = model(x)
            loss = nn.functional.cross_entropy(out, y)
            loss.backward()
            opt.step()
            total += loss.detach() * len(y)
            correct += (out.argmax(1) == y).sum()
            seen += len(y)
        stats = torch.cat([total, correct, seen])
        dist.all_reduce(stats)                       # epoch figures over every rank
        if rank == 0:
            print(f"epoch {epoch}: loss {stats[0].item() / stats[2].item():.6f}  "
                  f"accuracy {stats[1].item() / stats[2].item():.4f}  {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
