"""Slurm on the emulated hosts (psrt.cluster up --slurm): srun and sbatch jobs, placement,
results equal to mpirun's, faults, and nothing left behind.

Needs root, `ip netns` and Debian's slurmctld/slurmd/slurm-client/munge (scripts/install.sh).
One two-host cluster serves the module; hosts and subnet are unique to this process.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from psrt.launch import cluster as C
from psrt.launch import slurm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
from test_cluster import _MISSING  # noqa: E402

_NO_SLURM = None if all(shutil.which(b) or Path("/usr/sbin", b).exists()
                        for b in ("slurmctld", "slurmd", "srun", "munged")) else \
    "needs slurmctld, slurmd, slurm-client and munge (scripts/install.sh)"
pytestmark = [pytest.mark.netns, pytest.mark.mpi,
              pytest.mark.skipif(_MISSING is not None or _NO_SLURM is not None,
                                 reason=str(_MISSING or _NO_SLURM))]
OUT = Path("/var/tmp")      # visible to the jobs: each slurmd has a /tmp of its own


@pytest.fixture(scope="module")
def cluster():
    tag = zlib.crc32(f"{os.getpid()}:slurm".encode())
    c = C.Cluster((f"s{tag % 10**7:07d}a", f"s{tag % 10**7:07d}b"), f"198.19.{tag % 256}.0/24", slurm=True)
    C.up(c)
    try:
        yield c
    finally:
        C.down(c)
        assert_gone(c)


def assert_gone(c: C.Cluster):
    assert not set(c.namespaces) & C.existing_namespaces()
    assert not slurm.folder(c).exists()
    left = subprocess.run(["pgrep", "-af", str(slurm.folder(c))], capture_output=True, text=True).stdout
    assert not left.strip(), left


def on(c: C.Cluster, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run argv on the first host with the cluster's MPI settings and SLURM_CONF."""
    env = C.job_env(c, "openmpi4", dict(os.environ, OMP_NUM_THREADS="1"))
    return subprocess.run(C.exec_argv(c.hosts[0], list(argv)), env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, cwd=ROOT)


def batch(c: C.Cluster, *argv: str, timeout: float = 240) -> str:
    """sbatch ARGV, then wait for the job to leave the queue (sbatch --wait polls slowly);
    returns the job id."""
    sub = on(c, "sbatch", "--parsable", *argv)
    assert sub.returncode == 0, sub.stdout + sub.stderr
    job = sub.stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout
    while on(c, "squeue", "-h", "-j", job).stdout.strip():
        assert time.monotonic() < deadline, f"job {job} still queued after {timeout} s"
        time.sleep(0.3)
    return job


def summary_rows(text: str) -> dict:
    """strategy -> (train loss, test loss, test acc) from psrt.train's summary table."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"^(ps|ring)\s+\d+\s+\d+\s+([\d.]+)\s+([\d.]+)\s+([\d.]+%)", line)
        if m:
            rows[m.group(1)] = m.groups()[1:]
    return rows


def test_every_node_is_idle(cluster):
    assert slurm.node_states(cluster) == {h: "idle" for h in cluster.hosts}


def test_srun_places_ranks_as_slurm_does(cluster):
    run = on(cluster, "srun", "-N", "2", "--ntasks-per-node", "2", "--mpi=pmix", sys.executable, "-m", "psrt.info")
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"4 ranks on 2 hosts: {cluster.hosts[0]} ranks 0-1; {cluster.hosts[1]} ranks 2-3" in run.stdout
    assert "placement matches Slurm's" in run.stdout, run.stdout


def test_srun_training_equals_mpirun(cluster, tmp_path):
    train = [sys.executable, "-m", "psrt.train", "--dp", "ps,ring", "--steps", "5", "--quiet",
             "--data", "synthetic", "--width", "16", "--batch-size", "16"]
    by_srun = on(cluster, "srun", "-N", "2", "--ntasks-per-node", "2", "--mpi=pmix", *train)
    assert by_srun.returncode == 0, by_srun.stderr[-3000:]
    hostfile = OUT / f"psrt-hosts-{os.getpid()}"
    hostfile.write_text(f"{cluster.hosts[0]} slots=2\n{cluster.hosts[1]} slots=2\n")
    try:
        by_mpirun = on(cluster, "mpirun", "-np", "4", "-hostfile", str(hostfile), *train)
    finally:
        hostfile.unlink()
    assert by_mpirun.returncode == 0, by_mpirun.stderr[-3000:]
    rows = summary_rows(by_srun.stdout)
    assert set(rows) == {"ps", "ring"} and rows == summary_rows(by_mpirun.stdout), (by_srun.stdout, by_mpirun.stdout)


def test_torch_ddp_script_under_srun(cluster):
    """The psrt torch.distributed backend under srun: rendezvous from MPI across the hosts."""
    run = on(cluster, "srun", "-N", "2", "--ntasks-per-node", "1", "--mpi=pmix", sys.executable,
             "examples/torch_ddp.py", "--epochs", "1")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "DDP on psrt: 2 ranks" in run.stdout and "epoch 0: loss" in run.stdout


def test_sbatch_job_script(cluster):
    out = OUT / f"psrt-sbatch-{os.getpid()}.out"
    try:
        batch(cluster, "--ntasks-per-node", "2", f"--output={out}",
              "examples/slurm_job.sh", "--steps", "3", "--quiet", "--data", "synthetic", "--width", "16")
        text = out.read_text()
    finally:
        out.unlink(missing_ok=True)
    assert re.search(r"job \d+ on \S+: 4 tasks", text), text
    assert "placement matches Slurm's" in text and set(summary_rows(text)) == {"ps", "ring"}, text


def test_a_killed_rank_ends_the_step(cluster):
    """KillOnBadExit: the other ranks do not wait for the dead one; srun names it and fails."""
    t0 = time.monotonic()
    run = on(cluster, "srun", "-N", "2", "--ntasks-per-node", "2", "--mpi=pmix", sys.executable,
             str(ROOT / "tests" / "mpi" / "ranks" / "fault_rank.py"), "kill", "3", "1", timeout=120)
    assert run.returncode != 0
    assert "finished" not in run.stdout
    assert re.search(r"task 3: Killed", run.stderr), run.stderr[-3000:]
    assert time.monotonic() - t0 < 60


def test_scancel_ends_a_job(cluster):
    sub = on(cluster, "sbatch", "--parsable", "-N", "2", "--ntasks-per-node", "1", "--output=/dev/null",
             "--wrap", f"srun --mpi=pmix {sys.executable} -m psrt.train --dp ring --steps 100000 --quiet")
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "R" not in on(cluster, "squeue", "-h", "-j", job, "-o", "%t").stdout:
        time.sleep(0.5)
    assert on(cluster, "scancel", job).returncode == 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and on(cluster, "squeue", "-h", "-j", job).stdout.strip():
        time.sleep(0.5)
    assert not on(cluster, "squeue", "-h", "-j", job).stdout.strip(), "the job is still queued"
    time.sleep(2)
    left = subprocess.run(["pgrep", "-af", "psrt.train --dp ring --steps 100000"], capture_output=True, text=True)
    assert not left.stdout.strip(), left.stdout


def test_scancel_then_resume_in_a_new_batch_job_is_bitwise_identical(cluster):
    """A job frozen after its 2nd checkpoint is cancelled; a new sbatch job resumes it with
    --resume and ends with exactly the parameters of an uninterrupted run."""
    d = OUT / f"psrt-resume-{os.getpid()}"
    d.mkdir(exist_ok=True)
    train = ["--data", "synthetic", "--width", "16", "--batch-size", "16", "--steps", "12",
             "--checkpoint-every", "3", "--quiet", "--seed", "3", "--dp", "ring"]
    srun = f"srun -N 2 --ntasks-per-node 1 --mpi=pmix {sys.executable}"
    try:
        ref = on(cluster, *srun.split(), "-m", "psrt.train", *train, "--checkpoint", str(d / "ref.ckpt"),
                 "--save", str(d / "ref.pt"))
        assert ref.returncode == 0, ref.stderr[-3000:]
        frozen = " ".join([str(ROOT / "tests" / "mpi" / "ranks" / "fault_ckpt.py"), "2", str(d / "marker"), "--",
                           *train, "--checkpoint", str(d / "run.ckpt"), "--save", str(d / "out.pt")])
        sub = on(cluster, "sbatch", "--parsable", "-N", "2", "--ntasks-per-node", "1",
                 f"--output={d}/first.out", "--wrap", f"{srun} {frozen}")
        assert sub.returncode == 0, sub.stderr
        job = sub.stdout.strip().split(";")[0]
        deadline = time.monotonic() + 120
        while not (d / "marker").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (d / "marker").read_text() == "6"
        assert on(cluster, "scancel", job).returncode == 0
        while on(cluster, "squeue", "-h", "-j", job).stdout.strip() and time.monotonic() < deadline:
            time.sleep(0.3)
        assert not (d / "out.pt").exists()
        resumed = " ".join(["-m", "psrt.train", *train, "--checkpoint", str(d / "run.ckpt"), "--resume",
                            "--save", str(d / "out.pt")])
        batch(cluster, "-N", "2", "--ntasks-per-node", "1", f"--output={d}/second.out",
              "--wrap", f"{srun} {resumed}")
        assert (d / "out.pt").exists(), (d / "second.out").read_text()[-3000:]
        import torch
        a, b = torch.load(d / "ref.pt", weights_only=True), torch.load(d / "out.pt", weights_only=True)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_salloc_then_mpirun_or_mpi_launch(cluster):
    """Inside an allocation Open MPI's mpirun reads it, and mpi_launch picks srun."""
    alloc = ["salloc", "-N", "2", "--ntasks-per-node", "2"]
    by_mpirun = on(cluster, *alloc, "mpirun", sys.executable, "-m", "psrt.info")
    assert by_mpirun.returncode == 0, by_mpirun.stderr[-3000:]
    assert f"4 ranks on 2 hosts: {cluster.hosts[0]} ranks 0-1; {cluster.hosts[1]} ranks 2-3" in by_mpirun.stdout
    by_launch = on(cluster, *alloc, str(ROOT / "mpi_launch"), "--extra-args=--mpi=pmix", sys.executable,
                   "-m", "psrt.info")
    assert by_launch.returncode == 0, by_launch.stderr[-3000:]
    assert "launcher srun" in by_launch.stdout and "placement matches Slurm's" in by_launch.stdout


def test_a_lost_node_ends_the_job_naming_it(cluster):
    """Every process of the second host (its slurmd, the job's step and ranks) is killed at once
    mid-job: the job ends, naming the lost node.  Runs last: the node stays down."""
    env_timeout = "PSRT_TIMEOUT=4"
    proc = subprocess.Popen(
        C.exec_argv(cluster.hosts[0], ["sh", "-c", f"{env_timeout} exec srun -N 2 --ntasks-per-node 1 --mpi=pmix "
                                       f"{sys.executable} -m psrt.train --dp ring --steps 100000 --quiet"]),
        env=C.job_env(cluster, "openmpi4", dict(os.environ, OMP_NUM_THREADS="1")), cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:     # wait until the ranks train on the second host
            pids = subprocess.run(["ip", "netns", "pids", cluster.hosts[1]], capture_output=True, text=True).stdout
            if any("psrt.train" in Path(f"/proc/{p}/cmdline").read_text(errors="ignore")
                   for p in pids.split() if Path(f"/proc/{p}/cmdline").exists()):
                break
            time.sleep(0.3)
        time.sleep(3)
        t0 = time.monotonic()
        pids = subprocess.run(["ip", "netns", "pids", cluster.hosts[1]], capture_output=True, text=True).stdout
        for pid in pids.split():          # the node dies at once: slurmd, slurmstepd, the rank
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 60
    # Whoever notices first says which node is gone: Slurm (its slurmd stopped answering) or
    # psrt's watchdog (its rank stopped sending heartbeats).
    assert (f"Node failure on {cluster.hosts[1]}" in err
            or f"rank 1 ({cluster.hosts[1]}): not heard from" in err), err[-3000:]
