"""The DP x PP x TP grid's layout formula and validation (pure; tests/mpi/test_grid.py runs
every factorisation of 4 ranks)."""

import pytest

from psrt.errors import PsrtError
from psrt.grid import check_degrees, check_ep, coords_of, edp_ranks, ep_ranks, rank_of


def test_layout_formula_round_trips_and_tp_is_fastest():
    dp, pp, tp = 3, 2, 4
    seen = set()
    for r in range(dp * pp * tp):
        d, p, t = coords_of(r, dp, pp, tp)
        assert rank_of(d, p, t, dp, pp, tp) == r
        seen.add((d, p, t))
    assert len(seen) == dp * pp * tp
    # TP ranks are consecutive world ranks, then DP, then PP (Megatron's order).
    assert [coords_of(r, dp, pp, tp)[2] for r in range(tp)] == list(range(tp))
    assert [rank_of(d, 0, 0, dp, pp, tp) for d in range(dp)] == [0, 4, 8]
    assert [rank_of(0, p, 0, dp, pp, tp) for p in range(pp)] == [0, 12]


@pytest.mark.parametrize("degrees,size", [((2, 2, 2), 6), ((0, 2, 2), 0), ((2, 3, 1), 8)])
def test_check_degrees_names_every_degree(degrees, size):
    dp, pp, tp = degrees
    with pytest.raises(PsrtError) as err:
        check_degrees(dp, pp, tp, size)
    msg = str(err.value)
    assert f"dp={dp}" in msg and f"pp={pp}" in msg and f"tp={tp}" in msg and str(size) in msg
    assert "\n" not in msg




# Expert parallelism carved out of dp: (dp, pp, tp, ep) -> {rank: (ep group, edp group)},
# written out by hand from rank = (pp_rank * dp + dp_rank) * tp + tp_rank.
EP_LAYOUTS = {
    (4, 1, 1, 2): {0: ([0, 1], [0, 2]), 1: ([0, 1], [1, 3]), 2: ([2, 3], [0, 2]), 3: ([2, 3], [1, 3])},
    (4, 1, 1, 4): {0: ([0, 1, 2, 3], [0]), 3: ([0, 1, 2, 3], [3])},
    (4, 1, 1, 1): {0: ([0], [0, 1, 2, 3]), 2: ([2], [0, 1, 2, 3])},
    # pp 2: stage 0 is ranks 0-1, stage 1 ranks 2-3; a group never crosses a stage
    (2, 2, 1, 2): {0: ([0, 1], [0]), 1: ([0, 1], [1]), 2: ([2, 3], [2]), 3: ([2, 3], [3])},
    (2, 2, 1, 1): {0: ([0], [0, 1]), 3: ([3], [2, 3])},
    # tp 2: TP ranks are adjacent, so an ep group strides over them
    (2, 1, 2, 2): {0: ([0, 2], [0]), 1: ([1, 3], [1]), 2: ([0, 2], [2]), 3: ([1, 3], [3])},
    (4, 1, 2, 2): {0: ([0, 2], [0, 4]), 3: ([1, 3], [3, 7]), 5: ([5, 7], [1, 5]), 6: ([4, 6], [2, 6])},
    # pp 2 x dp 4: ep 2 leaves edp 2 inside each stage, ep 4 fills the stage
    (4, 2, 1, 2): {0: ([0, 1], [0, 2]), 5: ([4, 5], [5, 7]), 6: ([6, 7], [4, 6])},
    (4, 2, 1, 4): {1: ([0, 1, 2, 3], [1]), 6: ([4, 5, 6, 7], [6])},
    (2, 2, 2, 2): {0: ([0, 2], [0]), 5: ([5, 7], [5]), 7: ([5, 7], [7])},
}


@pytest.mark.parametrize("degrees", sorted(EP_LAYOUTS))
def test_expert_parallel_layout(degrees):
    dp, pp, tp, ep = degrees
    for rank, (ep_group, edp_group) in EP_LAYOUTS[degrees].items():
        assert ep_ranks(rank, dp, pp, tp, ep) == ep_group, rank
        assert edp_ranks(rank, dp, pp, tp, ep) == edp_group, rank
    # every rank: its ep_rank is its place in the ep group, the two groups cross once, and
    # together they are its dp group (same stage and TP rank)
    for rank in range(dp * pp * tp):
        group, replicas = ep_ranks(rank, dp, pp, tp, ep), edp_ranks(rank, dp, pp, tp, ep)
        d, p, t = coords_of(rank, dp, pp, tp)
        assert group.index(rank) == d % ep and set(group) & set(replicas) == {rank}
        assert len(group) * len(replicas) == dp
        assert {rank_of(e, p, t, dp, pp, tp) for e in range(dp)} == \
            {x for member in group for x in edp_ranks(member, dp, pp, tp, ep)}


@pytest.mark.parametrize("ep,dp", [(3, 4), (0, 2), (8, 4)])
def test_ep_must_divide_dp(ep, dp):
    with pytest.raises(PsrtError, match=f"--ep {ep} must divide the data-parallel degree {dp}"):
        check_ep(ep, dp)
