"""The training examples run (tiny settings) and say what they claim."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest
from conftest import ROOT, RankRun, mpirun_argv
from test_train_cli import env

pytestmark = pytest.mark.mpi


def example(np_: int, name: str, *args: str) -> str:
    cmd = mpirun_argv(np_) + [sys.executable, str(ROOT / "examples" / name), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env(),
                          stdin=subprocess.DEVNULL)
    return RankRun(proc).check().stdout


@pytest.mark.skipif(importlib.util.find_spec("psrt.dp.ps") is None, reason="psrt.dp.ps missing")
def test_ps_vs_ring_loss_curves_agree_and_the_server_sends_more():
    out = example(3, "ps_vs_ring.py", "--steps", "4", "--width", "64")
    worst = float(re.search(r"largest loss difference over 4 steps: (\S+)", out).group(1))
    assert worst < 1e-5, out
    ps, ring = (size(t) for t in re.search(r"bytes sent, busiest rank\s+(\S+ \S+)\s+(\S+ \S+)", out).groups())
    # 3 ranks: the server sends (N-1) M = 2 M, a ring rank 2 (N-1)/N M = 1.33 M.
    assert ps == pytest.approx(1.5 * ring, rel=0.05), out


def size(text: str) -> float:
    value, unit = text.split()
    return float(value) * {"B": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30}[unit]


def test_ddp_overlap_prints_both_times_and_the_ratio():
    out = example(2, "ddp_overlap.py", "--layers", "3", "--width", "64", "--steps", "2", "--bucket-mb", "0.01")
    assert re.search(r"step with overlap\s+:\s+[\d.]+ ms", out), out
    assert re.search(r"ratio overlap / after\s+:\s+[\d.]+", out), out
    started, buckets = map(int, re.search(r"(\d+)/(\d+) buckets started during backward", out).groups())
    assert buckets > 1 and started == buckets, out
