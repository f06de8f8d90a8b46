"""The benchmark suite: the alpha-beta model, the training and ping-pong benchmarks, the
network-bound regime on shaped emulated hosts, and `suite --quick` end to end."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from psrt.bench import network
from psrt.collectives import cost as alpha_beta
from psrt.collectives.cost import Fit
from psrt.bench.suite import netns_ok

ROOT = Path(__file__).resolve().parent.parent


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
    good = {g["goal"].split(":")[0]: g["ok"] for g in network.goals(_payload(ps8=7.0, ring8=1.7))}
    assert all(good.values()) and len(good) == 3
    bad = network.goals(_payload(ps8=2.0, ring8=1.9, error=0.4))
    assert [g["ok"] for g in bad] == [False, False, False]


# --- rank side, under mpirun ------------------------------------------------------------------

@pytest.mark.mpi
def test_training_benchmark_rows(run_ranks, tmp_path):
    """Every strategy (and torch's own DDP) takes timed steps in one job; the ratio to torch
    DDP is computed from the same run."""
    out = tmp_path / "train.json"
    dps = "ps,ps-sharded,ring,native,torch,torch-ddp"
    run_ranks(2, "-m", "psrt.bench", "training", "--dp", dps, "--width", "64", "--steps", "1",
              "--rounds", "1", "--quiet", "--json", str(out), timeout=300).check()
    rows = json.loads(out.read_text())["rows"]
    assert [r["dp"] for r in rows] == dps.split(",")
    peer = rows[-1]["step_s"]
    for r in rows:
        assert r["ranks"] == 2 and r["workers"] == 2 and r["global_batch"] == 64
        assert r["step_s"] > 0 and r["step_min_s"] <= r["step_s"]
        assert r["samples_per_s"] == pytest.approx(64 / r["step_s"])
        assert r["vs_torch_ddp"] == pytest.approx(peer / r["step_s"])
        # each rank trained on its own samples: only averaged gradients end in one place
        assert r["max_param_diff"] < 1e-5, r


@pytest.mark.mpi
def test_pingpong_fit(run_ranks, tmp_path):
    out = tmp_path / "pp.json"
    run_ranks(2, "-m", "psrt.bench", "pingpong", "--sizes", "8,64KiB,1MiB,4MiB", "--repeats", "2",
              "--quiet", "--json", str(out), timeout=120).check()
    got = json.loads(out.read_text())
    assert [p["nbytes"] for p in got["points"]] == [8, 65536, 1 << 20, 4 << 20]
    assert all(p["min_s"] <= p["one_way_s"] <= p["max_s"] for p in got["points"])
    assert got["fit"]["beta_s_per_byte"] > 0 and got["fit"]["alpha_s"] > 0


# --- the emulated network and the whole suite ------------------------------------------------

_MISSING = netns_ok()
netns = pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))


def _bench(*args, timeout=400):
    return subprocess.run([sys.executable, "-m", "psrt.bench", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, cwd=ROOT)


@netns
@pytest.mark.mpi
@pytest.mark.netns
def test_network_quick_shows_the_server_bottleneck(tmp_path):
    """On 8 emulated hosts with 1 Gbit/s links the server's link makes PS several times
    slower than the ring, as the model says; on 2 hosts the two are close."""
    out = tmp_path / "net.json"
    proc = _bench("network", "--quick", "--quiet", "--json", str(out), "--plot", str(tmp_path / "n.png"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads(out.read_text())
    t = {(r["layout"], r["algorithm"]): r for r in payload["rows"]}
    assert all(r["wrong"] == 0 for r in payload["rows"])
    assert t[("8x1", "ps")]["measured_s"] > 2 * t[("8x1", "ring")]["measured_s"]
    assert t[("2x1", "ps")]["measured_s"] < 1.6 * t[("2x1", "ring")]["measured_s"]
    # the link was really shaped: 16 MiB cannot cross 1 Gbit/s in less than 0.13 s
    assert t[("2x1", "ring")]["measured_s"] > 0.12
    fit = payload["fits"]["1gbit/1"]
    assert 90e6 < 1 / fit["beta_s_per_byte"] < 130e6
    assert "goal" in proc.stdout and (tmp_path / "n.png").stat().st_size > 0
    assert not [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
                if ns.startswith("psrt-h")]


@pytest.mark.mpi
def test_suite_quick_writes_the_report(tmp_path):
    """`suite --quick` (collectives and training; the network part has its own test) writes
    report.md with the goals, and JSON, CSV and PNG files that agree with it."""
    proc = _bench("suite", "--quick", "--quiet", "--parts", "collectives,training", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = (tmp_path / "report.md").read_text()
    for name in ("collectives.json", "collectives.csv", "allreduce_np2.png", "training.json",
                 "training.csv", "training.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert "## Goals, as measured in this run" in report and "ring DDP step <= torch DDP" in report
    rows = json.loads((tmp_path / "training.json").read_text())["rows"]
    assert {r["ranks"] for r in rows} == {1, 2}
    two = [r for r in rows if r["ranks"] == 2]
    assert all(0 < r["efficiency"] for r in two)
    coll = json.loads((tmp_path / "collectives.json").read_text())["rows"]
    assert {"ps", "ring", "native"} <= {r["algorithm"] for r in coll}
    assert sum(r["wrong"] for r in coll) == 0
    assert proc.stdout.startswith("# psrt benchmark report")
