"""--precision bf16 and fp16: autocast compute on fp32 master weights, fp16 with loss scaling
whose overflow decision every rank shares (psrt/dp/precision.py).

- An inf on one rank's gradient, and a sum that overflows only once two ranks' finite
  gradients meet, make every rank, servers included, skip that step and halve the scale, and
  every worker stays equal to one process that skipped it (tests/mpi/ranks/loss_scale.py:
  ring, zero1/2/3, ps, ps-sharded with 2 dedicated servers, ps-async, horovod where installed,
  at N = 4; the shard-checking zero stages and the sharded servers diverge without the
  agreement).  The sharded states then load on 3 ranks with their scale.
- bf16 and fp16 runs of every data-parallel strategy (ps, ps-sharded, ps-async, ring, zero1/2/3,
  horovod where installed) train on digits: the loss falls, and the run reaches the fp32 run's
  test accuracy within 1.5 points; the text transformer's fp32 test loss within 3% (16-bit
  rounding of activations and, by default, of the gradients on the wire: a few 1e-3
  relative per step, not more).
"""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.mpi


SCALED = ("ring", "zero1", "zero2", "zero3", "ps", "ps-sharded", "ps-async")
SCALES = [1024.0, 512.0, 512.0, 256.0, 256.0, 256.0, 512.0]


@pytest.fixture(scope="module")
def loss_scale_records():
    from conftest import launch_ranks
    return launch_ranks(4, "loss_scale.py", timeout=300).check().records()


def test_an_overflow_on_one_rank_is_skipped_by_every_rank(loss_scale_records):
    """Workers and servers alike skip the step where one rank's gradient overflowed and the
    one where only the sum of two ranks' gradients did, and halve the scale both times; the
    workers end where one process that skipped those steps does."""
    recs = [r for r in loss_scale_records if "dp" in r]
    got = sorted({r["dp"] for r in recs})
    assert set(SCALED) <= set(got) and set(got) <= set(SCALED) | {"horovod"}, got
    for dp in got:
        mine = [r for r in recs if r["dp"] == dp]
        assert sorted(r["rank"] for r in mine) == [0, 1, 2, 3], mine
        servers = {"ps-sharded": 2, "ps-async": 1}.get(dp, 0)
        assert sum(not r["worker"] for r in mine) == servers, mine
        for r in mine:
            assert r["scale"] == 512.0 and r["skipped"] == 2, r
            if r["worker"]:
                assert r["scales"] == SCALES and r["max_abs"] <= 1e-6, r
            if "server" in r:
                assert r["server"] == {"scale": 512.0, "good_steps": 0, "skipped": 2}, r
    assert sum("server" in r for r in recs if r["dp"] == "ps") == 1          # rank 0 serves and works


def test_a_scaled_sharded_state_loads_on_three_ranks(loss_scale_records):
    """zero1/2/3 and ps-sharded (2 dedicated servers -> 1): the parameters and the loss scale
    with its counters come back on 3 ranks into a fresh scaler and another initial model."""
    recs = [r for r in loss_scale_records if "reloaded" in r]
    assert sorted((r["reloaded"], r["rank"]) for r in recs) == [
        (d, k) for d in ("ps-sharded", "zero1", "zero2", "zero3") for k in range(3)]
    for r in recs:
        assert r["scaler"] == {"scale": 512.0, "good_steps": 0, "skipped": 2}, r
        assert r["max_abs"] == 0.0, r


DIGITS = ("ring", "zero1", "zero2", "zero3", "ps", "ps-sharded", "ps-async")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch per task and precision, every data-parallel strategy trained in it: digits
    with each of DIGITS (horovod too where it is installed), the text transformer with ring."""
    import importlib.util
    from conftest import launch_ranks
    digits = DIGITS + (("horovod",) if importlib.util.find_spec("horovod") else ())
    out = {}
    base = tmp_path_factory.mktemp("precision")
    for task, argv in (("digits", ["--dp", ",".join(digits), "--steps", "60"]),
                       ("text", ["--dp", "ring", "--model", "transformer", "--steps", "10"])):
        for p in ("fp32", "bf16", "fp16"):
            metrics = base / f"{task}-{p}.jsonl"
            run = launch_ranks(2, "-m", "psrt.train", *argv, "--precision", p, "--quiet", "--metrics", str(metrics),
                               timeout=400).check()
            rows = {}
            for path in base.glob(f"{task}-{p}*.jsonl"):
                lines = [json.loads(line) for line in path.read_text().splitlines()]
                rows[lines[-1]["dp"]] = dict(lines[-1], losses=[r["loss"] for r in lines if not r.get("summary")])
            out[task, p] = (rows, run.stdout)
    return out


@pytest.mark.parametrize("p", ("bf16", "fp16"))
def test_16_bit_training_reaches_fp32_accuracy(runs, p):
    """Every strategy trains in 16 bits: its loss falls to under half its first value, and it
    lands within 1.5 points of fp32's test accuracy and 10% of its test loss (a few 1e-3 of
    rounding per step in the activations and the gradients on the wire: 16-bit runs follow
    their own path, not fp32's, but to the same place)."""
    ref, _ = runs["digits", "fp32"]
    got, stdout = runs["digits", p]
    assert set(got) == set(ref) and set(DIGITS) <= set(got), sorted(got)
    for dp, row in got.items():
        losses = row["losses"]
        assert len(losses) == 60 and losses[-1] < 0.5 * losses[0], (dp, losses[0], losses[-1])
        assert row["test_acc"] >= ref[dp]["test_acc"] - 0.015, (dp, row["test_acc"], ref[dp]["test_acc"])
        assert row["test_loss"] == pytest.approx(ref[dp]["test_loss"], rel=0.10), dp
    # Gradients travel in 16 bits: ring's all-reduce halves; zero3's two all-gathers carry the
    # fp32 master weights and only its reduce-scatter halves: (2 + 1/2) / 3 of the fp32 bytes.
    for dp, wire in (("ring", 1 / 2), ("zero3", 2.5 / 3)):
        assert got[dp]["bytes_per_rank"] == pytest.approx(ref[dp]["bytes_per_rank"] * wire, rel=0.01)
    text_ref, _ = runs["text", "fp32"]
    text, _ = runs["text", p]
    assert text["ring"]["test_loss"] == pytest.approx(text_ref["ring"]["test_loss"], rel=0.03)
    if p == "fp16":
        # 60 steps are far from GradScaler's 2000 good steps: the scale only ever halved, once
        # per skipped step, and the summary says so for every strategy.
        for dp, row in got.items():
            assert row["loss_scale"] == 2.0 ** 16 / 2 ** row["skipped_steps"], (dp, row)
            assert row["skipped_steps"] <= 5, (dp, row)
            assert (f"{dp}: fp16 loss scaling skipped {row['skipped_steps']} of 60 steps (every rank the "
                    f"same ones); the scale is now {row['loss_scale']:g}") in stdout
    else:
        assert all("loss_scale" not in row for row in got.values())


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
