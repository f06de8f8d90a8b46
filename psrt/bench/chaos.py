"""`python -m psrt.bench chaos --trials N --seed S`: faults at moments drawn from a seed, and
whether every run still ends with the parameters of a run that never failed.

The schedule (psrt/bench/nemesis.py) is drawn first and printed; then each trial runs
`mpi_launch --restarts 2` (two ranks on this machine, or on two emulated hosts of one rank for
a lost host or a cut link) or `mpi_launch --in-job-recovery` (three ranks, Open MPI 5 from
PyPI through scripts/with_mpi.sh; for a lost host, two emulated hosts of two ranks and one) with
`python -m psrt.train`, and its fault strikes:

- from inside a rank (PSRT_FAULT, psrt.faults.strike_if_asked) for a SIGKILL, a SIGSTOP and
  the moments of psrt.train (a step, half-way through a checkpoint write, the final evaluation,
  the final gather, a restart's load);
- from here for the others, while the rank that sets the moment holds still for a moment
  (PSRT_FAULT stop): `psrt.cluster fail` of its host, a blackhole qdisc on its host's link
  (every packet it sends dropped; then restored), a full tmpfs under the checkpoint (then emptied).

A trial is bounded (--trial-timeout): a run that does not end by then is stopped and counted
as failed, never waited for.  Each row: recovered (exit 0 and final parameters within --tol of
one process trained on the whole global batch without a failure; for a full disk, the run ends
with one line naming the checkpoint, the previous checkpoint is kept, and `--resume` once the
disk is emptied ends there), steps done again, time from the fault to the next finished step,
the largest difference, and whether the last checkpoint loads.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import signal
import tempfile
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from psrt.bench.nemesis import IN_JOB_RANKS, KINDS, MODES, ON_HOSTS, STRATEGIES, Trial, schedule
from psrt.bench.report import table
from psrt.errors import PsrtError

HELP = "faults at random moments (seeded): kill, stop, lost host, cut link, full disk; every run must end right"
ROOT = Path(__file__).resolve().parents[2]
COLUMNS = [("index", "#", "d"), ("kind", "fault", "s"), ("moment", "moment", "s"), ("mode", "mode", "s"),
           ("strategy", "strategy", "s"), ("layout", "layout", "s"), ("recovered", "recovered", "s"),
           ("steps_redone", "steps redone", "s"), ("recovery_s", "fault to next step s", "s"),
           ("max_diff", "max |diff|", "s"), ("checkpoint", "checkpoint", "s")]
PAUSE_S = 3.0             # how long the rank that sets an outside fault's moment holds still
_FAULT_LINE = re.compile(r"PSRT_FAULT: rank (\d+) (killed|stopped for [\d.]+ s) at (\w+) (\d+) at ([\d.]+)")


def _env(timeout_s: float, logs: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_", "PMIX_", "PSRT_"))}
    path = [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS="1", PSRT_TIMEOUT=f"{timeout_s:g}",
               PSRT_LOG_DIR=str(logs))
    return env


def train_args(strategy: str, steps: int, batch: int, width: int) -> list[str]:
    dp = ["--dp", "ring", "--pp", "2", "--model", "transformer", "--seq-len", "8", "--layers", "2"] \
        if strategy == "pp2" else ["--dp", strategy]
    return ["-m", "psrt.train"] + dp + ["--steps", str(steps), "--batch-size", str(batch),
                                        "--width", str(width), "--seed", "5", "--quiet"]


def reference(strategy: str, args, folder: Path, env: dict) -> Path:
    """Final parameters of a run that never failed, same global batch: one process for the
    data-parallel strategies (they compute the same training at any number of workers), the
    same 2-rank grid for --pp 2.  Made once per campaign and kind of model."""
    kind = "pp2" if strategy == "pp2" else "dp"
    out = folder / f"reference-{kind}.pt"
    if not out.exists():
        argv = [sys.executable] + train_args("ring" if kind == "dp" else "pp2", args.steps, args.batch_size,
                                             args.width) + ["--save", str(out)]
        if kind == "pp2":
            argv = [sys.executable, str(ROOT / "mpi_launch"), "-np", "2"] + argv
        done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=ROOT,
                              stdin=subprocess.DEVNULL, timeout=args.trial_timeout)
        if done.returncode != 0:
            raise PsrtError(f"the uninterrupted {kind} run failed: {done.stderr.strip().splitlines()[-1:]}")
    return out


def max_diff(a: Path, b: Path) -> float:
    import torch
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return max((x[k].double() - y[k].double()).abs().max().item() for k in x)


def checkpoint_step(path: Path) -> int | None:
    """The step of the checkpoint at `path` if it loads whole, else None."""
    import torch
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        return int(payload["step"]) if payload.get("format") == "psrt-checkpoint-1" else None
    except Exception:  # noqa: BLE001 - any failure to read is what this asks
        return None


class _Disk:
    """A small tmpfs for the checkpoints, filled and emptied on request; always unmounted."""

    def __init__(self, where: Path, size: str = "16m"):
        self.where = where
        where.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "psrt-chaos", str(where)], check=True)

    def fill(self) -> None:
        with open(self.where / "filler", "wb") as f:
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()

    def empty(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.where / "filler").unlink()

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.where)], check=False)


def _hosts(trial: Trial, folder: Path, slots: tuple[int, ...]):
    """Emulated hosts of `slots` ranks each, named and addressed for this trial alone, written
    to folder/hosts; returns each rank's host (by rank) and the subnet."""
    tag = zlib.crc32(f"{os.getpid()}:{trial.index}:{folder}".encode())
    names = [f"c{tag % 10**6:06d}n{i}" for i in range(len(slots))]
    (folder / "hosts").write_text("".join(f"{h} slots={n}\n" for h, n in zip(names, slots)))
    return [h for h, n in zip(names, slots) for _ in range(n)], f"198.19.{100 + tag % 100}.0/24"


def _cut(host: str, on: bool) -> None:
    """Drop every packet leaving `host` (on) or carry them again (off).  The blackhole qdisc,
    built into every kernel, rather than netem's loss 100%: sch_netem is a module some kernels
    lack (this machine's among them)."""
    from psrt.launch.cluster import IFACE
    argv = ["tc", "-n", host, "qdisc"] + (["replace", "dev", IFACE, "root", "blackhole"] if on
                                          else ["del", "dev", IFACE, "root"])
    done = subprocess.run(argv, check=False, capture_output=True, text=True)
    if on and done.returncode != 0:
        raise PsrtError(f"cutting {host}'s link: tc said {' '.join(done.stderr.split())}")


class Runs:
    """The runs of a campaign still going, so that the campaign, told to stop (SIGTERM,
    Ctrl-C), ends them at once (each trial's own `finally` then unmounts its disk, and
    mpi_launch --emulate takes its hosts down) instead of leaving them behind."""

    def __init__(self):
        self._lock = threading.Lock()
        self._procs: set = set()
        self.stopped = False

    def start(self, argv, **kw):
        with self._lock:
            if self.stopped:
                raise PsrtError("the campaign was stopped")
            proc = subprocess.Popen(argv, **kw)
            self._procs.add(proc)
            return proc

    def stop(self) -> None:
        with self._lock:
            self.stopped = True
            procs = list(self._procs)
        for proc in procs:
            _end(proc)


def run_trial(trial: Trial, args, work: Path, runs: Runs) -> dict:
    """Run one trial to its end (or its deadline); its row."""
    folder = work / f"trial{trial.index}"
    folder.mkdir()
    row = dict(trial.row(), layout="2 ranks", recovered="no", steps_redone="-", recovery_s="-",
               max_diff="-", checkpoint="-", why="")
    env = _env(args.timeout, folder / "logs")
    disk = _Disk(folder / "disk") if trial.kind == "enospc" else None
    try:
        ckpt = (disk.where if disk else folder) / "ckpt.pt"
        final, metrics = folder / "final.pt", folder / "metrics.jsonl"
        env["PSRT_FAULT"] = _faults(trial)
        argv, hosts = _command(trial, args, folder, row)
        argv += ["--checkpoint", str(ckpt), "--checkpoint-every", str(args.every), "--save", str(final),
                 "--metrics", str(metrics)]
        log_path = folder / "run.log"
        started = time.monotonic()
        with open(log_path, "w") as log:
            proc = runs.start(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                              stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                struck = _strike_from_outside(trial, proc, log_path, hosts, disk, started, args)
                code = proc.wait(timeout=max(1.0, args.trial_timeout - (time.monotonic() - started)))
            except subprocess.TimeoutExpired:
                code = None
            finally:
                _end(proc)
                for h in set(hosts):
                    _cut(h, False)
        text = log_path.read_text(errors="replace")
        if code is None:
            row["why"] = f"did not end within {args.trial_timeout:g} s"
            return row
        times = [float(m.group(5)) for m in _FAULT_LINE.finditer(text)] + ([struck] if struck else [])
        if not times:
            row["why"] = f"the fault never struck (exit {code})"
            return row
        if trial.kind == "enospc":
            return _judge_full_disk(trial, row, code, text, ckpt, argv, env, final, args, folder, runs)
        return _judge(trial, row, code, text, max(times), ckpt, final, metrics, args, work)
    finally:
        if disk:
            disk.close()


def _command(trial: Trial, args, folder: Path, row: dict) -> tuple[list[str], list]:
    """The trial's launch (restarts under mpirun, on emulated hosts, or in-job under Open MPI 5)
    and the emulated hosts it runs on, if any; notes its layout in the row."""
    launch = [sys.executable, str(ROOT / "mpi_launch"), "--restarts", "2", "-np", "2"]
    hosts = []
    if trial.mode == "in-job":
        # Open MPI 5 from PyPI (ULFM), built once by scripts/with_mpi.sh; 3 ranks, so that
        # the survivors are a group of two
        launch = ["bash", str(ROOT / "scripts" / "with_mpi.sh"), "openmpi5", "--", "python",
                  str(ROOT / "mpi_launch"), "--in-job-recovery", "-np", str(IN_JOB_RANKS)]
        row["layout"] = f"{IN_JOB_RANKS} ranks"
        if trial.kind in ON_HOSTS:
            hosts, subnet = _hosts(trial, folder, (2, 1))
            launch += ["--emulate", "--hostfile", str(folder / "hosts"), "--subnet", subnet]
            row["layout"] = "2 hosts: 2+1"
    elif trial.kind in ON_HOSTS:
        hosts, subnet = _hosts(trial, folder, (1, 1))
        launch += ["--emulate", "--hostfile", str(folder / "hosts"), "--subnet", subnet]
        row["layout"] = "2 hosts x 1"
    elif trial.strategy == "pp2":
        row["layout"] = "pp2 x dp1"
    # under with_mpi.sh `python` is its environment's, whose mpi4py is built for Open MPI 5
    # (this interpreter's is Open MPI 4's: its error classes are not ULFM's)
    python = "python" if trial.mode == "in-job" else sys.executable
    return launch + [python] + train_args(trial.strategy, args.steps, args.batch_size, args.width), hosts


def _judge(trial: Trial, row: dict, code: int, text: str, struck_at: float, ckpt: Path, final: Path,
           metrics: Path, args, work: Path) -> dict:
    """A run that ended after its fault: its checkpoint, what it redid, and its parameters
    against the uninterrupted run's."""
    step = checkpoint_step(ckpt)
    row["checkpoint"] = "loads" if step == args.steps else f"step {step}" if step is not None else "UNREADABLE"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] \
        if metrics.exists() else []
    backs = [r for r in rows if "restart" in r or "in_job_recovery" in r]
    row["steps_redone"] = str(sum(r.get("steps_lost", 0) for r in backs))
    if backs:
        row["recovery_s"] = f"{backs[-1]['unix_time'] - struck_at:.1f}"
    if trial.mode == "in-job" and not backs:
        row["why"] = f"exit {code} without an in-job recovery"
        return row
    if code != 0 or not final.exists():
        said = [line for line in text.splitlines() if "error:" in line]
        row["why"] = f"exit {code}" + (f": {said[-1].strip()}" if said else "")
        return row
    diff = max_diff(final, reference(trial.strategy, args, work, _env(args.timeout, work / "logs")))
    row["max_diff"] = f"{diff:.1e}"
    row["recovered"] = "yes" if diff <= args.tol and step == args.steps else "no"
    return row


def _faults(trial: Trial) -> str:
    """PSRT_FAULT for the trial: the fault itself where a rank applies it, else a pause that
    marks the moment for the fault applied from outside."""
    r, s = trial.rank, trial.step
    if trial.kind == "sigkill" and trial.moment == "recovery":
        return f"kill:{r}:step:{s};kill:{1 - r}:recovery:0@1"
    if trial.kind == "sigkill":
        return f"kill:{r}:{trial.moment}:{s}"
    if trial.kind == "sigstop":
        return f"stop:{r}:{trial.moment}:{s}:{trial.seconds:g}"
    if trial.kind == "enospc":       # rank 0 writes the checkpoints: it holds still before that step
        return f"stop:0:step:{s}:{PAUSE_S:g}"
    return f"stop:{r}:step:{s}:{PAUSE_S:g}"


def _strike_from_outside(trial: Trial, proc, log_path: Path, hosts, disk, started, args) -> float | None:
    """For the faults applied from here: wait for the pause that marks the moment, strike,
    and (cut link, full disk) undo it `trial.seconds` later.  Returns when it struck."""
    if trial.kind not in ("host-loss", "link-cut", "enospc"):
        return None
    deadline = started + args.trial_timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if "PSRT_FAULT: rank" in log_path.read_text(errors="replace"):
            break
        time.sleep(0.05)
    else:
        return None
    at = time.time()
    if trial.kind == "host-loss":
        from psrt.launch.cluster import fail
        fail(hosts[trial.rank])
        return at
    if trial.kind == "link-cut":
        _cut(hosts[trial.rank], True)
        time.sleep(trial.seconds)
        _cut(hosts[trial.rank], False)
        return at
    disk.fill()
    # The disk stays full until the run has ended on it (the launcher does not restart a run
    # whose checkpoint cannot be written: the same write would fail again).
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    disk.empty()
    return at


def _judge_full_disk(trial, row, code, text, ckpt, argv, env, final, args, folder, runs) -> dict:
    """A full disk: one line naming the checkpoint, the previous one kept; then, the disk
    emptied, `--resume` must end where a run without a failure does."""
    said = [line for line in text.splitlines() if "error:" in line]
    step = checkpoint_step(ckpt)
    row["checkpoint"] = f"kept, step {step}" if step is not None else "UNREADABLE"
    if code != 4 or len(said) != 1 or str(ckpt) not in said[0] or step is None:   # StorageError
        row["why"] = f"exit {code}; error lines: {said}"
        return row
    again = [a for i, a in enumerate(argv) if a != "--restarts" and argv[i - 1] != "--restarts"] + ["--resume"]
    resumed = runs.start(again, env={k: v for k, v in env.items() if k != "PSRT_FAULT"},
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        code = resumed.wait(timeout=args.trial_timeout)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        _end(resumed)
    if code != 0:
        row["why"] = f"--resume after the disk was emptied: exit {code}"
        return row
    row["steps_redone"] = "0"
    diff = max_diff(final, reference(trial.strategy, args, folder.parent, _env(args.timeout, folder.parent / "logs")))
    row["max_diff"] = f"{diff:.1e}"
    row["recovered"] = "yes (--resume)" if diff <= args.tol else "no"
    return row


def _end(proc) -> None:
    """Stop what is left of a run: SIGTERM to mpi_launch (which passes it on and kills the job
    3 s later), then SIGKILL of its whole session."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait()


def campaign(args) -> list[dict]:
    trials = schedule(args.trials, args.seed, args.steps, args.every, args.timeout,
                      strategies=args.strategies.split(","), modes=args.modes.split(","),
                      kinds=args.kinds.split(","))
    for t in trials:
        print(t.describe(), file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="psrt-chaos-") as tmp:
        work = Path(tmp)
        for strategy in {t.strategy for t in trials}:       # before the trials, not in parallel ones
            reference(strategy, args, work, _env(args.timeout, work / "logs"))
        with ThreadPoolExecutor(max_workers=args.parallel) as pool:
            runs = Runs()
            futures = [pool.submit(run_trial, t, args, work, runs) for t in trials]
            try:
                rows = [f.result() for f in futures]
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)
                runs.stop()
                raise
    return rows


def summary(rows: list[dict]) -> str:
    ok = sum(r["recovered"].startswith("yes") for r in rows)
    bad = sum(r["checkpoint"] == "UNREADABLE" for r in rows)
    hung = sum(r["why"].startswith("did not end") for r in rows)
    return f"chaos: {ok} of {len(rows)} trials recovered; {bad} unreadable checkpoints; {hung} runs that did not end"


def command(args) -> int:
    if os.geteuid() != 0:
        raise PsrtError("psrt.bench chaos: its faults (emulated hosts, a tmpfs) need root")
    for name, allowed in (("strategies", STRATEGIES), ("modes", MODES), ("kinds", KINDS)):
        unknown = set(getattr(args, name).split(",")) - set(allowed)
        if unknown:
            raise PsrtError(f"psrt.bench chaos --{name}: unknown {', '.join(sorted(unknown))} "
                            f"(choose among {', '.join(allowed)})")
    # SIGTERM (a deadline's `timeout`, a batch system) as Ctrl-C: the runs still going are ended
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        rows = campaign(args)
    except ValueError as err:
        raise PsrtError(f"psrt.bench chaos: {err}") from None
    table(rows, COLUMNS)
    for r in rows:
        if r["why"]:
            print(f"trial {r['index']}: {r['why']}")
    print(summary(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["recovered"].startswith("yes") for r in rows) else 1


def add_arguments(p) -> None:
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="comma list of " + ", ".join(STRATEGIES))
    p.add_argument("--kinds", default=",".join(KINDS), help="fault kinds, comma list of " + ", ".join(KINDS))
    p.add_argument("--modes", default="restarts,in-job",
                   help="restarts (mpi_launch --restarts), in-job (mpi_launch --in-job-recovery: Open MPI 5 "
                        "from PyPI, ULFM, built once by scripts/with_mpi.sh)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=3, help="--checkpoint-every of the runs")
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--timeout", type=float, default=8.0,
                   help="PSRT_TIMEOUT of the runs (above the ranks' start-up skew on a busy machine: a rank "
                        "not heard from within it is taken for dead)")
    p.add_argument("--trial-timeout", type=float, default=240.0, help="a trial not over by then has failed")
    p.add_argument("--parallel", type=int, default=2, help="trials at once")
    p.add_argument("--tol", type=float, default=1e-5)
    p.add_argument("--json")
