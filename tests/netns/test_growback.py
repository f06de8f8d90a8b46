"""Grow-back, end to end: `mpi_launch --emulate --restarts 1` on two emulated hosts of one
rank each; the second host is lost after step 5 (psrt.cluster fail), the job restarts on the
first alone, and once that narrowed run trains, the host is revived (psrt.cluster revive).
The launcher, asking the lost host every PSRT_GROW_BACK_S, sees it answer, the job stops at its
next checkpoint (exit 5) and starts again on both hosts from there.  The test holds that the
full width trains again within two checkpoint intervals of the revival, and that the final
parameters equal a run's that never failed (same global batch)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import zlib
from contextlib import contextmanager
from pathlib import Path

import pytest

from psrt.bench.recovery import _diff_to_reference, _env, _train_args
from psrt.launch.cluster import Cluster, down, fail, revive
from test_cluster import needs_openmpi, netns

ROOT = Path(__file__).resolve().parents[2]
EVERY = 4          # --checkpoint-every
STEPS = 24


def widths_noted(path: Path) -> list[tuple[int, int]]:
    """(step, ranks) of every step the lead worker noted (tests/mpi/ranks/paced_steps.py)."""
    try:
        return [tuple(map(int, line.split())) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def wait_for(path: Path, proc, until, timeout: float, what: str) -> list[tuple[int, int]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        rows = widths_noted(path)
        if until(rows):
            return rows
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout:g} s (exit {proc.poll()}); steps {widths_noted(path)}")


def two_hosts(tmp_path: Path, letter: str, slots: tuple[int, int], subnets: int) -> tuple[tuple, str, Path]:
    """(host names, subnet, hostfile) of two emulated hosts unique to this test and process; the
    subnet is one of 198.19.`subnets`+k.0/24, k < 50."""
    tag = zlib.crc32(f"{os.getpid()}:{letter}:{tmp_path}".encode())
    names = (f"{letter}{tag % 10**6:06d}n0", f"{letter}{tag % 10**6:06d}n1")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("".join(f"{h} slots={n}\n" for h, n in zip(names, slots)))
    return names, f"198.19.{subnets + tag % 50}.0/24", hostfile


@contextmanager
def launched(argv: list[str], env: dict, log: Path, names: tuple, subnet: str):
    """The launch `argv` running (its output in `log`); afterwards ended if it still runs
    (SIGTERM, on which the launcher takes its cluster down; SIGKILL 20 s later) and the
    cluster removed, pass or fail."""
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                stdin=subprocess.DEVNULL)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            down(Cluster(names, subnet))


@netns
@pytest.mark.mpi
@needs_openmpi
def test_a_revived_host_rejoins_at_the_next_checkpoint(tmp_path):
    names, subnet, hostfile = two_hosts(tmp_path, "g", (1, 1), 150)
    ckpt, final = tmp_path / "ckpt.pt", tmp_path / "final.pt"
    widths = Path(str(ckpt) + ".widths")
    env = dict(_env(4.0), PSRT_GROW_BACK_S="0.5")
    train = _train_args("zero1", STEPS, 16, 16)
    argv = [sys.executable, "-m", "psrt.launch", "--emulate", "--hostfile", str(hostfile), "-np", "2",
            "--restarts", "1", "--subnet", subnet, sys.executable] + train + [
            "--checkpoint", str(ckpt), "--checkpoint-every", str(EVERY), "--save", str(final),
            "--callback", "tests.mpi.ranks.paced_steps:Paced"]
    log = tmp_path / "launch.log"
    with launched(argv, env, log, names, subnet) as proc:
        wait_for(widths, proc, lambda rows: any(s >= 5 for s, _ in rows), 120, "step 5 on 2 ranks")
        fail(names[1])
        rows = wait_for(widths, proc, lambda rows: bool(rows) and rows[-1][1] == 1, 120, "the narrowed run training")
        revived_at, revived = rows[-1][0], time.monotonic()
        revive(names[1])
        rows = wait_for(widths, proc, lambda rows: bool(rows) and rows[-1][1] == 2 and rows[-1][0] > revived_at,
                        120, "training again on 2 ranks")
        wide_again, took = rows[-1][0], time.monotonic() - revived
        code = proc.wait(timeout=120)
    said = log.read_text()
    assert code == 0, said
    assert "answer(s) again: asking the job to stop at its next checkpoint" in said, said
    print(f"revived after step {revived_at}; 2 ranks again from step {wide_again}, {took:.1f} s later")
    assert wide_again - revived_at <= 2 * EVERY, (revived_at, wide_again, said)
    assert _diff_to_reference("zero1", 2, STEPS, 16, 16, _env(4.0), final) <= 1e-5
