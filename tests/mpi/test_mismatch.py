"""Disagreeing collective calls become an error on every rank that names the ranks."""
import pytest

pytestmark = pytest.mark.mpi


def test_mismatches_are_reported_on_every_rank(run_ranks):
    run = run_ranks(3, "mismatch.py", timeout=120).check()
    records = run.records()
    assert len(records) == 3
    expect = {"shape": ("ranks [1]", "numel=5"), "dtype": ("ranks [2]", "torch.float64"),
              "op": ("ranks [1, 2]", "op=max"), "root": ("ranks [1]", "root=1"),
              "order": ("ranks [1]", "broadcast("), "allgather-row": ("ranks [1, 2]", "(2, 2)"),
              "later-call": ("ranks [1]", "numel=6")}
    for rec in records:
        for case, (who, what) in expect.items():
            res = rec["results"][case]
            assert res["raised"], f"rank {rec['rank']} case {case}: no error"
            assert who in res["message"] and what in res["message"], (case, res["message"])
            assert res["seconds"] < 1.0, (case, res["seconds"])
