"""The DP x PP x TP grid: layout formula and validation (pure), and every factorisation of
4 ranks under MPI (tests/mpi/ranks/grid_layout.py; the pytest process itself never joins MPI)."""
import itertools

from psrt.grid import coords_of, edp_ranks, ep_ranks, rank_of


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
        assert r["traced"] == [["allreduce", 12]] * 5        # the grid's tracer reached all five groups
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
    # ep carved out of dp (the pure layout of tests/unit/test_grid_layout.py, under MPI)
    ep_cases = [r for r in recs if "ep_degrees" in r]
    assert len(ep_cases) == 4 * 4
    assert {tuple(r["ep_degrees"]) for r in ep_cases} == {(2, 1, 2, 2), (2, 2, 1, 2), (4, 1, 1, 2), (4, 1, 1, 4)}
    for r in ep_cases:
        dp, pp, tp, ep = r["ep_degrees"]
        want = ep_ranks(r["rank"], dp, pp, tp, ep)
        assert r["ep"] == want and r["edp"] == edp_ranks(r["rank"], dp, pp, tp, ep), r
        assert r["ep_rank"] == want.index(r["rank"]) and r["ep_sum"] == float(sum(want))
