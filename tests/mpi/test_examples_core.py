"""The collectives tour runs and shows right answers."""
import pytest

pytestmark = pytest.mark.mpi


def test_collectives_tour(run_ranks):
    run = run_ranks(4, "../../../examples/collectives_tour.py", timeout=120).check()
    out = run.stdout
    # allreduce sum of [r+1, 10(r+1)] over 4 ranks, shown once per rank
    assert out.count("->  [10.0, 100.0]") >= 4 + 1  # 4 from allreduce, 1 from reduce's root
    assert "[rank 3@" in out and "alltoall" in out
    assert out.count("->  [42.0, 7.0]") == 4
