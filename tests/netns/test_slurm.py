"""Slurm on the emulated hosts (python -m psrt.cluster up --slurm): srun and sbatch jobs,
placement, results equal to mpirun's, faults, and nothing left behind.

Needs root, `ip netns` and Debian's slurmctld/slurmd/slurm-client/munge (scripts/install.sh).
One two-host cluster, brought up and down through the command line, serves most of the
module; tests of signals and of a Slurm that fails to start make small clusters of their own.
Host names and subnets are unique to this process.
"""
from __future__ import annotations

import contextlib
import json
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

from conftest import PYTHON, interruptible
from psrt.errors import PsrtError
from psrt.launch import cluster as C
from psrt.launch import slurm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
from test_cluster import _MISSING  # noqa: E402
from test_cluster import assert_gone as assert_no_cluster  # noqa: E402

_NO_SLURM = None if all(shutil.which(b) or Path("/usr/sbin", b).exists()
                        for b in ("slurmctld", "slurmd", "srun", "munged")) else \
    "needs slurmctld, slurmd, slurm-client and munge (scripts/install.sh)"
pytestmark = [pytest.mark.netns, pytest.mark.mpi,
              pytest.mark.skipif(_MISSING is not None or _NO_SLURM is not None,
                                 reason=str(_MISSING or _NO_SLURM))]
OUT = Path("/var/tmp")      # visible to the jobs: each slurmd has a /tmp of its own
CPUS = 4                    # slots per host in the module's hostfile: slurm_job.sh's 2 x 4 fits
FAULT_RANK = ROOT / "tests" / "mpi" / "ranks" / "fault_rank.py"


def _names(tag: str) -> tuple[tuple, str]:
    t = zlib.crc32(f"{os.getpid()}:{tag}".encode())
    return (f"s{t % 10**7:07d}a", f"s{t % 10**7:07d}b"), f"198.19.{t % 256}.0/24"


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "psrt.cluster", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, timeout=240,
                          stdin=subprocess.DEVNULL, **kw)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """`python -m psrt.cluster up --slurm --hostfile F --rate 1gbit`, and `down` at the end
    (which has then to find a slurmd whose namespace was deleted under it)."""
    hosts, subnet = _names("slurm")
    hostfile = tmp_path_factory.mktemp("slurm") / "hosts"
    hostfile.write_text("".join(f"{h} slots={CPUS}\n" for h in hosts))
    spec = ["--hostfile", str(hostfile), "--subnet", subnet]
    c = C.Cluster(hosts, subnet, rate="1gbit", slurm=True, slots=(CPUS, CPUS))
    up = _cli("up", "--slurm", "--rate", "1gbit", *spec)
    try:
        assert up.returncode == 0, up.stderr
        assert up.stdout.splitlines() == [
            c.describe()[0],
            f"run: python -m psrt.cluster exec {hosts[0]} -- srun -N 2 -n {2 * CPUS} --mpi=pmix ...; "
            "remove: python -m psrt.cluster down"], up.stdout
        yield c
    finally:
        # As after a crash: the second host's namespace is already gone (its slurmd lives on
        # in it, nameless), so `down` must find that slurmd by its pid file.
        subprocess.run(["ip", "netns", "del", hosts[1]], capture_output=True)
        down = _cli("down", *spec)
        assert down.returncode == 0 and f"removed {hosts[0]} ({hosts[0]}, {hosts[1]})" in down.stdout, down.stderr
        assert_gone(c)


def assert_gone(c: C.Cluster):
    """Nothing of the cluster is left: namespaces, hosts files, record, mounts (test_cluster),
    Slurm's folder, and no slurmctld, slurmd, slurmstepd or munged of ours."""
    assert_no_cluster(c)
    assert not slurm.folder(c).exists()
    left = {p: Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ") for p in slurm.our_processes(c)}
    assert not left, left


def on(c: C.Cluster, *argv: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run argv on the first host with the cluster's MPI settings and SLURM_CONF."""
    env = C.job_env(c, "openmpi4", dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    return subprocess.run(C.exec_argv(c.hosts[0], list(argv)), env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, cwd=ROOT)


def submit(c: C.Cluster, *argv: str) -> str:
    """sbatch ARGV; returns the job id."""
    sub = on(c, "sbatch", "--parsable", *argv)
    assert sub.returncode == 0, sub.stdout + sub.stderr
    return sub.stdout.strip().split(";")[0]


def wait_for(what: str, check, timeout: float):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.3)
    return value


def batch(c: C.Cluster, *argv: str, timeout: float = 240) -> str:
    """sbatch ARGV, then wait for the job to leave the queue (sbatch --wait polls slowly);
    returns the job id."""
    job = submit(c, *argv)
    wait_for(f"job {job} leaving the queue", lambda: not on(c, "squeue", "-h", "-j", job).stdout.strip(), timeout)
    return job


def job_state(c: C.Cluster, job: str) -> str:
    """RUNNING, COMPLETED, CANCELLED, ... as slurmctld keeps it (MinJobAge: 5 minutes)."""
    m = re.search(r"\bJobState=(\S+)", on(c, "scontrol", "-o", "show", "job", job).stdout)
    return m.group(1) if m else ""


def running_on(c: C.Cluster, host: str, text: str) -> list[int]:
    """Pids in `host`'s namespace whose command line contains `text`."""
    pids = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True).stdout.split()
    found = []
    for p in pids:
        try:
            if text in Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                found.append(int(p))
        except OSError:
            pass
    return found


def steps_left(c: C.Cluster) -> list[int]:
    return [p for p in slurm.our_processes(c) if Path(f"/proc/{p}/comm").read_text().strip() == "slurmstepd"]


def summary_rows(text: str) -> dict:
    """strategy -> (train loss, test loss, test acc) from psrt.train's summary table."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"^(ps|ring)\s+\d+\s+\d+\s+([\d.]+)\s+([\d.]+)\s+([\d.]+%)", line)
        if m:
            rows[m.group(1)] = m.groups()[1:]
    return rows


def hostfile_for(c: C.Cluster, slots: int) -> Path:
    path = OUT / f"psrt-hosts-{os.getpid()}-{slots}"
    path.write_text("".join(f"{h} slots={slots}\n" for h in c.hosts))
    return path


TRAIN = ["--steps", "3", "--quiet", "--data", "synthetic", "--width", "16", "--batch-size", "16"]


# --- the cluster and its jobs ----------------------------------------------------------------

def test_every_node_is_idle_with_its_slots_and_shaped_link(cluster):
    assert slurm.node_states(cluster) == {h: "idle" for h in cluster.hosts}
    cpus = on(cluster, "sinfo", "-h", "-N", "-o", "%N %c").stdout.split()
    assert cpus == [cluster.hosts[0], str(CPUS), cluster.hosts[1], str(CPUS)]
    classes = subprocess.run(["tc", "-n", cluster.hosts[1], "class", "show", "dev", C.IFACE],
                             capture_output=True, text=True).stdout
    assert "class htb 1:1 root rate 1Gbit ceil 1Gbit" in classes, classes


def test_srun_places_ranks_as_slurm_does(cluster):
    run = on(cluster, "srun", "-N", "2", "--ntasks-per-node", "2", "--mpi=pmix", sys.executable, "-m", "psrt.info")
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"4 ranks on 2 hosts: {cluster.hosts[0]} ranks 0-1; {cluster.hosts[1]} ranks 2-3" in run.stdout
    assert "placement matches Slurm's" in run.stdout, run.stdout


def test_torch_ddp_script_under_srun(cluster):
    """The psrt torch.distributed backend under srun: rendezvous from MPI across the hosts."""
    run = on(cluster, "srun", "-N", "2", "--ntasks-per-node", "1", "--mpi=pmix", sys.executable,
             "examples/torch_ddp.py", "--epochs", "1")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "DDP on psrt: 2 ranks" in run.stdout and "epoch 0: loss" in run.stdout


def test_sbatch_job_script_as_it_stands_equals_mpirun(cluster):
    """`sbatch examples/slurm_job.sh` with its own #SBATCH shape: 2 nodes x 4 tasks (8 ranks
    on the 2 cores, oversubscribed), its output in psrt-JOBID.out where it was submitted; the
    training summary of its `srun` step equals the same 8 ranks under mpirun."""
    job = batch(cluster, "examples/slurm_job.sh", *TRAIN)
    out = ROOT / f"psrt-{job}.out"
    try:
        text = out.read_text()
    finally:
        out.unlink(missing_ok=True)
    h0, h1 = cluster.hosts
    assert job_state(cluster, job) == "COMPLETED", text
    assert re.search(rf"^job {job} on \S+: 8 tasks$", text, re.M), text
    assert f"8 ranks on 2 hosts: {h0} ranks 0-3; {h1} ranks 4-7" in text
    assert "placement matches Slurm's" in text
    hostfile = hostfile_for(cluster, CPUS)
    try:
        by_mpirun = on(cluster, "mpirun", "-np", "8", "-hostfile", str(hostfile), sys.executable, "-m",
                       "psrt.train", "--dp", "ps,ring", *TRAIN)
    finally:
        hostfile.unlink()
    assert by_mpirun.returncode == 0, by_mpirun.stderr[-3000:]
    rows = summary_rows(text)
    assert set(rows) == {"ps", "ring"} and rows == summary_rows(by_mpirun.stdout), (text, by_mpirun.stdout)


def test_salloc_then_mpirun_or_mpi_launch(cluster):
    """Inside an allocation Open MPI's mpirun reads it, and mpi_launch picks srun."""
    alloc = ["salloc", "-N", "2", "--ntasks-per-node", "2"]
    by_mpirun = on(cluster, *alloc, "mpirun", sys.executable, "-m", "psrt.info")
    assert by_mpirun.returncode == 0, by_mpirun.stderr[-3000:]
    assert f"4 ranks on 2 hosts: {cluster.hosts[0]} ranks 0-1; {cluster.hosts[1]} ranks 2-3" in by_mpirun.stdout
    assert re.search(r"Slurm job \d+ on \S+: ranks started by openmpi inside the allocation, not by srun",
                     by_mpirun.stdout), by_mpirun.stdout
    by_launch = on(cluster, *alloc, str(ROOT / "mpi_launch"), "--extra-args=--mpi=pmix", sys.executable,
                   "-m", "psrt.info")
    assert by_launch.returncode == 0, by_launch.stderr[-3000:]
    assert "launcher srun" in by_launch.stdout and "placement matches Slurm's" in by_launch.stdout


# --- faults ----------------------------------------------------------------------------------

def test_a_killed_rank_ends_the_step_with_one_line_and_slurms_exit_code(cluster):
    """KillOnBadExit: the other ranks do not wait for the dead one.  srun's first error line
    names the task that died, its node and its signal; then srun ends the other tasks (SIGTERM)
    and exits with the job's exit code as Slurm records it (128 + its signal)."""
    t0 = time.monotonic()
    run = on(cluster, "srun", "-N", "2", "--ntasks-per-node", "2", "--mpi=pmix", sys.executable,
             str(FAULT_RANK), "kill", "3", "1", timeout=120)
    elapsed = time.monotonic() - t0
    assert "finished" not in run.stdout
    said = [line for line in run.stderr.splitlines() if line.startswith("srun: error:")]
    assert said[0] == f"srun: error: {cluster.hosts[1]}: task 3: Killed", run.stderr[-3000:]
    assert not any("task 3" in line for line in said[1:]), said
    job = re.search(r"StepId=(\d+)\.0", run.stderr).group(1)
    wait_for(f"job {job} ending", lambda: job_state(cluster, job) not in ("RUNNING", "COMPLETING"), 30)
    record = on(cluster, "scontrol", "-o", "show", "job", job).stdout
    code, sig = map(int, re.search(r"\bExitCode=(\d+):(\d+)", record).groups())
    assert "JobState=FAILED" in record and sig in (signal.SIGTERM, signal.SIGKILL), record
    assert run.returncode == 128 + sig, (run.returncode, record)
    assert elapsed < 60
    wait_for("the step's slurmstepds ending", lambda: not steps_left(cluster), 30)


def test_scancel_ends_a_running_job(cluster):
    """A job seen RUNNING, with its ranks on both hosts, ends CANCELLED within Slurm's
    KillWait, and none of its processes is left."""
    tag = f"--steps {100000 + os.getpid() % 1000}"
    job = submit(cluster, "-N", "2", "--ntasks-per-node", "1", "--output=/dev/null", "--wrap",
                 f"srun --mpi=pmix {sys.executable} -m psrt.train --dp ring {tag} --quiet")
    wait_for("the job running on both hosts", lambda: job_state(cluster, job) == "RUNNING"
             and all(running_on(cluster, h, tag) for h in cluster.hosts), 120)
    t0 = time.monotonic()
    assert on(cluster, "scancel", job).returncode == 0
    wait_for(f"job {job} leaving the queue", lambda: not on(cluster, "squeue", "-h", "-j", job).stdout.strip(), 60)
    assert job_state(cluster, job) == "CANCELLED"
    wait_for("the ranks and steps ending", lambda: not any(running_on(cluster, h, tag) for h in cluster.hosts)
             and not steps_left(cluster), 30)
    assert time.monotonic() - t0 < slurm.KILL_WAIT_S + 15


def test_scancel_then_resume_in_a_new_batch_job_is_bitwise_identical(cluster):
    """A job frozen after its checkpoint at step 6 is cancelled; examples/slurm_job.sh, as a
    new sbatch job, resumes it with --resume from step 6 (steps 7-12 only) and ends with
    exactly the parameters of an uninterrupted run."""
    d = OUT / f"psrt-resume-{os.getpid()}"
    d.mkdir(exist_ok=True)
    train = ["--data", "synthetic", "--width", "16", "--batch-size", "16", "--steps", "12",
             "--checkpoint-every", "3", "--seed", "3", "--dp", "ring"]
    srun = f"srun -N 2 --ntasks-per-node 1 --mpi=pmix {sys.executable}"
    try:
        ref = on(cluster, *srun.split(), "-m", "psrt.train", *train, "--quiet", "--checkpoint", str(d / "ref.ckpt"),
                 "--save", str(d / "ref.pt"))
        assert ref.returncode == 0, ref.stderr[-3000:]
        frozen = " ".join([str(ROOT / "tests" / "mpi" / "ranks" / "fault_ckpt.py"), "2", str(d / "marker"), "--",
                           *train, "--quiet", "--checkpoint", str(d / "run.ckpt"), "--save", str(d / "out.pt")])
        job = submit(cluster, "-N", "2", "--ntasks-per-node", "1", f"--output={d}/first.out", "--wrap",
                     f"{srun} {frozen}")
        wait_for("the second checkpoint", lambda: (d / "marker").exists(), 120)
        assert (d / "marker").read_text() == "6" and job_state(cluster, job) == "RUNNING"
        assert on(cluster, "scancel", job).returncode == 0
        wait_for(f"job {job} leaving the queue", lambda: not on(cluster, "squeue", "-h", "-j", job).stdout.strip(), 60)
        assert job_state(cluster, job) == "CANCELLED" and not (d / "out.pt").exists()
        second = batch(cluster, "-N", "2", "--ntasks-per-node", "1", f"--output={d}/second.out",
                       "examples/slurm_job.sh", *train, "--checkpoint", str(d / "run.ckpt"), "--resume",
                       "--save", str(d / "out.pt"), "--metrics", str(d / "m.jsonl"))
        text = (d / "second.out").read_text()
        assert job_state(cluster, second) == "COMPLETED", text[-3000:]
        assert f"psrt.train: resuming ring from {d}/run.ckpt at step 6" in text, text[-3000:]
        steps = [r["step"] for r in map(json.loads, (d / "m.jsonl").read_text().splitlines()) if "step" in r]
        assert steps == list(range(7, 13)), steps
        import torch
        a, b = torch.load(d / "ref.pt", weights_only=True), torch.load(d / "out.pt", weights_only=True)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_node_whose_slurmd_stops_ends_the_job_naming_it(cluster):
    """The second host's slurmd alone is killed mid-job (its job step and rank keep running):
    slurmctld hears nothing from the node for SlurmdTimeout, declares it DOWN and ends the job,
    and srun names the node.  Its slurmd is started again afterwards."""
    h0, h1 = cluster.hosts
    tag = f"--steps {200000 + os.getpid() % 1000}"
    proc = subprocess.Popen(
        C.exec_argv(h0, ["srun", "-N", "2", "--ntasks-per-node", "1", "--mpi=pmix", sys.executable, "-m",
                         "psrt.train", "--dp", "ring", *tag.split(), "--quiet"]),
        env=C.job_env(cluster, "openmpi4", dict(os.environ, OMP_NUM_THREADS="1")), cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        wait_for("the rank on the second host", lambda: running_on(cluster, h1, tag), 60)
        time.sleep(2)
        slurmd = int((slurm.folder(cluster) / h1 / "slurmd.pid").read_text())
        assert Path(f"/proc/{slurmd}/comm").read_text().strip() == "slurmd"
        os.kill(slurmd, signal.SIGKILL)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=120)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert f"Node failure on {h1}" in err, err[-3000:]
    # Not heard from for SlurmdTimeout, noticed at the next ping round (a third of it) once
    # that ping has failed (MessageTimeout at most), then the job's KillWait; 10 s more for a
    # loaded machine.  (Measured here: 25 s from the kill to srun's exit.)
    bound = slurm.SLURMD_TIMEOUT_S * 4 / 3 + slurm.MESSAGE_TIMEOUT_S + slurm.KILL_WAIT_S + 10
    assert elapsed < bound, (elapsed, bound)
    assert slurm.node_states(cluster)[h1].startswith("down")
    # The node comes back with its slurmd (ReturnToService=2), for whatever runs after.
    subprocess.run(slurm.on_host(cluster, h1, f"slurmd -N {h1}"), env=slurm.env(cluster), check=True,
                   stdin=subprocess.DEVNULL, timeout=60)
    slurm.wait_idle(cluster)


# --- clusters of their own -------------------------------------------------------------------

def test_cluster_run_slurm_ends_everything_on_ctrl_c_and_sigterm():
    """`python -m psrt.cluster run --slurm -- CMD` interrupted while CMD runs: exit 128 + the
    signal, one line at most, and nothing of the cluster left."""
    runs = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        hosts, subnet = _names(f"signal-{int(sig)}")
        # a fresh interpreter (not the suite's warm python): the signal goes to psrt.cluster itself
        cmd = [PYTHON, "-m", "psrt.cluster", "run", "--slurm", "--hosts", ",".join(hosts),
               "--subnet", subnet, "--", "sleep", "120"]
        runs[sig] = (C.Cluster(hosts, subnet, slurm=True), subprocess.Popen(
            cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE, text=True,
            stdin=subprocess.DEVNULL, preexec_fn=interruptible))
    try:
        for sig, (c, proc) in runs.items():
            # CMD starts once every node is idle: Slurm is fully up when the signal comes.
            wait_for("the command on the first host",
                     lambda: proc.poll() is not None or running_on(c, c.hosts[0], "sleep 120"), 180)
            assert proc.poll() is None, proc.stderr.read()
            proc.send_signal(sig)
        for sig, (c, proc) in runs.items():
            assert proc.wait(timeout=60) == 128 + sig
            assert "Traceback" not in proc.stderr.read()
            assert_gone(c)
    finally:
        for c, proc in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            C.down(c)


def test_a_slurm_that_fails_to_start_leaves_nothing_and_keeps_its_logs(monkeypatch):
    """A bad slurm.conf value (slurmctld refuses to start) and a slurmd that never starts (its
    node never turns idle): one line each, naming the daemon or the node and where the logs
    were kept, and nothing of the cluster left."""
    monkeypatch.setattr(slurm, "READY_TIMEOUT_S", 5)
    config, on_host = slurm.config, slurm.on_host
    hosts, subnet = _names("bad-conf")
    bad_conf = C.Cluster(hosts, subnet, slurm=True)
    kept = slurm.KEPT_LOGS / hosts[0]
    try:
        monkeypatch.setattr(slurm, "config", lambda c: config(c).replace("KillWait=", "KillWait=soon"))
        with pytest.raises(PsrtError, match=rf"starting slurmctld on {hosts[0]} failed: .*; logs kept in {kept}") as err:
            C.up(bad_conf)
        assert_gone(bad_conf)
        assert "KillWait" in str(err.value) and (kept / "munge" / "munged.log").exists()
    finally:
        shutil.rmtree(kept, ignore_errors=True)
        C.down(bad_conf)
    monkeypatch.setattr(slurm, "config", config)
    hosts, subnet = _names("no-slurmd")
    no_slurmd = C.Cluster(hosts, subnet, slurm=True)
    kept = slurm.KEPT_LOGS / hosts[0]

    def without_second_slurmd(c, host, command, keep=ROOT):
        return on_host(c, host, "true" if command.startswith("slurmd") and host == c.hosts[1] else command, keep)

    monkeypatch.setattr(slurm, "on_host", without_second_slurmd)
    try:
        with pytest.raises(PsrtError, match=rf"Slurm did not come up within 5 s \(.*{hosts[1]} (unk|down)\S*\); "
                                            rf"logs kept in {kept} \({hosts[1]} has no slurmd log\)$") as err:
            C.up(no_slurmd)
        assert_gone(no_slurmd)
        assert (kept / "ctld" / "slurmctld.log").exists() and (kept / hosts[0] / "slurmd.log").exists()
    finally:
        shutil.rmtree(kept, ignore_errors=True)
        C.down(no_slurmd)
        with contextlib.suppress(OSError):
            slurm.KEPT_LOGS.rmdir()
