"""DDP and ZeRO pieces that one process can check.

The pytest process never initialises MPI (see conftest.py), so these tests run the
strategies over `OneRank`, a stand-in with the Communicator's signatures for a world of one
rank that records when each collective was issued.  Multi-rank behaviour is tested under
mpirun (test_ddp_equivalence.py).
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from psrt.collectives.cost import wire_bytes
from psrt.dp.common import optimizer_state_bytes
from psrt.dp.ddp import RingDDP, make_buckets
from psrt.dp.zero import ZeroOptimizer


class _Done:
    def __init__(self, value):
        self.value = value

    def wait(self):
        return self.value


class OneRank:
    """Communicator signatures for size 1: every collective is a copy."""
    rank, size = 0, 1

    def __init__(self):
        self.calls = []

    def allreduce(self, t, op="sum", out=None, algorithm=None, async_op=False):
        self.calls.append(("allreduce", t.numel()))
        result = t if out is None else out.copy_(t)
        return _Done(result) if async_op else result

    def reduce_scatter(self, t, op="sum", out=None, counts=None, algorithm=None, async_op=False):
        result = t.clone() if out is None else out.copy_(t)
        return _Done(result) if async_op else result

    def allgather(self, t, out=None, counts=None, algorithm=None, async_op=False):
        result = t.clone() if out is None else out.copy_(t)
        return _Done(result) if async_op else result

    def broadcast(self, t, root=0, algorithm=None, async_op=False):
        return _Done(t) if async_op else t

    def pick(self, collective, nbytes, algorithm=None):
        return "native" if algorithm in (None, "auto") else algorithm


@pytest.fixture
def comm():
    return OneRank()


def deep_mlp(layers=6, width=32):
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*mods, nn.Linear(width, 3))


def batch(n=16, width=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g), torch.randint(0, 3, (n,), generator=g)


def loss_fn_for(model):
    return lambda mb: F.cross_entropy(model(mb[0]), mb[1])


def test_buckets_take_parameters_in_reverse_order_and_respect_the_size():
    params = [nn.Parameter(torch.zeros(100)) for _ in range(5)] + [nn.Parameter(torch.zeros(10, dtype=torch.float64))]
    buckets = make_buckets(params, 800)          # 2 fp32 tensors of 400 bytes per bucket
    assert [[id(p) for p in b.params] for b in buckets] == \
        [[id(params[5])], [id(params[4]), id(params[3])], [id(params[2]), id(params[1])], [id(params[0])]]
    assert buckets[0].flat.dtype == torch.float64            # a dtype change starts a bucket
    assert buckets[1].flat.numel() == 201                    # + 1 spare element for the loss


def test_buckets_are_launched_during_backward_only_with_overlap(comm):
    x, y = batch()
    results = {}
    for overlap in (True, False):
        model = deep_mlp()
        ddp = RingDDP(model, lambda p: torch.optim.SGD(p, lr=0.1), comm, bucket_mb=0.002, overlap=overlap)
        stats = ddp.step(loss_fn_for(model), [(x, y)])
        assert stats.extra["buckets"] >= 4
        results[overlap] = (stats.extra["launched_in_backward"], [p.detach().clone() for p in model.parameters()])
        ddp.finish()
    launched, params = results[True]
    # All but the last bucket (the first layer, whose gradient is ready last) start in backward.
    assert launched >= 3
    assert results[False][0] == 0
    assert all(torch.equal(a, b) for a, b in zip(params, results[False][1]))


def test_no_sync_accumulates_without_communicating(comm):
    model = deep_mlp(layers=2)
    ddp = RingDDP(model, lambda p: torch.optim.SGD(p, lr=0.1), comm, bucket_mb=0.001)
    x, y = batch()
    with ddp.no_sync():
        F.cross_entropy(model(x), y).backward()
    assert comm.calls == []
    stats = ddp.step(loss_fn_for(model), [(x[:8], y[:8]), (x[8:], y[8:])])
    assert len(comm.calls) == stats.extra["buckets"] >= 2


def test_accumulated_step_equals_one_big_batch(comm):
    model2, ref2 = deep_mlp(layers=2), deep_mlp(layers=2)
    ddp2 = RingDDP(model2, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), comm, bucket_mb=0.001)
    opt2 = torch.optim.SGD(ref2.parameters(), lr=0.1, momentum=0.9)
    for seed in range(3):
        x, y = batch(seed=seed)
        stats = ddp2.step(loss_fn_for(model2), list(zip(x.chunk(4), y.chunk(4))))
        opt2.zero_grad()
        loss = F.cross_entropy(ref2(x), y)
        loss.backward()
        opt2.step()
        assert stats.loss == pytest.approx(loss.item(), rel=1e-6)
    for a, b in zip(model2.parameters(), ref2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class PartlyUsed(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 2)
        self.unused = nn.Linear(4, 2)

    def forward(self, x):
        return self.used(x)


@pytest.mark.parametrize("cls", [RingDDP, ZeroOptimizer])
def test_parameters_without_gradient_do_not_block_the_step(comm, cls):
    model = PartlyUsed()
    before = model.unused.weight.detach().clone()
    dp = cls(model, lambda p: torch.optim.SGD(p, lr=0.1), comm)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    dp.step(loss_fn_for(model), [(x, y)])
    assert torch.equal(model.unused.weight, before)
    assert not torch.equal(model.used.weight, before)


def test_fp16_compression_rounds_to_half_precision(comm):
    model = deep_mlp(layers=1)
    ddp = RingDDP(model, lambda p: torch.optim.SGD(p, lr=0.0), comm, compress="fp16")
    x, y = batch()
    ddp.step(loss_fn_for(model), [(x, y)])
    g = model[0].weight.grad
    assert torch.equal(g, g.half().float())               # went through fp16
    assert g.abs().sum() > 0


def test_zero_shards_optimizer_state_bytes(comm):
    model = deep_mlp(layers=1)
    z = ZeroOptimizer(model, lambda p: torch.optim.Adam(p, lr=1e-3), comm)
    x, y = batch()
    z.step(loss_fn_for(model), [(x, y)])
    n_params = sum(p.numel() for p in model.parameters())
    # Adam: two moments of the (here: whole) shard, plus a scalar step counter.
    assert z.optimizer_state_bytes() == 2 * 4 * n_params + 4


def test_optimizer_state_bytes_counts_momentum():
    p = nn.Parameter(torch.ones(10))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(10)
    opt.step()
    assert optimizer_state_bytes(opt) == 40


@pytest.mark.parametrize("algo,rank,expected", [
    ("ring", 0, 2 * 3 * 250), ("native", 2, 1500), ("ps", 0, 3 * 1000), ("ps", 1, 1000),
    ("doubling", 1, 2 * 1000), ("tree", 0, 2 * 1000), ("tree", 3, 1000)])
def test_wire_bytes_of_an_allreduce_of_1000_bytes_on_4_ranks(algo, rank, expected):
    assert wire_bytes("allreduce", algo, 1000, 4, rank) == expected


def test_zero2_without_bucket_mb_cuts_a_small_model_into_eighths():
    """A model far below 25 MiB: zero2's default buckets are an eighth of its gradient, so its
    two buffers in flight hold a quarter of it, not the whole (which zero1 holds anyway);
    --bucket-mb given is kept as given."""
    from psrt.dp.zero import Zero2
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(16)])
    whole = sum(p.numel() * 4 for p in model.parameters())
    zero2 = Zero2(model, lambda p: torch.optim.SGD(p, lr=0.1), OneRank())
    assert len(zero2.buckets) >= 8
    assert sum(b.numel() * 4 for b in zero2.pool) <= whole / 4 + 2 * 33 * 32 * 4     # within a layer's size
    given = Zero2(nn.Sequential(*[nn.Linear(32, 32) for _ in range(16)]), lambda p: torch.optim.SGD(p, lr=0.1),
                  OneRank(), bucket_mb=25)
    assert len(given.buckets) == 1


def test_buckets_hold_at_least_the_size_and_never_mix_dtypes():
    """The one bucketing rule (psrt.collectives.layout.group_by_size), as DDP's and ZeRO-2's
    gradient buckets use it (psrt.dp.common.group_by_bytes)."""
    from psrt.collectives.layout import group_by_size
    from psrt.dp.common import group_by_bytes
    assert group_by_size([4, 4, 4, 4, 4], 8) == [[0, 1], [2, 3], [4]]
    assert group_by_size([12, 4, 4], 8) == [[0], [1, 2]]
    assert group_by_size([4, 4, 4], 100, kinds=["a", "a", "b"]) == [[0, 1], [2]]
    tensors = [torch.zeros(2), torch.zeros(2), torch.zeros(2, dtype=torch.float64), torch.zeros(4)]
    assert group_by_bytes(tensors, 12) == [[0, 1], [2], [3]]
