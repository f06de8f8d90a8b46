"""The DP x PP x TP grid's layout formula and validation (pure; tests/mpi/test_grid.py runs
every factorisation of 4 ranks)."""

import pytest

from psrt.errors import PsrtError
from psrt.grid import check_degrees, coords_of, rank_of


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


