"""psrt.bench scaling on emulated hosts (root): a small run gives every cell its step,
speed-up, bound and prediction (ring-hier, ps-local and ring-auto on hosts of two ranks,
auto beside the fastest ring), and draws the PNG; nothing of the cluster is left behind."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from psrt.bench.suite import netns_ok

# link timings: the machine to itself while they run (tests/conftest.py, `alone`)
pytestmark = pytest.mark.alone

ROOT = Path(__file__).resolve().parents[2]
_MISSING = netns_ok()


@pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))
@pytest.mark.mpi
@pytest.mark.netns
def test_a_small_scaling_run_fills_every_cell(tmp_path):
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    proc = subprocess.run([sys.executable, "-m", "psrt.bench", "scaling", "--layouts", "1x1,2x2", "--strategies",
                           "ring,ps", "--profiles", "resnet50", "--byte-divisor", "64", "--steps", "3", "--quiet",
                           "--prefix", "psrt-t", "--json", str(out), "--plot", str(png)],
                          capture_output=True, text=True, timeout=500, stdin=subprocess.DEVNULL, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    cells = {(r["layout"], r["strategy"]) for r in rows}
    assert {("2x2", s) for s in ("ring", "ps", "ring-hier", "ps-local", "ring-auto")} <= cells
    for r in rows:
        assert r["step_s"] > 0 and r["speedup"] > 0 and r["predicted_s"] > 0
        assert r["bound"] in ("cpu", "link", "compute")
    auto = next(r for r in rows if r["strategy"] == "ring-auto")
    assert auto["auto_vs_fastest"] is not None
    # one stands-for line per profile, with the divisor the command line forced
    assert "# resnet50: emulated links of 250mbit; gradients /64 and compute x1.5625: its rows stand for the same " \
           "accelerators on links of 25 Gbit/s" in proc.stdout
    assert json.loads(out.read_text())["scales"] == {"resnet50": {"byte_divisor": 64.0, "dilation": 1.5625}}
    # stdout is the bench's table and goals; each launch's own summary went to stderr
    assert "memory per rank" not in proc.stdout and "memory per rank" in proc.stderr
    assert re.search(r"^goal (met|MISSED|n/a): resnet50, the servers: ", proc.stdout, re.M), proc.stdout[-2000:]
    assert png.stat().st_size > 0
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "psrt-t" not in names
