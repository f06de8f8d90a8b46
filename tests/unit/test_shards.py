"""The ownership map of the sharded strategies (psrt.dp.shards) and the reshard of an
optimizer's state from one map to another, in one process: no MPI."""
import pytest
import torch

from psrt.dp.shards import ShardMap, assemble, reshard_optimizer
from psrt.dp.precision import LossScaler, ScaledOptimizer

UNITS = [7, 0, 13, 1, 10]          # an empty unit and units smaller than the owner count


@pytest.mark.parametrize("owners", (1, 2, 3, 4, 5))
def test_every_element_has_exactly_one_owner(owners):
    smap = ShardMap(UNITS, owners)
    assert smap.numel == sum(UNITS) and len(smap.units) == len(UNITS)
    hits = torch.zeros(smap.numel, dtype=torch.int64)
    for o in range(owners):
        ranges = smap.owned(o)
        assert len(ranges) == len(UNITS)
        for lo, hi in ranges:
            hits[lo:hi] += 1
        at = smap.shard_offsets(o)
        assert at[0] == 0 and at[-1] == smap.shard_numel(o) == sum(hi - lo for lo, hi in ranges)
    assert torch.equal(hits, torch.ones_like(hits))
    for u, size in zip(smap.units, UNITS):
        assert u.numel == size and sum(u.counts) == size
        assert max(u.counts) - min(u.counts) <= 1 and list(u.counts) == sorted(u.counts, reverse=True)
        # each owner's part of a unit is contiguous, in owner order
        assert [u.part(o) for o in range(owners)] == [(a, b) for (a, b) in zip(
            [u.lo] + [u.part(o)[1] for o in range(owners - 1)], [u.part(o)[1] for o in range(owners)])]


def test_a_one_unit_map_gives_the_parameter_servers_key_ranges():
    assert ShardMap([10], 3).ranges() == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(ValueError):
        ShardMap([5, 5], 2).ranges()
    with pytest.raises(ValueError):
        ShardMap([5], 0)


def test_assemble_puts_every_part_back_where_it_came_from():
    smap = ShardMap(UNITS, 3)
    whole = torch.arange(smap.numel, dtype=torch.float32)
    parts = [[whole[lo:hi].clone() for lo, hi in smap.owned(o)] for o in range(3)]
    assert torch.equal(assemble(smap, parts), whole)


def _states(smap: ShardMap, full: dict, scalars: dict, make=lambda opt: opt) -> list[dict]:
    """Each owner's optimizer state_dict, one parameter per unit part, as zero1/2/3 build them."""
    out = []
    for o in range(smap.owners):
        params = [torch.nn.Parameter(torch.zeros(hi - lo)) for lo, hi in smap.owned(o)]
        opt = make(torch.optim.Adam(params, lr=0.1, betas=(0.8, 0.9)))
        state = (opt.optimizer if hasattr(opt, "optimizer") else opt).state
        for p, (lo, hi) in zip(params, smap.owned(o)):
            state[p] = {**{k: v[lo:hi].clone() for k, v in full.items()}, **{k: v.clone() for k, v in scalars.items()}}
        out.append(opt.state_dict())
    return out


@pytest.mark.parametrize("old_n,new_n", [(4, 3), (2, 3), (3, 4), (1, 4), (4, 1)])
def test_an_adam_state_cut_for_another_number_of_owners_is_the_same_state(old_n, new_n):
    """Adam's two moments (one value per element) reassembled and cut again equal the slices
    of the whole moments under the new map; the step count (a scalar) and the param groups'
    hyper-parameters carry over; the result loads into the new owner's optimizer."""
    g = torch.Generator().manual_seed(0)
    full = {"exp_avg": torch.randn(sum(UNITS), generator=g), "exp_avg_sq": torch.rand(sum(UNITS), generator=g)}
    scalars = {"step": torch.tensor(7.0)}
    old, new = ShardMap(UNITS, old_n), ShardMap(UNITS, new_n)
    states = _states(old, full, scalars)
    for owner in range(new_n):
        got = reshard_optimizer(states, old, new, owner)
        assert got["param_groups"][0]["betas"] == (0.8, 0.9)
        assert got["param_groups"][0]["params"] == list(range(len(UNITS)))
        for i, (lo, hi) in enumerate(new.owned(owner)):
            assert torch.equal(got["state"][i]["step"], torch.tensor(7.0))
            for k, v in full.items():
                assert torch.equal(got["state"][i][k], v[lo:hi]), (owner, i, k)
        params = [torch.nn.Parameter(torch.zeros(hi - lo)) for lo, hi in new.owned(owner)]
        opt = torch.optim.Adam(params, lr=0.1)
        opt.load_state_dict(got)
        assert torch.equal(opt.state[params[2]]["exp_avg"], full["exp_avg"][slice(*new.owned(owner)[2])])


def test_a_fresh_optimizer_reshards_to_a_fresh_one():
    old, new = ShardMap(UNITS, 2), ShardMap(UNITS, 3)
    states = [torch.optim.SGD([torch.nn.Parameter(torch.zeros(hi - lo)) for lo, hi in old.owned(o)],
                              lr=0.1).state_dict() for o in range(2)]
    got = reshard_optimizer(states, old, new, 1)
    assert got["state"] == {} and got["param_groups"][0]["lr"] == 0.1


def test_sgd_momentum_and_the_loss_scale_survive_the_reshard():
    """A loss-scaled optimizer's state (psrt.dp.precision) carries its scaler beside it: the
    momentum is cut for the new map, the scale and its counters come as they were."""
    full = {"momentum_buffer": torch.arange(sum(UNITS), dtype=torch.float32)}
    scaler = LossScaler(None, init_scale=2.0 ** 10)
    scaler.update(True)
    scaler.update(False)

    def scaled(opt):
        return ScaledOptimizer(opt, scaler)
    old, new = ShardMap(UNITS, 4), ShardMap(UNITS, 2)
    states = _states(old, full, {}, make=scaled)
    got = reshard_optimizer(states, old, new, 0)
    assert got["scaler"] == {"scale": 512.0, "good_steps": 1, "skipped": 1}
    for i, (lo, hi) in enumerate(new.owned(0)):
        assert torch.equal(got["optimizer"]["state"][i]["momentum_buffer"], full["momentum_buffer"][lo:hi])
    fresh = LossScaler(None)
    params = [torch.nn.Parameter(torch.zeros(hi - lo)) for lo, hi in new.owned(0)]
    ScaledOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9), fresh).load_state_dict(got)
    assert fresh.state_dict() == scaler.state_dict()
