"""Every collective, algorithm, op, dtype and size on 1-8 ranks, against a NumPy reference
and the MPI library's own result (see tests/mpi/collectives_matrix.py)."""
import pytest

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("np_", [1, 2, 3, 4, 5, 8])
def test_collectives_matrix(run_ranks, np_):
    extra = ["--torch"] if np_ in (1, 2, 3, 4) else []
    run = run_ranks(np_, "collectives_matrix.py", *extra, timeout=600).check()
    records = run.records()
    assert sorted(r["rank"] for r in records) == list(range(np_))
    for rec in records:
        assert rec["failures"] == [], f"rank {rec['rank']}: {rec['failures']}"
        # guard against a matrix that silently shrank: every collective ran many cases
        assert rec["ran"]["allreduce"] >= 800 and rec["ran"]["reduce_scatter"] >= 500
        assert rec["ran"]["allgather"] >= 200 and rec["ran"]["nonblocking"] >= 30
        for name in ("broadcast", "reduce", "gather", "scatter", "alltoall", "inplace",
                     "noncontiguous", "barrier", "float-rounding"):
            assert rec["ran"].get(name, 0) > 0, name
