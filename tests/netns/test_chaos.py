"""A seeded chaos campaign: `python -m psrt.bench chaos --trials 8 --seed 1`, every fault kind
(SIGKILL, SIGSTOP past the timeout, a lost emulated host, a cut link, a full disk) and every
moment (a step, a checkpoint write, the final evaluation, the final gather, a second fault
while a restart loads), each trial under `mpi_launch --restarts 2` or, for a SIGKILL or a lost
host in a step, `--in-job-recovery` (ULFM).  Every trial must end with
the final parameters of a run that never failed (1e-5), its last checkpoint whole, and the
campaign must leave no namespace, mount or process behind."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from psrt.bench.nemesis import KINDS, MOMENTS
from test_cluster import needs_openmpi, netns

ROOT = Path(__file__).resolve().parents[2]


def _namespaces() -> set[str]:
    """The campaign's hosts and switches (c<tag>n<i>, psrt.bench.chaos._hosts): the suite's
    Slurm tests make hosts of their own meanwhile (tests/conftest.py)."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    return {n for n in names if re.fullmatch(r"c\d{6}n\d+(-sw)?", n)}


def _mounts() -> int:
    return Path("/proc/mounts").read_text().count("psrt-chaos")


@netns
@pytest.mark.mpi
@needs_openmpi
def test_a_seeded_campaign_of_every_fault_kind_ends_right_every_time(tmp_path):
    before = _namespaces()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_", "PMIX_", "PSRT_"))}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-m", "psrt.bench", "chaos", "--trials", "8", "--seed", "1",
                          "--json", str(tmp_path / "rows.json")],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=1200,
                         stdin=subprocess.DEVNULL)
    print(out.stdout)        # the table docs/how-to/reliability.md shows (pytest -s)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert {r["kind"] for r in rows} == set(KINDS) and {r["moment"] for r in rows} == set(MOMENTS)
    assert {r["mode"] for r in rows if r["kind"] == "host-loss"} == {"in-job"}   # ULFM, 2 emulated hosts
    for r in rows:
        assert r["recovered"].startswith("yes") and r["checkpoint"] != "UNREADABLE", r
        if r["kind"] != "enospc":
            assert float(r["max_diff"]) <= 1e-5, r
    assert "8 of 8 trials recovered; 0 unreadable checkpoints; 0 runs that did not end" in out.stdout
    assert _namespaces() <= before and _mounts() == 0


def _leftovers() -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "psrt-chaos-" in line]


@netns
@pytest.mark.mpi
@needs_openmpi
def test_a_campaign_told_to_stop_leaves_no_run_mount_or_host_behind():
    """SIGTERM to `psrt.bench chaos` while its first five trials run (a full tmpfs and two
    emulated clusters among them): it ends within seconds, and every run, mount and namespace
    it made is gone."""
    before = _namespaces()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_", "PMIX_", "PSRT_"))}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "psrt.bench", "chaos", "--trials", "5", "--seed", "1",
                             "--parallel", "5", "--modes", "restarts"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (_mounts() and len(_namespaces() - before) >= 4):
            time.sleep(0.5)
        assert _mounts() and len(_namespaces() - before) >= 4, "the trials did not start"
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0, out[-2000:]
    assert _mounts() == 0 and _namespaces() <= before and not _leftovers(), (out[-2000:], _leftovers())
