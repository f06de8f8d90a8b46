"""Parameter-server pieces that need no MPI (the pytest process never initialises it): the
shard partition, message buffers, the flat view of a model, the server-side optimizer
holders, the layouts and their error messages."""
from __future__ import annotations

import pytest
import torch

from psrt.dp.ps import ParameterServer, PSOptions
from psrt.dp.ps_protocol import (FlatParams, FlatShard, ModelShard, Wire, average_in_order,
                                 check_staleness, shard_ranges)
from psrt.dp.ps_sharded import ShardedParameterServer, ShardedPSOptions
from psrt.errors import PsrtError


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))


@pytest.mark.parametrize("numel,shards", [(0, 3), (2, 3), (7, 3), (212, 4), (10, 1), (9, 9)])
def test_shard_ranges_are_contiguous_and_balanced(numel, shards):
    ranges = shard_ranges(numel, shards)
    assert len(ranges) == shards and ranges[0][0] == 0 and ranges[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [hi - lo for lo, hi in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("numel", [0, 1, 3, 8])
def test_wire_header_never_overlaps_payload(dtype, numel):
    w = Wire(numel, dtype)
    w.data.copy_(torch.arange(numel).to(dtype))
    w.head.fill_(-7.0)
    assert torch.equal(w.data, torch.arange(numel).to(dtype))
    assert w.head.dtype == torch.float64 and w.head.numel() == 4
    assert w.nbytes % 8 == 0 and w.nbytes >= numel * w.data.element_size() + 32


def test_flat_params_round_trip_through_any_range():
    m = model()
    flat = FlatParams(m)
    assert flat.numel == sum(p.numel() for p in m.parameters()) == 32
    full = torch.empty(flat.numel)
    flat.params_into(full)
    assert torch.equal(full, torch.cat([p.detach().reshape(-1) for p in m.parameters()]))
    for lo, hi in [(0, 32), (2, 17), (14, 16), (20, 32), (5, 5)]:   # cuts through tensors
        part = torch.empty(hi - lo)
        flat.params_into(part, lo, hi)
        assert torch.equal(part, full[lo:hi])
        flat.load(part + 1, lo, hi)
        again = torch.empty(flat.numel)
        flat.params_into(again)
        assert torch.equal(again[lo:hi], full[lo:hi] + 1)
        flat.load(full)


def test_missing_gradients_count_as_zero():
    m = model()
    flat = FlatParams(m)
    m[0].weight.grad = torch.ones_like(m[0].weight)
    g = torch.full((flat.numel,), 9.0)
    flat.grads_into(g)
    assert torch.equal(g[:15], torch.ones(15)) and torch.equal(g[15:], torch.zeros(17))


def test_average_in_order_is_left_to_right():
    parts = [torch.tensor([1e8]), torch.tensor([1.0]), torch.tensor([-1e8])]
    out = torch.empty(1)
    # (1e8 + 1) - 1e8 in float32 is 0: proves the order, not just the value
    assert float(average_in_order(parts, out)) == 0.0


def test_flat_shard_keeps_only_its_slice_of_optimizer_state():
    m = model()
    flat = FlatParams(m)
    shard = FlatShard(flat, 10, 21, lambda p: torch.optim.Adam(p, lr=0.1))
    out = torch.empty(11)
    shard.apply(torch.ones(11), out)
    assert shard.state_numel() == 2 * 11
    full = torch.empty(flat.numel)
    flat.params_into(full)
    assert torch.allclose(out, full[10:21] - 0.1)          # Adam's first step: lr * sign
    state = shard.state_dict()
    other = FlatShard(flat, 0, 11, lambda p: torch.optim.Adam(p, lr=0.1))
    with pytest.raises(PsrtError, match=r"holds parameter range \[10, 21\) but this rank serves \[0, 11\)"):
        other.load_state_dict(state, "test")


def test_model_shard_steps_the_models_own_parameters():
    m = model()
    flat = FlatParams(m)
    holder = ModelShard(flat, lambda p: torch.optim.SGD(p, lr=0.5))
    before = torch.empty(flat.numel)
    flat.params_into(before)
    out = torch.empty(flat.numel)
    holder.apply(torch.ones(flat.numel), out)
    assert torch.allclose(out, before - 0.5)
    after = torch.empty(flat.numel)
    flat.params_into(after)
    assert torch.equal(after, out)


def _ps(size, **options):
    return ParameterServer._layout(None, size, PSOptions(**options))


def _sh(size, **options):
    return ShardedParameterServer._layout(None, size, ShardedPSOptions(**options))


def test_layouts():
    assert _ps(4) == ([0], [0, 1, 2, 3])
    assert _ps(4, servers=0) == ([0], [0, 1, 2, 3])
    assert _ps(4, servers=1) == ([3], [0, 1, 2])
    assert _sh(4) == ([0, 1, 2, 3], [0, 1, 2, 3])
    assert _sh(4, shards=2) == ([0, 1], [0, 1, 2, 3])
    assert _sh(4, servers=2) == ([2, 3], [0, 1])


@pytest.mark.parametrize("layout,size,options,message", [
    (_ps, 4, {"servers": 2}, "use --dp ps-sharded"),
    (_ps, 1, {"servers": 1}, "needs at least 2 ranks"),
    (_sh, 4, {"servers": 4}, "leaves no worker among 4 ranks"),
    (_sh, 4, {"shards": 5}, "between 1 and the number of ranks"),
    (_sh, 4, {"servers": 2, "shards": 3}, "drop shards=3"),
])
def test_bad_layouts_are_one_line_errors(layout, size, options, message):
    with pytest.raises(PsrtError, match=message) as err:
        layout(size, **options)
    assert err.value.everywhere and "\n" not in str(err.value)


def test_sync_strategies_refuse_staleness():
    check_staleness(0, "ps")
    check_staleness(None, "ps")
    with pytest.raises(PsrtError, match="needs --dp ps-async"):
        check_staleness(2, "ps-sharded")

