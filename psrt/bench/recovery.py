"""`python -m psrt.bench recovery`: what losing a host costs a training run.

On an emulated cluster (psrt.cluster: hosts are network namespaces, root needed) the
command `mpi_launch --emulate --restarts 1 ... python -m psrt.train` runs; when the run has
finished step --kill-at, every process of the last host is killed and its link taken down
(`python -m psrt.cluster fail`).  The watchdog of the survivors finds the host silent, the job
ends, mpi_launch asks the hosts, starts the job again on those that answer, and psrt.train
continues from its last checkpoint.  Per strategy the table shows the time from the failure
to the next completed step, the steps computed twice, and the largest difference between the
final parameters and those of a run that never failed on the survivors' ranks (same global
batch): the two compute the same training.

`--way in-job` measures the other way, recovery inside the job (psrt.train.in_job): the same
number of ranks on this machine under Open MPI 5 with ULFM (PyPI's, built once by
scripts/with_mpi.sh), the last host's share of ranks killed after --kill-at (PSRT_KILL_AT); the
survivors shrink their communicators and go on without a restart (zero1/2/3, ps and
ps-sharded from their last checkpoint, read in the same job).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

from psrt.bench.report import table
from psrt.errors import PsrtError
from psrt.launch.cluster import fail
from psrt.launch.mpi import local_mpirun_prefix
from psrt.train.in_job import FROM_CHECKPOINT, FULL_REPLICA

COLUMNS = [("dp", "dp", "s"), ("way", "way", "s"), ("ranks", "ranks", "s"),
           ("killed_after", "lost after step", "d"), ("resumed_from", "resumed from", "d"),
           ("steps_lost", "steps again", "d"), ("recovery_s", "failure to next step s", ".1f"),
           ("max_diff", "max |diff| vs no failure", ".1e")]
WAYS = ("restart", "in-job")
HELP = ("time from a lost host to the next completed step, per strategy: restarting on the survivors "
        "(emulated hosts, root) and recovering inside the job (Open MPI 5, ULFM)")
ROOT = Path(__file__).resolve().parents[2]


def _env(timeout_s: float) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_", "PMIX_", "PSRT_"))}
    path = [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS="1", PSRT_TIMEOUT=f"{timeout_s:g}")
    return env


def _train_args(dp: str, steps: int, batch: int, width: int) -> list[str]:
    return ["-m", "psrt.train", "--dp", dp, "--steps", str(steps), "--batch-size", str(batch),
            "--width", str(width), "--seed", "5", "--quiet"]


def _wait_for_step(path: Path, step: int, proc, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            reached = int(path.read_text().strip() or 0)
        except (OSError, ValueError):
            reached = 0
        if reached >= step:
            return reached
        time.sleep(0.02)
    raise PsrtError(f"the run did not reach step {step} (exit {proc.poll()})")


def one(dp: str, hosts: int, per_host: int, steps: int, kill_at: int, batch: int, width: int,
        timeout_s: float, folder: Path) -> dict:
    """Run, lose the last host after step `kill_at`, let the job restart; then the same run
    without a failure on the survivors.  Returns the row."""
    tag = zlib.crc32(f"{os.getpid()}:{dp}:{folder}".encode())
    names = [f"r{tag % 10**6:06d}n{i}" for i in range(hosts)]
    hostfile = folder / "hosts"
    hostfile.write_text("".join(f"{h} slots={per_host}\n" for h in names))
    ckpt, final, metrics = folder / f"{dp}.ckpt", folder / f"{dp}.pt", folder / f"{dp}.jsonl"
    env = _env(timeout_s)
    argv = [sys.executable, "-m", "psrt.launch", "--emulate", "--hostfile", str(hostfile),
            "-np", str(hosts * per_host), "--restarts", "1", "--subnet", f"198.19.{200 + tag % 50}.0/24",
            sys.executable] + _train_args(dp, steps, batch, width) + [
            "--checkpoint", str(ckpt), "--save", str(final), "--metrics", str(metrics)]
    with open(folder / f"{dp}.log", "w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                stdin=subprocess.DEVNULL)
        try:
            progress = Path(str(ckpt) + ".step")
            _wait_for_step(progress, kill_at, proc, timeout=600)
            failed = time.time()
            fail(names[-1])              # in this process: the run goes on while a command starts
            at = int(progress.read_text().strip() or 0)
            code = proc.wait(timeout=900)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if code != 0:
        said = [line for line in (folder / f"{dp}.log").read_text().splitlines() if "error:" in line]
        raise PsrtError(f"--dp {dp}: the restarted run ended with exit {code}"
                        + (f": {said[-1].strip()}" if said else ""))
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    back = next(r for r in rows if "restart" in r)
    survivors = (hosts - 1) * per_host
    diff = _diff_to_reference(dp, survivors, steps, batch, width, env, final)
    return {"dp": dp, "way": "restart", "killed_after": at, "resumed_from": back["step"] - 1,
            "steps_lost": back.get("steps_lost", 0), "recovery_s": round(back["unix_time"] - failed, 2),
            "ranks": f"{hosts * per_host} -> {survivors}", "max_diff": diff}


def _diff_to_reference(dp: str, ranks: int, steps: int, batch: int, width: int, env: dict, final: Path) -> float:
    """The largest difference between the parameters saved in `final` and those of a run that
    never failed on `ranks` ranks, same global batch (this machine's MPI)."""
    reference = final.with_suffix(".reference.pt")
    subprocess.run(local_mpirun_prefix(ranks) + [sys.executable]
                   + _train_args(dp, steps, batch, width) + ["--save", str(reference)],
                   env=env, check=True, capture_output=True, cwd=ROOT, stdin=subprocess.DEVNULL)
    import torch
    a, b = torch.load(final), torch.load(reference)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _run_ended(argv: list[str], env: dict, timeout: float) -> tuple[str, int]:
    """(output, exit code) of `argv` (an mpi_launch), which is told to end (SIGTERM: it passes
    that on to its job and kills what is left) if it runs past `timeout` seconds."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, stdin=subprocess.DEVNULL)
    try:
        return proc.communicate(timeout=timeout)[0], proc.returncode
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            log = proc.communicate(timeout=15)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            log = proc.communicate()[0]
        return log + f"\npsrt.bench: error: the run did not end within {timeout:g} s", -1


def in_job_one(dp: str, ranks: int, lose: int, steps: int, kill_at: int, batch: int, width: int,
               timeout_s: float, folder: Path) -> dict:
    """Run on `ranks` ranks of this machine under Open MPI 5 with ULFM (scripts/with_mpi.sh
    builds it once), the last `lose` of them killed (PSRT_KILL_AT) after step `kill_at`; the
    survivors recover inside the job.  Then the same run without a failure on the survivors.
    Returns the row, and the launch's output in the row's "log"."""
    final, metrics = folder / f"{dp}.in-job.pt", folder / f"{dp}.in-job.jsonl"
    env = dict(_env(timeout_s), PSRT_KILL_AT=f"{','.join(map(str, range(ranks - lose, ranks)))}:{kill_at + 1}")
    argv = ["bash", str(ROOT / "scripts" / "with_mpi.sh"), "openmpi5", "--", "python", "-m", "psrt.launch",
            "--in-job-recovery", "-np", str(ranks), "python"] + _train_args(dp, steps, batch, width) + [
            "--save", str(final), "--metrics", str(metrics)]
    if dp in FROM_CHECKPOINT:       # what a lost rank held alone comes back from the checkpoint
        argv += ["--checkpoint", str(folder / f"{dp}.in-job.ckpt.pt"), "--checkpoint-every", str(max(1, steps // 10))]
    log, code = _run_ended(argv, env, timeout=max(120.0, 10 * timeout_s))
    killed = [float(line.rsplit(" at ", 1)[1]) for line in log.splitlines() if "PSRT_KILL_AT: rank" in line]
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    back = next((r for r in rows if "in_job_recovery" in r), None)
    if code != 0 or back is None or not killed:
        said = [line for line in log.splitlines() if "error:" in line]
        raise PsrtError(f"--dp {dp} in-job: the run ended with exit {code}"
                        + (f": {said[-1].strip()}" if said else " without recovering"))
    diff = _diff_to_reference(dp, ranks - lose, steps, batch, width, _env(timeout_s), final)
    return {"dp": dp, "way": "in-job (ULFM)", "killed_after": kill_at, "resumed_from": back["resumed_from"],
            "steps_lost": back["steps_lost"], "recovery_s": round(back["unix_time"] - min(killed), 2),
            "ranks": f"{ranks} -> {ranks - lose}", "max_diff": diff, "log": log}


def _rows(dp: str, ways: list[str], args, folder: Path) -> list[dict]:
    """The rows of strategy `dp`: one per way of recovering that applies to it."""
    rows = []
    if "restart" in ways:
        if not args.quiet:
            print(f"recovery: --dp {dp} on {args.hosts} x {args.per_host} ranks, last host lost "
                  f"after step {args.kill_at} of {args.steps}", file=sys.stderr, flush=True)
        rows.append(one(dp, args.hosts, args.per_host, args.steps, args.kill_at, args.batch_size,
                        args.width, args.timeout, folder))
    if "in-job" in ways and dp in FULL_REPLICA + FROM_CHECKPOINT:
        if not args.quiet:
            print(f"recovery: --dp {dp} on {args.hosts * args.per_host} ranks in one job (Open MPI 5, ULFM), "
                  f"the last {args.per_host} killed after step {args.kill_at} of {args.steps}",
                  file=sys.stderr, flush=True)
        row = in_job_one(dp, args.hosts * args.per_host, args.per_host, args.steps, args.kill_at,
                         args.batch_size, args.width, args.timeout, folder)
        row.pop("log")
        rows.append(row)
    return rows


def command(args) -> int:
    ways = args.way.split(",")
    if set(ways) - set(WAYS):
        raise PsrtError(f"psrt.bench recovery --way {args.way}: choose among {', '.join(WAYS)}")
    if "restart" in ways and os.geteuid() != 0:
        raise PsrtError("psrt.bench recovery: the emulated hosts of --way restart need root "
                        "(--way in-job needs none)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="psrt-recovery-") as tmp:
        for dp in args.dp.split(","):
            folder = Path(tmp) / dp
            folder.mkdir()
            rows += _rows(dp, ways, args, folder)
    table(rows, COLUMNS)
    print(f"recovery_s: from the failure to the next completed step (restart: the survivors' watchdog "
          f"finds the host silent within PSRT_TIMEOUT={args.timeout:g} s, then the restart; in-job: the "
          "survivors' next collective fails, they shrink and go on); max_diff: final parameters against "
          "a run that never failed, same global batch")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def add_arguments(p) -> None:
    p.add_argument("--dp", default="ring,zero1,ps", help="strategies, comma list")
    p.add_argument("--way", default="restart,in-job",
                   help="restart (mpi_launch --restarts on emulated hosts, root), in-job (mpi_launch "
                        "--in-job-recovery on this machine, Open MPI 5 from PyPI)")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--per-host", type=int, default=4, help="ranks per host (in-job: the ranks lost)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--kill-at", type=int, default=30, help="lose the last host after this step")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--timeout", type=float, default=10.0,
                   help="PSRT_TIMEOUT of the run: how long the survivors wait for a silent host")
    p.add_argument("--json")
    p.add_argument("--quiet", action="store_true")
