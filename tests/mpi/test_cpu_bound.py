"""The bound is detected, not assumed: a run on an emulated profile while other processes
keep every core busy is marked CPU-bound in its summary (psrt/train/cpu_load.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import launch_ranks

pytestmark = pytest.mark.mpi

SPIN = "import time\nend = time.time() + 120\nwhile time.time() < end: pass\n"


def test_a_cell_run_beside_a_cpu_load_is_marked_cpu_bound(tmp_path):
    load = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        metrics = tmp_path / "m.jsonl"
        run = launch_ranks(2, "-m", "psrt.train", "--profile", "resnet50", "--byte-divisor", "64", "--steps", "3",
                           "--batch-size", "16", "--quiet", "--metrics", str(metrics), timeout=240)
    finally:
        for p in load:
            p.kill()
            p.wait()
    run.check()
    summary = [json.loads(line) for line in metrics.read_text().splitlines() if '"summary"' in line][-1]
    assert summary["cpu_bound"] is True, summary
    assert summary["run_queue"] > 0.2
    assert "CPU-bound" in run.stdout
