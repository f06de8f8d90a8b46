"""The network-bound regime on shaped emulated hosts: PS shows the server bottleneck (root)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from psrt.bench.suite import netns_ok

# link timings: the machine to itself while they run (tests/conftest.py, `alone`)
pytestmark = pytest.mark.alone

ROOT = Path(__file__).resolve().parents[2]


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




@netns
@pytest.mark.mpi
@pytest.mark.netns
def test_demo_shows_the_ring_winning_on_emulated_hosts(tmp_path):
    """`make demo`'s command, smaller: 3 hosts at 1 Gbit/s, a 1M-parameter MLP.  The ring's
    step is well under the server's, the prediction and crossover are printed, the PNG is
    written, and the two loss curves are the same training."""
    proc = _bench("demo", "--hosts", "3", "--steps", "3", "--width", "1024", "--out", str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--emulate --hosts h0,h1,h2 --rate 1gbit" in proc.stderr
    assert "alpha-beta model (ping-pong rank 0 (h0) <-> rank 1 (h1))" in proc.stdout, proc.stdout
    assert "3 ranks on 3 hosts" in proc.stdout and "crossover: ring communicates faster than ps" in proc.stdout
    verdict = next(line for line in proc.stdout.splitlines() if line.startswith("psrt demo: ring step"))
    ratio = float(verdict.split(" = ")[1].split("x")[0])
    assert ratio < 0.75, verdict          # the model: 4 M beta for ps, 1.33 M beta for the ring
    assert "the alpha-beta model predicted" in verdict
    assert (tmp_path / "ps_vs_ring.png").stat().st_size > 10_000
    losses = {dp: [json.loads(x)["loss"] for x in (tmp_path / f"metrics.{dp}.jsonl").read_text().splitlines()
                   if '"summary"' not in x] for dp in ("ps", "ring")}
    assert len(losses["ps"]) == 3 and losses["ps"] == pytest.approx(losses["ring"], rel=1e-5)


@netns
@pytest.mark.mpi
@pytest.mark.netns
def test_network_hosts_of_several_ranks_run_hierarchical_beside_its_two_level_model(tmp_path):
    """2 emulated hosts of 2 ranks at 1 Gbit/s: hierarchical is right, has a two-level
    prediction from a ping-pong inside a host and one between hosts, and its host links
    carried the data (4 MiB cannot cross 1 Gbit/s in less than 34 ms)."""
    out = tmp_path / "net.json"
    proc = _bench("network", "--rates", "1gbit", "--hosts", "2", "--layouts", "2x2", "--size", "4MiB",
                  "--no-floor", "--repeats", "1", "--warmup", "0", "--quiet", "--prefix", "psrt-l",
                  "--subnet", "198.18.11.0/24", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads(out.read_text())
    t = {(r["layout"], r["algorithm"]): r for r in payload["rows"]}
    assert all(r["wrong"] == 0 for r in payload["rows"])
    assert set(payload["fits"]) == {"1gbit/1", "1gbit/2", "1gbit/2/intra"}
    row = t[("2x2", "hierarchical")]
    assert row["two_level_s"] > 0 and row["measured_s"] > 0.034
    assert not [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
                if ns.startswith("psrt-l")]
