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


def test_own_model_example_with_a_server_and_with_the_ring(run_ranks):
    """examples/own_model.py: the user's model and DataLoader under psrt.data_parallel; ps with a
    dedicated server (2 workers) and the ring (3 workers) train on the same global batches,
    so they print the same losses."""
    finals = {}
    for argv, workers in ((["--strategy", "ps", "--servers", "1"], 2), (["--strategy", "ring"], 3)):
        out = run_ranks(3, "../../../examples/own_model.py", "--epochs", "1", *argv, timeout=180).check().stdout
        assert f"{argv[1]}: {workers} workers of 3 ranks" in out, out
        done = [line for line in out.splitlines() if line.startswith("done:")]
        assert len(done) == 1 and f"done: {argv[1]}, 25 steps" in done[0], out
        finals[argv[1]] = float(done[0].split("final loss ")[1].split(",")[0])
    assert finals["ps"] == pytest.approx(finals["ring"], abs=2e-4) and finals["ring"] < 1.0   # ln 3 = 1.10 at start
