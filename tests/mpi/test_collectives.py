"""Every collective, algorithm, op, dtype and size on 1-8 ranks, against a NumPy reference
and the MPI library's own result (see tests/mpi/ranks/collectives_matrix.py)."""
import pytest

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("np_", [1, 2, 3, 4, 5, 8])
def test_collectives_matrix(run_ranks, np_):
    extra = ["--torch"] if np_ in (2, 4) else []  # gloo set-up is slow; two sizes suffice
    if np_ >= 5:  # these sizes exercise the topology (folds, uneven rings), not every dtype
        extra += ["--dtypes", "float32,bfloat16,int64,uint8"]
    run = run_ranks(np_, "collectives_matrix.py", *extra, timeout=900).check()
    records = run.records()
    assert sorted(r["rank"] for r in records) == list(range(np_))
    for rec in records:
        assert rec["failures"] == [], f"rank {rec['rank']}: {rec['failures']}"
        # guard against a matrix that silently shrank: every collective ran many cases
        assert rec["ran"]["allreduce"] >= 400 and rec["ran"]["reduce_scatter"] >= 250
        assert rec["ran"]["allgather"] >= 100 and rec["ran"]["nonblocking"] >= 30
        for name in ("broadcast", "reduce", "gather", "scatter", "alltoall", "inplace",
                     "noncontiguous", "barrier", "float-rounding"):
            assert rec["ran"].get(name, 0) > 0, name


@pytest.mark.parametrize("np_", [2, 3, 5])
def test_small_message_path_is_bitwise_the_torch_path(run_ranks, np_):
    """psrt/collectives/small.py against ring.py, recursive.py, tree.py and ps.py: same bits,
    and ranks on different paths still match (tests/mpi/ranks/small_paths.py)."""
    run = run_ranks(np_, "small_paths.py", timeout=240).check()
    records = run.records()
    assert len(records) == np_
    for rec in records:
        assert rec["failures"] == [], rec
        # algorithms x cases x (2 communicators x 3 repeats x 4 ways of calling + 1 mixed)
        assert rec["checked"] == 5 * (4 * 3 * 2 + 1) * (2 * 3 * 4 + 1)
        # buffers reduced again were made ready in place (bounded: the oldest are let go)
        assert all(b > 0 for b in rec["bound"]), rec


@pytest.mark.parametrize("np_", [1, 2, 3, 4, 5, 6, 7, 8])
def test_alltoallv_every_algorithm(run_ranks, np_):
    """Variable-size all-to-all, psrt's pairwise exchange and the MPI library's, on 1-8 ranks
    (tests/mpi/ranks/alltoallv.py); disagreeing counts are one error naming the ranks."""
    records = run_ranks(np_, "alltoallv.py", timeout=240).check().records()
    assert len(records) == np_
    for rec in records:
        assert rec["failures"] == [], rec
        if np_ > 1:
            assert rec["mismatch"].startswith(f"alltoallv: counts disagree between ranks (rank {np_ - 1} sends 1 "
                                              "rows to rank 0, which expects 2"), rec
