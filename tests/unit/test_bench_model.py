"""The benchmark suite's pure parts: the alpha-beta fit and predictions, link accounting,
sizes per rate and how goals are judged."""
from __future__ import annotations

import json

import pytest

from psrt.bench import network
from psrt.collectives import cost as alpha_beta
from psrt.collectives.cost import Fit

# --- the model, without MPI -------------------------------------------------------------------

def test_fit_recovers_alpha_and_beta():
    alpha, beta = 20e-6, 8e-9
    sizes = [8, 64, 512, 4096, 1 << 20, 4 << 20, 16 << 20]
    # Small messages pass a token bucket at machine speed: only alpha counts below 1 MiB.
    points = [{"nbytes": m, "one_way_s": alpha + (m * beta if m >= 1 << 20 else m * 1e-10)} for m in sizes]
    fit = alpha_beta.fit(points)
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-3)
    assert fit.beta_s_per_byte == pytest.approx(beta, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0)
    with pytest.raises(ValueError):
        alpha_beta.fit(points[:2])
    with pytest.raises(ValueError, match="do not grow"):
        alpha_beta.fit([{"nbytes": m, "one_way_s": 1e-3} for m in sizes])


def test_predictions_match_the_textbook_model():
    """8 hosts of one rank: the server's link carries 7M each way, a ring link 2(N-1)/N M,
    a 4x gap; two hosts of four ranks: 4M against 1.75M, ~2.3x."""
    fit = Fit(alpha_s=0.0, beta_s_per_byte=1.0, r2=1.0)
    m = 64 << 20
    eight = list(range(8))
    ring8 = alpha_beta.predict("ring", 8, m, eight, fit)
    ps8 = alpha_beta.predict("ps", 8, m, eight, fit, segment_bytes=1)
    assert ring8 == pytest.approx(2 * 7 / 8 * m)
    assert ps8 == pytest.approx(7 * m + 7)
    assert ps8 / ring8 == pytest.approx(4.0, rel=1e-6)
    two = [r // 4 for r in range(8)]
    ratio = alpha_beta.predict("ps", 8, m, two, fit, segment_bytes=1) / alpha_beta.predict("ring", 8, m, two, fit)
    assert ratio == pytest.approx(4 / 1.75, rel=1e-6)
    # ring nearly flat, ps linear in the hosts
    assert alpha_beta.predict("ring", 2, m, [0, 1], fit) == pytest.approx(m)
    assert alpha_beta.predict("ps", 2, m, [0, 1], fit, segment_bytes=1) == pytest.approx(m + 1)
    # latency: 2(N-1) steps for the ring
    lat = Fit(alpha_s=1.0, beta_s_per_byte=0.0 + 1e-30, r2=1.0)
    assert alpha_beta.predict("ring", 8, 1, eight, lat) == pytest.approx(14.0)
    # nothing crosses a link on one host
    assert alpha_beta.predict("ring", 4, m, [0, 0, 0, 0], fit) is None
    with pytest.raises(ValueError):
        alpha_beta.predict("tree", 4, m, [0, 1, 2, 3], fit)


def test_link_load_counts_only_traffic_between_hosts():
    moves = [(0, 1, 5.0), (1, 2, 7.0), (2, 0, 3.0), (0, 2, 4.0)]
    assert alpha_beta.link_load(moves, [0, 0, 1]) == pytest.approx(11.0)   # into host 1: 7 + 4
    assert alpha_beta.link_load(moves, [0, 0, 0]) == 0.0


def test_sizes_scale_with_the_rate():
    assert network.size_for("1gbit", "1gbit", 64 << 20) == 64 << 20
    assert network.size_for("100mbit", "1gbit", 64 << 20) == 4 << 20    # 6.4 MiB -> 4 MiB
    assert network.size_for("10mbit", "1gbit", 64 << 20) == 1 << 20     # at least 1 MiB


def _payload(ps8: float, ring8: float, error: float = 0.05) -> dict:
    rows = []
    for hosts, ps, ring in ((2, 1.0, 1.0), (8, ps8, ring8)):
        for algo, t in (("ps", ps), ("ring", ring)):
            pred = alpha_beta.predict(algo, hosts, 1 << 20, list(range(hosts)), Fit(0, 1e-6, 1))
            rows.append({"rate": "1gbit", "layout": f"{hosts}x1", "hosts": hosts, "per_host": 1, "algorithm": algo,
                         "measured_s": t, "predicted_s": pred, "error": error, "network_bound": True,
                         "floor_s": 0.01, "wrong": 0, "nbytes": 1 << 20})
    return {"rows": rows, "fits": {}, "sizes": {}}


def test_goals_are_judged_from_the_measurements():
    good = network.goals(_payload(ps8=7.0, ring8=1.7))
    assert [g.ok for g in good] == [True, True, True, True] and len({g.text.split(":")[0] for g in good}) == 3
    assert good[1].value == "1.70x" and good[2].value == "1.00x (grew 7.00x)"
    bad = network.goals(_payload(ps8=2.0, ring8=1.9, error=0.4))
    assert [g.ok for g in bad] == [False, True, False, False]      # the ring's growth alone is met
    assert bad[-1].line() == "goal MISSED: 1gbit: alpha-beta within 20% where network-bound (4 rows): worst +40% (2x1 ps)"




def test_the_report_names_the_command_that_made_it():
    from types import SimpleNamespace

    from psrt.bench.suite import command_line
    assert command_line(SimpleNamespace(quick=False, np=[2, 4], parts=["collectives", "training", "network"],
                                        out="out/bench")) == "python -m psrt.bench suite --out out/bench"
    assert command_line(SimpleNamespace(quick=True, np=[2], parts=["training"], out="o")) == \
        "python -m psrt.bench suite --quick --np 2 --parts training --out o"


def test_horovod_timeline_phases_by_shape(tmp_path):
    """Horovod's timeline as rank 0 writes it (unterminated JSON array, B/E pairs per tensor,
    the shape on ALLREDUCE's end): each phase lands under the shape of its call."""
    from psrt.bench.horovod import read_timeline
    events = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "allreduce.g"}}]
    for shape, t0 in (("[1024]", 0), ("[1024]", 100), ("[4096]", 200)):
        events += [{"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": t0, "pid": 1},
                   {"ph": "X", "name": "0", "ts": t0 + 1, "pid": 1, "dur": 0},
                   {"ph": "E", "ts": t0 + 5, "pid": 1},
                   {"ph": "B", "name": "ALLREDUCE", "ts": t0 + 6, "pid": 1},
                   {"ph": "B", "name": "MPI_ALLREDUCE", "ts": t0 + 7, "pid": 1},
                   {"ph": "E", "ts": t0 + 50, "pid": 1},
                   {"ph": "E", "ts": t0 + 51, "pid": 1, "args": {"dtype": "float32", "shape": shape}}]
    path = tmp_path / "timeline.json"
    path.write_text("[\n" + ",\n".join(json.dumps(e) for e in events) + ",\n")
    got = read_timeline(path)
    assert got["[1024]"] == {"NEGOTIATE_ALLREDUCE": [5, 5], "MPI_ALLREDUCE": [43, 43], "ALLREDUCE": [45, 45]}
    assert got["[4096]"]["MPI_ALLREDUCE"] == [43]
