"""Shared pieces of the parameter-server rank-side scripts: a tiny MLP, synthetic data split
by worker, a single-process reference, and the PSRT-RESULT printer."""
import copy
import hashlib
import json

import torch

from psrt.dp import strategy_class

IN, HIDDEN, OUT = 8, 16, 4


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, OUT))


@torch.no_grad()
def perturb(model, rank: int) -> None:
    """Ranks other than 0 shift their replica: the strategy must start everyone from rank 0's."""
    if rank != 0:
        for p in model.parameters():
            p.add_(1.0)


def make_data(batch: int, steps: int, seed: int = 1):
    """One global batch per step: [(x, y)] * steps, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, IN, generator=g), torch.randn(batch, OUT, generator=g))
            for _ in range(steps)]


def make_optimizer(name: str):
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "adam":
        return lambda params: torch.optim.Adam(params, lr=0.01)
    raise ValueError(name)


def local_microbatches(x, y, index: int, workers: int, micro: int):
    """Worker `index`'s even share of the global batch, cut into `micro` equal micro-batches."""
    share = x.shape[0] // workers
    xs, ys = x[index * share:(index + 1) * share], y[index * share:(index + 1) * share]
    return list(zip(xs.chunk(micro), ys.chunk(micro)))


def mse(model):
    return lambda mb: torch.nn.functional.mse_loss(model(mb[0]), mb[1])


def reference(model, optim: str, data) -> tuple[torch.Tensor, list[float]]:
    """One process, whole global batch per step, same optimizer: the parameters to match and
    the loss of every step."""
    ref = copy.deepcopy(model)
    opt = make_optimizer(optim)(ref.parameters())
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ref(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return flat(ref), losses


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:16]


def build(dp: str, model, optim: str, comm, **options):
    return strategy_class(dp)(model, make_optimizer(optim), comm, **options)


def run_steps(strategy, model, data, micro: int = 2):
    stats = []
    for x, y in data:
        mbs = local_microbatches(x, y, strategy.worker_rank, strategy.num_workers, micro)
        stats.append(strategy.step(mse(model), mbs))
    return stats


class Results:
    """Records kept on each rank and printed by rank 0 at the end, one line each: lines that
    several ranks print at once can interleave in mpirun's output."""

    def __init__(self, comm):
        self.comm = comm
        self.records: list[dict] = []

    def add(self, **record) -> None:
        self.records.append(record)

    def flush(self) -> None:
        gathered = self.comm.gather(self.records, root=0)
        self.records = []
        if gathered is not None:
            lines = [json.dumps(r) for rank in gathered for r in rank]
            print("".join(f"PSRT-RESULT {line}\n" for line in lines), end="", flush=True)
