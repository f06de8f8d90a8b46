"""DP x PP x TP (tests/mpi/ranks/hybrid_equivalence.py on 8 ranks as 2 x 2 x 2): several training
steps equal one process training the dense model on the whole batch (losses, every rank's
parameter shards and the reassembled model), with 1F1B + ring and interleaved + PS; the
grid coordinates and sub-communicators follow the TP-fastest layout."""

import pytest

from psrt.grid import rank_of


def test_2x2x2_matches_one_process(run_ranks):
    recs = run_ranks(8, "hybrid_equivalence.py", timeout=400).check().records()
    assert sorted((r["rank"], r["schedule"]) for r in recs) == \
        sorted((k, s) for k in range(8) for s in ("1f1b", "interleaved"))
    failures = [(r["rank"], r["schedule"], r["errors"]) for r in recs if r["errors"]]
    assert not failures
    for r in recs:
        assert r["checked"] > 0
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5, abs=4e-5)
        d, p, t = r["coords"]
        assert r["rank"] == rank_of(d, p, t, 2, 2, 2)
        assert r["tp_members"] == [rank_of(d, p, i, 2, 2, 2) for i in range(2)]
        assert r["dp_members"] == [rank_of(i, p, t, 2, 2, 2) for i in range(2)]
        assert r["pp_members"] == [rank_of(d, i, t, 2, 2, 2) for i in range(2)]


