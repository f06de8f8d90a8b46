"""The network-bound regime on shaped emulated hosts: PS shows the server bottleneck (root)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from psrt.bench.suite import netns_ok

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


