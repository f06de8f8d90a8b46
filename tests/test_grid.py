"""The DP x PP x TP grid: layout formula and validation (pure), and every factorisation of
4 ranks under MPI (tests/mpi/grid_layout.py; the pytest process itself never joins MPI)."""
import itertools

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


def test_every_factorisation_of_four_ranks(run_ranks):
    recs = run_ranks(4, "grid_layout.py", timeout=240).check().records()
    errors = [r for r in recs if "mismatch" in r]
    assert len(errors) == 4
    for r in errors:   # the grid refuses a layout that does not fit, in one line, on every rank
        assert r["mismatch"] == ("process grid dp=2 x pp=2 x tp=2 does not fit 4 ranks "
                                 "(dp x pp x tp = 8; it must equal the number of ranks)")
        assert r["build"] == ("process grid pp=3 x tp=1 does not divide 4 ranks: "
                              "dp = 4 / 3 is not a whole number")
        assert r["inferred"] == [2, 1, 2]
    cases = {(tuple(r["degrees"]), r["rank"]): r for r in recs if "degrees" in r}
    facts = [(d, p, 4 // (d * p)) for d, p in itertools.product(range(1, 5), repeat=2) if 4 % (d * p) == 0]
    assert len(cases) == 4 * len(facts)
    from mpi4py import MPI
    null = MPI.PROC_NULL
    for (dp, pp, tp), rank in itertools.product(facts, range(4)):
        r = cases[((dp, pp, tp), rank)]
        d, p, t = coords_of(rank, dp, pp, tp)
        assert r["grid_rank"] == rank and r["coords"] == [d, p, t] == r["ranks"]
        want = {"dp": [rank_of(i, p, t, dp, pp, tp) for i in range(dp)],
                "pp": [rank_of(d, i, t, dp, pp, tp) for i in range(pp)],
                "tp": [rank_of(d, p, i, dp, pp, tp) for i in range(tp)]}
        assert r["members"] == want
        assert r["sums"] == {a: float(sum(v)) for a, v in want.items()}
        assert r["first"] == (p == 0) and r["last"] == (p == pp - 1)
        assert r["pp_prev"] == (p - 1 if p > 0 else null) and r["pp_next"] == (p + 1 if p < pp - 1 else null)
        assert r["from_prev"] == (rank_of(d, p - 1, t, dp, pp, tp) if p > 0 else None)
