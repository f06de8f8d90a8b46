"""Model profiles (psrt/train/profile.py) without MPI: the format and its refusals, the
times each layer's gradients are due, time dilation, the shipped profiles' sizes against the
published ones, and the emulated model's gradients appearing when the profile says."""
import json
import math
import time

import pytest

from psrt.errors import PsrtError
from psrt.train import architectures, profile


def small(times=(0.01, 0.02, 0.03)):
    return {"name": "t", "batch": 8, "layers": [
        {"name": f"l{i}", "forward_s": t / 2, "backward_s": t, "params": [["weight", [4, 3]], ["bias", [4]]]}
        for i, t in enumerate(times)]}


def test_gradients_are_due_in_reverse_layer_order():
    p = profile.from_dict(small(), "x")
    assert p.numel == 3 * 16 and p.grad_bytes() == 4 * 48
    # backward runs l2, l1, l0: l2's gradients after 0.03 s, l1's after 0.05, l0's after 0.06
    assert p.gradient_times() == pytest.approx([0.06, 0.05, 0.03])
    assert p.forward_ends() == pytest.approx([0.005, 0.015, 0.03])
    # linear in the micro-batch: half the samples, half the time
    assert p.gradient_times(4) == pytest.approx([0.03, 0.025, 0.015])
    assert p.compute_s(16) == pytest.approx(2 * 0.09)


def test_dilation_scales_time_and_divides_bytes():
    p = profile.from_dict(small(), "x").dilated(10, byte_divisor=4)
    assert p.backward_s == pytest.approx(0.6) and p.dilation == 10 and p.byte_scale == 0.25
    assert [s for _, s in p.layers[0].params] == [(3,), (1,)]      # ceil(12/4), ceil(4/4)
    with pytest.raises(PsrtError, match="time dilation"):
        p.dilated(0)
    with pytest.raises(PsrtError, match="byte divisor"):
        p.dilated(2, 0.5)


def test_round_trip_through_a_file(tmp_path):
    p = profile.from_dict(small(), "x").dilated(2)
    path = tmp_path / "p.json"
    p.save(str(path))
    assert profile.load(str(path)) == p


@pytest.mark.parametrize("change,words", [
    (lambda d: d.pop("layers"), "missing 'layers'"),
    (lambda d: d.update(batch=0), "batch 0"),
    (lambda d: d["layers"][1].update(backward_s=-1), "layer 'l1': backward_s -1"),
    (lambda d: d["layers"][0]["params"].append(["weight", [2]]), "'l0.weight' is listed twice"),
    (lambda d: d["layers"][0]["params"].append(["w", [2, 0]]), "a parameter is [name, [positive dims...]]"),
    (lambda d: [l.update(params=[]) for l in d["layers"]], "no layer has parameters"),
    (lambda d: d.update(format="other/2"), "format 'other/2'"),
])
def test_bad_profiles_are_one_line(change, words):
    d = small()
    change(d)
    with pytest.raises(PsrtError) as err:
        profile.from_dict(d, "mine.json")
    assert words in str(err.value) and "\n" not in str(err.value)


def test_bad_names_and_files(tmp_path):
    with pytest.raises(PsrtError, match="choose one of bert-base, gpt2-small, resnet50, vgg16"):
        profile.load("vgg19")
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(PsrtError, match="not JSON"):
        profile.load(str(bad))
    with pytest.raises(PsrtError, match="cannot read"):
        profile.load(str(tmp_path / "none.json"))


# Published parameter counts (the papers of architectures.SOURCES).
PUBLISHED = {"vgg16": 138.36e6, "resnet50": 25.56e6, "gpt2-small": 124.44e6, "bert-base": 109.48e6}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shipped_profiles_match_their_architectures(name):
    shipped = profile.load(name)
    assert math.isclose(shipped.numel, PUBLISHED[name], rel_tol=2e-3)
    assert shipped == profile.from_dict(json.loads(json.dumps(architectures.profile(name).to_dict())), name)
    assert shipped.backward_s == pytest.approx(2 * shipped.forward_s)
    assert shipped.source and shipped.device


def test_resnet50_forward_flops_are_the_published_ones():
    # He et al. 2016, Table 1: 3.8e9 multiply-adds for ResNet-50 (torchvision's v1.5 4.1e9)
    gflop = architectures.profile("resnet50").notes["forward_gflop_per_sample"]
    assert 7.6 <= gflop <= 8.3


def test_emulated_gradients_appear_when_the_profile_says():
    """Fails if every gradient appeared at once: each layer's arrive after its due time,
    spread over the backward as the profile spreads them."""
    import torch
    import torch.nn.functional as F
    from psrt.train.emulated import ProfileModel
    p = profile.from_dict(small((0.04, 0.04, 0.04)), "x")
    model = ProfileModel(p, classes=10)
    seen, start = {}, []
    for name, q in model.named_parameters():
        q.register_post_accumulate_grad_hook(lambda q, name=name: seen.update({name: time.perf_counter()}))
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    t0 = time.perf_counter()
    out = model(x)
    assert time.perf_counter() - t0 >= p.forward_s * 0.95
    loss = F.cross_entropy(out, y)
    b0 = time.perf_counter()
    loss.backward()
    due = p.gradient_times()
    for i in range(3):
        at = seen[f"layers.{i}.weight"] - b0
        assert at >= due[i] - 0.002, (i, at, due)
    # the last layer's gradients come well before the first's (two layers' backward, 0.08 s, less a
    # late start on a loaded host)
    assert seen["layers.0.weight"] - seen["layers.2.weight"] >= 0.04
    assert [layer for layer, _ in model.clock.log] == [2, 1, 0]
    # evaluation waits for nothing
    with torch.no_grad():
        t0 = time.perf_counter()
        model(x)
        assert time.perf_counter() - t0 < 0.5 * p.forward_s


@pytest.mark.parametrize("argv,words", [
    (["--real-arithmetic"], "--real-arithmetic changes a profile's emulated compute: it needs --profile"),
    (["--time-dilation", "3"], "--time-dilation changes a profile's emulated compute"),
    (["--profile", "vgg16", "--time-dilation", "0"], "--time-dilation 0.0: must be a positive finite number"),
    (["--profile", "vgg16", "--byte-divisor", "0.5"], "--byte-divisor 0.5: must be a finite number of at least 1"),
    (["--profile", "vgg16", "--model", "transformer", "--pp", "2"], "--profile emulates the whole model on every rank"),
    (["--profile", "vgg16", "--model", "transformer"], "use --data digits or synthetic"),
    (["--profile", "vgg16", "--width", "32"], "--width shapes --model"),
    (["--profile", "x.json", "--real-arithmetic", "--byte-divisor", "4"], "--byte-divisor resizes"),
    (["--profile", "nope"], "--profile 'nope': choose one of"),
])
def test_the_profile_flags_refuse_in_one_line(argv, words):
    from psrt.train.config import parse_args
    with pytest.raises(PsrtError) as err:
        parse_args(argv)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_the_profile_flags_accept_a_dilated_profile():
    from psrt.train.config import parse_args
    cfg = parse_args(["--profile", "resnet50", "--time-dilation", "3.125", "--byte-divisor", "8"])
    assert (cfg.profile, cfg.time_dilation, cfg.byte_divisor) == ("resnet50", 3.125, 8.0)
