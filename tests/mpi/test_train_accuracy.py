"""A short run on real data (scikit-learn's digits) learns: >= 90% test accuracy for the
parameter server and the ring, which also agree with each other step for step."""
import json

import pytest

pytestmark = pytest.mark.mpi


def test_ps_and_ring_learn_digits(run_ranks, tmp_path):
    metrics = tmp_path / "m.jsonl"
    run_ranks(2, "-m", "psrt.train", "--dp", "ps,ring", "--epochs", "3", "--quiet",
              "--metrics", str(metrics), timeout=300).check()
    summaries = {}
    losses: dict = {}
    for dp in ("ps", "ring"):
        path = tmp_path / f"m.{dp}.jsonl"   # with several strategies, one file each
        lines = [json.loads(x) for x in open(path) if x.strip()]
        summaries[dp] = next(x for x in lines if x.get("summary") and x["dp"] == dp)
        losses[dp] = [x["loss"] for x in lines if not x.get("summary") and x["dp"] == dp]
    for dp, s in summaries.items():
        assert s["test_acc"] >= 0.90, (dp, s)
    # same data, same model, same updates: the loss curves agree (float rounding only)
    assert len(losses["ps"]) == len(losses["ring"]) > 50
    assert max(abs(a - b) for a, b in zip(losses["ps"], losses["ring"])) < 1e-4
