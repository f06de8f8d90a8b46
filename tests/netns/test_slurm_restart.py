"""Restart on the survivors under Slurm: `mpi_launch --launcher srun --restarts` inside a
`--no-kill` allocation of two emulated Slurm nodes (python -m psrt.cluster up --slurm) loses
the second node mid-run and finishes on the first, as if nothing had failed.

Needs what tests/netns/test_slurm.py needs (root, `ip netns`, Debian's Slurm and munge); a
cluster of its own, with names unique to this process, removed at the end.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from psrt.launch import cluster as C
from psrt.launch import slurm

sys.path.insert(0, str(Path(__file__).parent))
from test_slurm import OUT, ROOT, _names, assert_gone, job_state, on, pytestmark, wait_for  # noqa: E402,F401


@pytest.fixture(scope="module")
def cluster():
    """Two Slurm nodes of 2 CPUs each."""
    hosts, subnet = _names("restart")
    c = C.Cluster(hosts, subnet, slurm=True, slots=(2, 2))
    try:
        C.up(c)
        yield c
    finally:
        C.down(c)
        assert_gone(c)


def _wait_for_step(path: Path, step: int, alive, timeout: float = 120) -> None:
    """Until the run notes `step` in `path` (polled often: a step takes milliseconds)."""
    deadline, asked = time.monotonic() + timeout, 0.0
    while True:
        try:
            if int(path.read_text().strip() or 0) >= step:
                return
        except (OSError, ValueError):
            pass
        if time.monotonic() > asked + 0.5:
            assert alive(), f"the run ended before step {step}"
            asked = time.monotonic()
        assert time.monotonic() < deadline, f"step {step}: not within {timeout:.0f} s"
        time.sleep(0.01)


@pytest.mark.parametrize("dp,how", [("ring", "salloc"), ("zero1", "sbatch")])
def test_srun_restarts_on_the_survivors_and_ends_as_if_nothing_failed(cluster, dp, how):
    """`mpi_launch --launcher srun --restarts` on 2 nodes x 2 tasks, in `salloc --no-kill` or
    as examples/slurm_restart_job.sh; every process of the second node is killed and its link
    taken down after step 30 of 100.  The survivors' watchdog ends the step, the launcher asks
    each node with a step of its own, and the job runs again as a step on the first node alone
    (its 2 CPUs: 2 tasks), from the last checkpoint, with no one stepping in; its final
    parameters equal those of one process that trained on the whole batch without a failure."""
    h0, h1 = cluster.hosts
    d = OUT / f"psrt-srun-restart-{os.getpid()}-{dp}"
    d.mkdir(exist_ok=True)
    train = ["-m", "psrt.train", "--dp", dp, "--steps", "100", "--batch-size", "64", "--width", "64",
             "--seed", "5", "--quiet"]
    out = ["--save", str(d / "out.pt"), "--metrics", str(d / "m.jsonl")]
    shape = ["-N", "2", "--ntasks-per-node", "2"]
    env = {"PSRT_TIMEOUT": "5", "CHECKPOINT": str(d / "run.ckpt")}
    proc, job, reference = None, None, None
    if how == "salloc":
        argv = ["salloc", *shape, "--no-kill", str(ROOT / "mpi_launch"), "--launcher", "srun", "--restarts", "1",
                "--extra-args=--mpi=pmix", sys.executable, *train, "--checkpoint", str(d / "run.ckpt"), *out]
        proc = subprocess.Popen(C.exec_argv(h0, argv), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, stdin=subprocess.DEVNULL,
                                env=C.job_env(cluster, "openmpi4", {**os.environ, **env, "OMP_NUM_THREADS": "1"}))
    else:
        sub = on(cluster, "sbatch", "--parsable", *shape, f"--output={d}/job.out", "examples/slurm_restart_job.sh",
                 *train[2:], *out, env=env)
        assert sub.returncode == 0, sub.stderr
        job = sub.stdout.strip().split(";")[0]
    try:
        _wait_for_step(d / "run.ckpt.step", 30, lambda: proc.poll() is None if proc else
                       job_state(cluster, job) in ("PENDING", "CONFIGURING", "RUNNING"))
        C.fail(h1)
        lost_at = int((d / "run.ckpt.step").read_text().strip())
        # One process on the whole batch, run while the survivors wait for the lost node.
        reference = subprocess.Popen([sys.executable, *train, "--save", str(d / "ref.pt")], cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                                     env=dict(os.environ, OMP_NUM_THREADS="1"))
        if proc:
            said = proc.communicate(timeout=180)[1]
            assert proc.returncode == 0, said[-3000:]
        else:
            wait_for(f"job {job} leaving the queue", lambda: not on(cluster, "squeue", "-h", "-j", job).stdout.strip(),
                     180)
            said = (d / "job.out").read_text()
            assert job_state(cluster, job) == "COMPLETED", said[-3000:]
        assert f"mpi_launch: not answering: {h1}" in said and f"mpi_launch: restart 1: 2 rank(s) on {h0}," in said, said
        resumed = int(re.search(rf"psrt.train: restart 1: {dp} continues from step (\d+)", said).group(1))
        assert 0 < resumed <= lost_at, (resumed, lost_at)
        rows = [json.loads(line) for line in (d / "m.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if "step" in r][-1] == 100
        assert reference.wait(timeout=120) == 0
        import torch
        a, b = torch.load(d / "out.pt", weights_only=True), torch.load(d / "ref.pt", weights_only=True)
        assert max((a[k].double() - b[k].double()).abs().max().item() for k in a) <= 1e-5
    finally:
        for p in (proc, reference):
            if p and p.poll() is None:
                p.kill()
                p.communicate()
        if job:
            on(cluster, "scancel", job)
        shutil.rmtree(d, ignore_errors=True)
        # The node comes back with its link and slurmd (ReturnToService=2) for whatever runs after.
        C.revive(h1)
        subprocess.run(slurm.on_host(cluster, h1, f"slurmd -N {h1}"), env=slurm.env(cluster), check=True,
                       stdin=subprocess.DEVNULL, timeout=60)
        slurm.wait_idle(cluster)
