"""The step model of the scaling bench (psrt/bench/step_model.py) and its command line, without MPI."""
import argparse

import pytest

from psrt.bench import scaling, step_model
from psrt.collectives import cost
from psrt.errors import PsrtError

GBIT = cost.Links(cost.Fit(2e-6, 1 / 4e9, 1.0), cost.Fit(50e-6, 1 / 125e6, 1.0))


def test_ring_overlaps_backward_and_the_server_does_not():
    host_of = step_model.placement(4, 1)
    ring = step_model.predict_step("ring", 0.01, 0.02, host_of, 1 << 20, GBIT)
    ps = step_model.predict_step("ps", 0.01, 0.02, host_of, 1 << 20, GBIT)
    assert ring.step_s == pytest.approx(0.01 + max(0.02, ring.comm_s))
    assert ps.step_s == pytest.approx(0.03 + ps.comm_s)
    # the single server's link carries (N-1) x M each way, the ring 2(N-1)/N x M
    assert ps.comm_s > 2 * ring.comm_s


def test_hierarchical_and_local_aggregation_use_the_two_level_model():
    host_of = step_model.placement(2, 4)
    flat = step_model.comm_time("ring", host_of, 16 << 20, GBIT)
    hier = step_model.comm_time("ring-hier", host_of, 16 << 20, GBIT)
    assert hier == pytest.approx(cost.predict_two_level("hierarchical", host_of, 16 << 20, GBIT))
    assert 1.3 < flat / hier < 1.8             # the link bound on 2x4 is 1.75x
    assert step_model.comm_time("ring", [0], 1 << 20, GBIT) == 0.0


def test_weak_scaling_speedup():
    assert step_model.speedup(8, 0.1, 0.2) == pytest.approx(4.0)


def args(**kw):
    base = dict(quick=False, layouts="1x1,2x2", strategies="ring,ps", profiles="resnet50", rate="1gbit",
                stands_for="25gbit", steps=3, byte_divisor=8.0, bucket_mb=None, delay=None)
    return argparse.Namespace(**{**base, **kw})


def test_quick_fills_only_what_the_command_line_left():
    a = args(quick=True, layouts="1x1,2x1", strategies=scaling.DEFAULTS["strategies"],
             profiles=scaling.DEFAULTS["profiles"], steps=scaling.DEFAULTS["steps"])
    scaling.check(a)
    assert a.layouts == [(1, 1), (2, 1)] and a.strategies == ["ring", "zero1", "ps"] and a.steps == scaling.QUICK["steps"] == 8


def test_dilation_follows_the_rates_and_each_profile_gets_its_own_divisor():
    from psrt.train import profile
    a = args()
    scaling.check(a)
    assert a.layouts == [(1, 1), (2, 2)]
    assert scaling.scale_of(a, profile.load("resnet50")) == scaling.Scale(8.0, pytest.approx(25 / 8))
    # by default each profile's gradients are divided to about the same size: 97.5 MiB / 8
    # and 528 MiB / 32 against 16 MiB; gradients already under it are left whole
    a = args(byte_divisor=None, rate="250mbit")
    scaling.check(a)
    got = {name: scaling.scale_of(a, profile.load(name)) for name in ("resnet50", "vgg16", "gpt2-small", "bert-base")}
    assert {name: s.divisor for name, s in got.items()} == {"resnet50": 8, "vgg16": 32, "gpt2-small": 32, "bert-base": 32}
    assert got["resnet50"].dilation == pytest.approx(100 / 8) and got["vgg16"].dilation == pytest.approx(100 / 32)
    tiny = {"name": "t", "batch": 8, "layers": [{"name": "l", "forward_s": 0.01, "backward_s": 0.02,
                                                  "params": [["weight", [4, 3]]]}]}
    assert scaling.divisor_for(profile.from_dict(tiny, "x")) == 1.0


@pytest.mark.parametrize("change,words", [({"layouts": "2x2"}, "include 1x1"), ({"layouts": "1x3"}, "at least 2 hosts"),
                                          ({"strategies": "ps-async"}, "--strategies ps-async"),
                                          ({"rate": "fast"}, "expected tc rates"), ({"steps": 1}, "--steps 1")])
def test_bad_settings_are_one_line(change, words):
    with pytest.raises(PsrtError, match=words.replace("(", r"\(")):
        scaling.check(args(**change))


def test_presets_and_a_users_toml(tmp_path):
    from psrt.bench import presets, scaling_prediction
    from psrt.train import profile
    mine = tmp_path / "mine.toml"
    mine.write_text('name = "mine"\nper_node = 4\nintra_gbit_s = 256\nintra_alpha_us = 5\n'
                    'inter_gbit_s = 100\ninter_alpha_us = 10\nsource = "a sheet"\n')
    preset = presets.load(str(mine))
    assert preset["per_node"] == 4 and presets.links(preset).inter.bandwidth_bytes_s == pytest.approx(12.5e9)
    rows = scaling_prediction.rows(profile.load("vgg16"), preset, [32, 1024])
    by = {(r["workers"], r["strategy"]): r for r in rows}
    # the single server's link carries every worker's gradients: it stops scaling, the ring does not
    assert by[1024, "ring"]["speedup"] > 10 * by[1024, "ps"]["speedup"]
    assert by[32, "ring"]["nodes"] == 8
    for name in presets.PRESETS:
        assert presets.load(name)["source"]


@pytest.mark.parametrize("text,words", [('per_node = 4\n', "missing intra_gbit_s"),
                                        ('per_node = 0\nintra_gbit_s = 1\nintra_alpha_us = 1\ninter_gbit_s = 1\n'
                                         'inter_alpha_us = 1\n', "per_node 0 must be a positive number"),
                                        ('per_node = [', "cannot read it")])
def test_bad_presets_are_one_line(tmp_path, text, words):
    from psrt.bench import presets
    path = tmp_path / "p.toml"
    path.write_text(text)
    with pytest.raises(PsrtError, match=words):
        presets.load(str(path))
    with pytest.raises(PsrtError, match="choose one of emulated, dgx-a100, pcie-25g"):
        presets.load("dgx-h100")


def test_variants_share_a_launch_only_with_other_strategies():
    groups = scaling.launches(["ring", "ps", "ring-hier", "ps-local", "ring-auto"])
    assert groups == [["ring", "ps"], ["ring-hier", "ps-local"], ["ring-auto"]]
    host_of = step_model.placement(2, 4)
    auto = step_model.comm_time("ring-auto", host_of, 16 << 20, GBIT)
    assert auto == min(step_model.comm_time("ring", host_of, 16 << 20, GBIT),
                       step_model.comm_time("ring-hier", host_of, 16 << 20, GBIT))


def test_one_node_charges_the_links_inside_it():
    """On one node the flat ring's bytes cross each accelerator's own link inside the node: the
    same time as the hierarchical model's (which is the flat ring there), never a free ride."""
    from psrt.bench import presets
    from psrt.bench.step_model import comm_time, placement
    links = presets.links(presets.load("pcie-25g"))
    one_node = placement(1, 4)
    ring, hier = comm_time("ring", one_node, 512 << 20, links), comm_time("ring-hier", one_node, 512 << 20, links)
    assert ring == pytest.approx(hier, rel=1e-6) and ring > 0.03          # 2 x 3/4 x 512 MiB at 15.75 GB/s
    assert comm_time("ps", one_node, 512 << 20, links) == pytest.approx(
        comm_time("ps-local", one_node, 512 << 20, links), rel=1e-6)


def test_psrt_info_predicts_for_the_jobs_own_placement():
    """psrt.info --predict: the job's hosts, in the order of their first rank, become the
    preset's nodes; one row per strategy, every row on that placement."""
    from psrt.info import predicted
    records = [{"rank": r, "hostname": h} for r, h in enumerate(["b", "b", "a", "a"])]
    lines = predicted(records, "pcie-25g", "resnet50")
    assert lines[0].startswith("predicted on pcie-25g's links") and "resnet50" in lines[0]
    table = lines[3:]
    assert len(table) == 7 and all(" 4 " in row and " 2 " in row for row in table), table
    ring = next(row for row in table if row.split()[4] == "ring")
    hier = next(row for row in table if row.split()[4] == "ring-hier")
    assert float(ring.split()[5]) > float(hier.split()[5])    # 2 nodes on 25 Gbit/s: the two-level ring wins


# ---------------------------------------------------------------- buckets during backward
def _profile(layers):
    """A profile of (name, elements, backward seconds) layers, forward 1 ms each."""
    from psrt.train.profile import Layer, Profile
    return Profile("t", 8, tuple(Layer(n, ((f"{n}.w", (k,)),), 1e-3, b) for n, k, b in layers))


def test_buckets_follow_backward_order_and_ready_when_their_last_gradient_appears():
    # backward runs c, b, a: c's gradient at 1 ms, b's at 3 ms, a's at 6 ms
    prof = _profile([("a", 1000, 3e-3), ("b", 1000, 2e-3), ("c", 3000, 1e-3)])
    got = step_model.gradient_buckets(prof, 8000)      # at least 8000 B: c (12000 B), then b + a
    assert got == [(pytest.approx(1e-3), 12000), (pytest.approx(6e-3), 8000)]
    assert step_model.gradient_buckets(prof, 1 << 30) == [(pytest.approx(6e-3), 20000)]


def test_one_bucket_hides_nothing_and_early_buckets_hide_behind_backward():
    host_of = step_model.placement(4, 1)
    comm = step_model.comm_time("ring", host_of, 1 << 20, GBIT)
    one = step_model.predict_step("ring", 0.01, 0.02, host_of, 1 << 20, GBIT, [(0.02, 1 << 20)])
    assert one.step_s == pytest.approx(0.01 + 0.02 + comm)
    # four quarter buckets ready through backward: only what is left after backward shows
    quarters = [(0.005 * (i + 1), 1 << 18) for i in range(4)]
    four = step_model.predict_step("ring", 0.01, 0.02, host_of, 1 << 20, GBIT, quarters)
    each = step_model.comm_time("ring", host_of, 1 << 18, GBIT)
    end = 0.0
    for ready, _ in quarters:
        end = max(end, ready) + each
    assert four.step_s == pytest.approx(0.01 + max(0.02, end))
    assert four.comm_s == pytest.approx(4 * each)
    assert four.step_s < one.step_s
    # the servers push after backward whatever the buckets
    ps = step_model.predict_step("ps", 0.01, 0.02, host_of, 1 << 20, GBIT, quarters)
    assert ps.step_s == pytest.approx(0.03 + step_model.comm_time("ps", host_of, 1 << 20, GBIT))


def test_every_cell_of_several_workers_pays_the_host_work_one_worker_measured():
    from psrt.train.profile import load
    prof = load("resnet50")
    compute = prof.forward_s + prof.backward_s
    a = args()
    scaling.check(a)
    cell = dict(profile="resnet50", cpu_bound=False, run_queue=0.0, grad_bytes=prof.grad_bytes(), prof=prof)
    rows = [dict(cell, layout="1x1", hosts=1, per_host=1, workers=1, strategy="ring", step_s=compute + 0.02,
                 links=None),
            dict(cell, layout="2x1", hosts=2, per_host=1, workers=2, strategy="ps", step_s=1.0, links=GBIT)]
    one, two = scaling.assemble(rows, a)["rows"]
    model = step_model.predict_step("ps", prof.forward_s, prof.backward_s, [0, 1], prof.grad_bytes(), GBIT,
                                    step_model.gradient_buckets(prof, step_model.BUCKET_BYTES)).step_s
    assert one["predicted_s"] == pytest.approx(compute)        # its error shows the host work
    assert two["host_s"] == pytest.approx(0.02)
    assert two["predicted_s"] == pytest.approx(model + 0.02)
    assert two["predicted_speedup"] == pytest.approx(2 * (compute + 0.02) / (model + 0.02))


def test_zero3_pays_its_messages_once_per_unit_and_crowded_hosts_pay_a_wait_per_message():
    host_of = step_model.placement(4, 4)
    one = step_model.comm_time("zero3", host_of, 8 << 20, GBIT)
    many = step_model.comm_time("zero3", host_of, 8 << 20, GBIT, units=54)
    # 3 ring passes a unit, 3 (H-1) of their steps paying the latency between the 4 hosts
    assert many - one == pytest.approx(53 * 3 * 3 * GBIT.inter.alpha_s)
    # units are zero3's alone: DDP's ring is one all-reduce per bucket
    assert step_model.comm_time("ring", host_of, 8 << 20, GBIT, units=54) == step_model.comm_time("ring", host_of, 8 << 20, GBIT)
    crowded = cost.Links(GBIT.intra, GBIT.inter, crowd=8.0)
    extra = step_model.comm_time("ring", host_of, 8 << 20, crowded) - step_model.comm_time("ring", host_of, 8 << 20, GBIT)
    assert extra == pytest.approx(2 * 15 * 7 * crowded.wait_s)
    from psrt.train.profile import load
    vgg = load("vgg16")
    got = step_model.units(vgg)
    assert len(got) == 16                  # 13 convolutions and 3 linear layers
    assert sum(u.nbytes for u in got) == vgg.grad_bytes()
    # the layers without parameters (ReLU, pooling) keep their time, in the unit before them
    assert sum(u.forward_s for u in got) == pytest.approx(vgg.forward_s)
    assert sum(u.backward_s for u in got) == pytest.approx(vgg.backward_s)


def test_zero3_timeline_hides_what_its_prefetch_hides():
    from psrt.dp.zero3 import Zero3
    assert step_model.ZERO3_IN_FLIGHT == Zero3.IN_FLIGHT
    host_of = step_model.placement(2, 1)
    unit = 4 << 20
    each = step_model.comm_time("zero3", host_of, unit, GBIT) / 3       # one gather or reduce-scatter
    # no compute: nothing to hide behind, the step is every collective one after the other
    bare = [step_model.Unit(0.0, 0.0, unit)] * 3
    assert step_model.zero3_step(host_of, bare, GBIT) == pytest.approx(9 * each)
    # compute far longer than each collective: all hidden but the first gather of forward,
    # the last unit's gather again at the start of backward and the last reduce-scatter
    busy = [step_model.Unit(10 * each, 20 * each, unit)] * 3
    assert step_model.zero3_step(host_of, busy, GBIT) == pytest.approx(90 * each + 3 * each)
    step = step_model.predict_step("zero3", 30 * each, 60 * each, host_of, 3 * unit, GBIT, units=busy)
    assert step.step_s == pytest.approx(93 * each)
    assert step.comm_s == pytest.approx(9 * each)
    # without units: one unit, nothing hidden (the upper bound)
    whole = step_model.predict_step("zero3", 30 * each, 60 * each, host_of, 3 * unit, GBIT)
    assert whole.step_s == pytest.approx(90 * each + 3 * step_model.comm_time("zero3", host_of, 3 * unit, GBIT) / 3)


def test_local_aggregation_pushes_then_pulls_as_the_server_trains():
    # one rank per host: local aggregation is the single server, whose update sits between
    # the push and the pull (psrt/dp/ps.py), so neither model may overlap the two
    two = step_model.placement(2, 1)
    assert step_model.comm_time("ps-local", two, 16 << 20, GBIT) == pytest.approx(
        step_model.comm_time("ps", two, 16 << 20, GBIT), rel=1e-6)
    # the all-reduce algorithm of the same name pipelines them (psrt.collectives.ps)
    assert cost.predict_two_level("ps-local", two, 16 << 20, GBIT) < 0.6 * step_model.comm_time("ps-local", two, 16 << 20, GBIT)


def test_native_is_priced_as_the_librarys_rabenseifner_with_its_drift_on_shared_cores():
    """Open MPI 4.1's fixed rules run Rabenseifner's algorithm for these cells: by level it
    puts fewer bytes between hosts than the ring on 2x4 and the same on 2x1.  Each of its
    exchanges between hosts is charged one direction's bytes where each rank has a core, and
    1 + DRIFT x log2(hosts) times them where ranks share cores."""
    links = cost.Links(cost.Fit(0.0, 0.0, 1.0), cost.Fit(0.0, 1 / 125e6, 1.0))
    crowded = cost.Links(links.intra, links.inter, crowd=4.0, wait_s=0.0)
    m = 16 << 20
    two_by_one, two_by_four, four_by_two = (step_model.placement(2, 1), step_model.placement(2, 4),
                                            step_model.placement(4, 2))
    assert cost.native_allreduce(8, m) == "rabenseifner"
    assert cost.native_allreduce(2, 128 << 10) == cost.native_allreduce(6, m) == cost.native_allreduce(64, m) == "ring"
    ring = step_model.comm_time("ring", two_by_one, m, links)
    assert step_model.comm_time("native", two_by_one, m, links) == pytest.approx(ring)
    assert step_model.comm_time("native", two_by_one, m, crowded) == pytest.approx((1 + cost.DRIFT) * ring)
    # 2x4: only the last halving step (and the first doubling step) crosses the hosts,
    # n/8 from each of 4 ranks: M/2 each way, against the flat ring's 2(N-1)/N = 1.75 M
    assert step_model.comm_time("native", two_by_four, m, crowded) == pytest.approx((1 + cost.DRIFT) * m / 125e6)
    assert step_model.comm_time("native", two_by_four, m, links) == pytest.approx(m / 125e6)
    assert step_model.comm_time("ring", two_by_four, m, links) == pytest.approx(1.75 * m / 125e6)
    # 4x2: two levels of hosts, n/4 then n/8 from each of 2 ranks, each way: 3M/4 per half
    assert step_model.comm_time("native", four_by_two, m, links) == pytest.approx(1.5 * m / 125e6)
    assert step_model.comm_time("native", four_by_two, m, crowded) == pytest.approx(
        (1 + 2 * cost.DRIFT) * 1.5 * m / 125e6)
    # below the library's threshold, and on ranks not a power of two, the ring as before
    assert step_model.comm_time("native", two_by_one, 64 << 10, links) == step_model.comm_time("ring", two_by_one, 64 << 10, links)
    with pytest.raises(ValueError, match="power of two"):
        cost.rounds("rabenseifner", [0, 0, 1], m)
