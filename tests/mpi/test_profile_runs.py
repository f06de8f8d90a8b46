"""Emulated compute (--profile) changes when gradients appear, never what the strategies do
with them.  One launch per form, shared by the checks (module-scoped):

- the MLP trained plainly and trained with --real-arithmetic under a profile recorded from
  it and slowed down: the same final parameters, for ring, zero1 and ps;
- a profile alone (no arithmetic): every rank ends with the same parameters, for every
  strategy of a plain layout, and the gradients appeared in the last backward at the
  profile's times, layer by layer in reverse, not all at once.
"""
from __future__ import annotations

import pytest
import torch
from conftest import launch_ranks

from psrt.train import profile, recording

pytestmark = pytest.mark.mpi

NP = 4
CALLBACK = ["--callback", "tests.mpi.ranks.profile_digest:Digest"]
COMMON = ["-m", "psrt.train", "--width", "16", "--steps", "3", "--batch-size", "32", "--quiet", *CALLBACK]
SAME = "ring,zero1,ps"
EVERY = "ring,native,zero1,zero2,zero3,ps,ps-sharded"
LAYER_S = 0.02


def by(records, **match):
    return [r for r in records if all(r[k] == v for k, v in match.items())]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The MLP's profile, recorded here on the CPU, slowed so its waits dominate."""
    from psrt.train.imported import load_data, make_model
    from psrt.train.config import TrainConfig
    from psrt.train.models import loss_and_correct
    cfg = TrainConfig(width=16)
    data = load_data("digits")
    model = make_model(cfg, data)
    batch = (data.train_x[:8], data.train_y[:8])
    rec = recording.record(model, lambda: loss_and_correct(model, batch, "classify")[0], "mlp-w16", 8,
                           torch.device("cpu"), steps=2)
    slow = rec.dilated(LAYER_S / max(rec.backward_s / len(rec.layers), 1e-6))
    path = tmp_path_factory.mktemp("profile") / "mlp.json"
    slow.save(str(path))
    return path


@pytest.fixture(scope="module")
def plain():
    return launch_ranks(NP, *COMMON, "--dp", SAME).check().records()


@pytest.fixture(scope="module")
def timed(recorded):
    return launch_ranks(NP, *COMMON, "--dp", SAME, "--profile", str(recorded), "--real-arithmetic").check().records()


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    p = profile.from_dict({"name": "four", "batch": 8, "layers": [
        {"name": f"l{i}", "forward_s": LAYER_S / 2, "backward_s": LAYER_S,
         "params": [["weight", [32, 16 + i]], ["bias", [32]]]} for i in range(4)]}, "test")
    path = tmp_path_factory.mktemp("profile") / "four.json"
    p.save(str(path))
    run = launch_ranks(NP, "-m", "psrt.train", "--steps", "3", "--batch-size", "32", "--quiet", *CALLBACK,
                       "--dp", EVERY, "--profile", str(path))
    return p, run.check().records()


@pytest.mark.parametrize("dp", SAME.split(","))
def test_real_arithmetic_under_a_profile_ends_as_the_plain_run(plain, timed, dp):
    a, b = by(plain, dp=dp, rank=0), by(timed, dp=dp, rank=0)
    assert a and b
    assert b[0]["log"], "the profile timed no gradient"
    assert a[0]["numel"] == b[0]["numel"]
    assert b[0]["sums"] == pytest.approx(a[0]["sums"], rel=1e-6)


@pytest.mark.parametrize("dp", EVERY.split(","))
def test_profile_only_runs_leave_every_rank_the_same_parameters(emulated, dp):
    _, records = emulated
    mine = by(records, dp=dp)
    assert len(mine) == NP
    assert mine[0]["sums"][1] > 0
    assert {r["digest"] for r in mine} == {mine[0]["digest"]}, dp


def test_gradients_follow_the_profile_not_all_at_once(emulated):
    p, records = emulated
    due = p.gradient_times(32 // NP)
    for r in by(records, dp="ring", rank=1):
        log = r["log"]
        assert [layer for layer, _ in log] == [3, 2, 1, 0]
        for layer, at in log:
            assert at >= due[layer] - 0.002, (layer, at, due)
        # spread over the backward (a loaded host may start the first late: half the spread at least)
        assert log[-1][1] - log[0][1] >= 0.5 * (due[0] - due[3])
