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

In-job recovery (the survivors shrinking their communicators, MPI's ULFM) needs an MPI built
with it; this command measures the restart way.
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

COLUMNS = [("dp", "dp", "s"), ("way", "way", "s"), ("ranks", "ranks", "s"),
           ("killed_after", "lost after step", "d"), ("resumed_from", "resumed from", "d"),
           ("steps_lost", "steps again", "d"), ("recovery_s", "failure to next step s", ".1f"),
           ("max_diff", "max |diff| vs no failure", ".1e")]
HELP = "time from a lost host to the next completed step, per strategy (emulated hosts, root)"
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
    reference = folder / f"{dp}.reference.pt"
    subprocess.run(local_mpirun_prefix(survivors) + [sys.executable]
                   + _train_args(dp, steps, batch, width) + ["--save", str(reference)],
                   env=env, check=True, capture_output=True, cwd=ROOT, stdin=subprocess.DEVNULL)
    import torch
    a, b = torch.load(final), torch.load(reference)
    diff = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    return {"dp": dp, "way": "restart", "killed_after": at, "resumed_from": back["step"] - 1,
            "steps_lost": back.get("steps_lost", 0), "recovery_s": round(back["unix_time"] - failed, 2),
            "ranks": f"{hosts * per_host} -> {survivors}", "max_diff": diff}


def command(args) -> int:
    if os.geteuid() != 0:
        raise PsrtError("psrt.bench recovery: the emulated hosts need root")
    rows = []
    with tempfile.TemporaryDirectory(prefix="psrt-recovery-") as tmp:
        for dp in args.dp.split(","):
            folder = Path(tmp) / dp
            folder.mkdir()
            if not args.quiet:
                print(f"recovery: --dp {dp} on {args.hosts} x {args.per_host} ranks, last host lost "
                      f"after step {args.kill_at} of {args.steps}", file=sys.stderr, flush=True)
            rows.append(one(dp, args.hosts, args.per_host, args.steps, args.kill_at, args.batch_size,
                            args.width, args.timeout, folder))
    table(rows, COLUMNS)
    print(f"recovery_s: from the host's failure to the next completed step (the survivors' watchdog "
          f"finds it silent within PSRT_TIMEOUT={args.timeout:g} s, then the restart); max_diff: final "
          "parameters against a run that never failed, same global batch")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def add_arguments(p) -> None:
    p.add_argument("--dp", default="ring,zero1,ps", help="strategies, comma list")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--per-host", type=int, default=4, help="ranks per host")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--kill-at", type=int, default=30, help="lose the last host after this step")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--timeout", type=float, default=10.0,
                   help="PSRT_TIMEOUT of the run: how long the survivors wait for a silent host")
    p.add_argument("--json")
    p.add_argument("--quiet", action="store_true")
