"""--precision bf16 and fp16: autocast compute on fp32 master weights, fp16 with loss scaling
whose overflow decision every rank shares (psrt/dp/precision.py).

- An inf on one rank's gradient shard makes every rank skip that step and halve the scale,
  and every rank stays equal to one process that skipped it (tests/mpi/ranks/loss_scale.py:
  ring, zero2, zero3 at N = 3; the shard-checking zero stages diverge without the agreement).
- bf16 and fp16 runs reach the fp32 run's test accuracy on digits within 1.5 points, and the
  fp32 test loss on the text transformer within 3% (16-bit rounding of activations and, by
  default, of the gradients on the wire: a few 1e-3 relative per step, not more).
"""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.mpi


def test_an_overflow_on_one_rank_is_skipped_by_every_rank():
    from conftest import launch_ranks
    recs = launch_ranks(3, "loss_scale.py").check().records()
    assert sorted((r["dp"], r["rank"]) for r in recs) == [(d, k) for d in ("ring", "zero2", "zero3") for k in range(3)]
    for r in recs:
        assert r["scales"] == [1024.0, 512.0, 512.0, 512.0, 1024.0], r
        assert r["skipped"] == 1 and r["max_abs"] <= 1e-6, r


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from conftest import launch_ranks
    out = {}
    base = tmp_path_factory.mktemp("precision")
    for task, argv in (("digits", ["--dp", "ring,zero3", "--steps", "100"]),
                       ("text", ["--dp", "ring", "--model", "transformer", "--steps", "10"])):
        for p in ("fp32", "bf16", "fp16"):
            metrics = base / f"{task}-{p}.jsonl"
            run = launch_ranks(2, "-m", "psrt.train", *argv, "--precision", p, "--quiet", "--metrics", str(metrics),
                               timeout=300).check()
            rows = {}
            for path in base.glob(f"{task}-{p}*.jsonl"):
                last = json.loads(path.read_text().splitlines()[-1])
                rows[last["dp"]] = last
            out[task, p] = (rows, run.stdout)
    return out


@pytest.mark.parametrize("p", ("bf16", "fp16"))
def test_16_bit_training_reaches_fp32_accuracy(runs, p):
    ref, _ = runs["digits", "fp32"]
    got, stdout = runs["digits", p]
    # Gradients travel in 16 bits: ring's all-reduce halves; zero3's two all-gathers carry the
    # fp32 master weights and only its reduce-scatter halves: (2 + 1/2) / 3 of the fp32 bytes.
    for dp, wire in (("ring", 1 / 2), ("zero3", 2.5 / 3)):
        assert got[dp]["test_acc"] >= ref[dp]["test_acc"] - 0.015, (dp, got[dp]["test_acc"], ref[dp]["test_acc"])
        assert got[dp]["bytes_per_rank"] == pytest.approx(ref[dp]["bytes_per_rank"] * wire, rel=0.01)
    text_ref, _ = runs["text", "fp32"]
    text, _ = runs["text", p]
    assert text["ring"]["test_loss"] == pytest.approx(text_ref["ring"]["test_loss"], rel=0.03)
    if p == "fp16":
        assert got["ring"]["skipped_steps"] >= 0 and got["ring"]["loss_scale"] > 0
        assert "fp16 loss scaling skipped" in stdout


def test_fp16_under_pipeline_and_tensor_parallelism(tmp_path):
    """--pp 2 --tp 2 (sequence-parallel) with fp16: the stages compute under autocast, the loss
    is scaled, every rank steps the optimizer; the test loss within 3% of fp32's."""
    from conftest import launch_ranks
    got = {}
    for p in ("fp32", "fp16"):
        metrics = tmp_path / f"{p}.jsonl"
        run = launch_ranks(4, "-m", "psrt.train", "--pp", "2", "--tp", "2", "--sequence-parallel", "--model",
                           "transformer", "--steps", "6", "--accum", "2", "--precision", p, "--quiet",
                           "--metrics", str(metrics), timeout=300).check()
        got[p] = [json.loads(line) for line in metrics.read_text().splitlines()]
        if p == "fp16":
            assert "fp16 loss scaling skipped" in run.stdout
    losses = {p: [r["loss"] for r in rows if "loss" in r and not r.get("summary")] for p, rows in got.items()}
    assert len(losses["fp16"]) == 6
    assert losses["fp16"] == pytest.approx(losses["fp32"], rel=0.03)
