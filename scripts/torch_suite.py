"""PyTorch's own distributed test suite against the psrt backend, under mpirun.

    python3 scripts/torch_suite.py                    # the whole suite at 2, 3 and 4 ranks
    python3 scripts/torch_suite.py --np 3 -k all_gather,send_recv

Runs `DistributedTest._DistTestBase` of the installed torch with gloo's test selection (see
scripts/torch_suite_rank.py) in one mpirun job per world size.  A test that kills the job, or
after which the job makes no progress for --test-timeout seconds (it is then killed), is
reported as crashed or hung, and a new job goes on with the tests after it; so does one after a
test that failed (the ranks end their job then: the failure may have broken the group).  Tests
that break their group by design (a barrier that must time out) run in jobs of their own.  Prints one line
per test, `np=N STATUS test [reason]`, and a summary line per world size; a skip carries the
suite's reason or psrt's (docs/how-to/torch_backend.md).  Exit status 1 when a test failed, crashed
or hung.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RANK_SCRIPT = ROOT / "scripts" / "torch_suite_rank.py"
BAD = ("failed", "hung", "crashed")
# Set by mpirun for its ranks: a driver started from inside an MPI job must not pass them on.
_MPI_VARS = ("OMPI_COMM_", "OMPI_MCA_orte_", "OMPI_MCA_ess", "PMIX_", "PMI_")


def _env(np_: int, temp_dir: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_MPI_VARS)}
    env.update(WORLD_SIZE=str(np_), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
               PYTORCH_PRINT_REPRO_ON_FAILURE="0", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("MASTER_ADDR", None), env.pop("MASTER_PORT", None)   # each job's own, from MPI
    if temp_dir:
        env["TEMP_DIR"] = temp_dir
    return env


def list_tests(np_: int, backend: str, rank_script: Path) -> list[dict]:
    """The suite's tests at this world size: [{"test", "skip": reason or None}]."""
    proc = subprocess.run([sys.executable, str(rank_script), "--list", "--backend", backend],
                          capture_output=True, text=True,
                          env=_env(np_), timeout=300)
    if proc.returncode != 0:
        raise SystemExit(f"torch_suite: listing the suite failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout)


def _read_events(temp_dir: str, np_: int) -> dict[int, list[dict]]:
    events = {}
    for r in range(np_):
        path = os.path.join(temp_dir, f"results.{r}")
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            lines = []
        # a line still being written has no newline yet: json fails on it, it is read next time
        events[r] = []
        for line in lines:
            try:
                events[r].append(json.loads(line))
            except json.JSONDecodeError:
                break
    return events


def _merge(name: str, ends: dict[int, dict]) -> tuple[str, str]:
    """One test's outcome over all ranks: failed if any rank failed, skipped if every rank
    skipped, else passed."""
    for r in sorted(ends):
        if ends[r]["status"] in ("failed", "error"):
            return "failed", f"rank {r}: {ends[r]['reason']}"
    if all(e["status"] == "skipped" for e in ends.values()):
        return "skipped", ends[min(ends)]["reason"]
    return "passed", ""


def _stop(proc: subprocess.Popen) -> None:
    """End the job: mpirun passes SIGTERM to its ranks; what is left is killed."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_job(np_: int, names: list[str], backend: str, test_timeout: float, log,
            rank_script: Path) -> tuple[dict, list[str]]:
    """Run `names` in one mpirun job until it ends or wedges: ({test: (status, reason, seconds)}
    for the tests it got through, including the one it died or wedged in), the tests it did
    not reach."""
    from psrt.launch.mpi import local_mpirun_prefix
    with tempfile.TemporaryDirectory(prefix="psrt-torch-suite-") as temp_dir:
        for sub in ("barrier", "test_dir"):
            os.mkdir(os.path.join(temp_dir, sub))
        cmd = local_mpirun_prefix(np_) + [sys.executable, str(rank_script), "--backend", backend, *names]
        proc = subprocess.Popen(cmd, env=_env(np_, temp_dir), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=ROOT)
        done: dict[str, tuple] = {}
        last_progress, seen = time.monotonic(), 0
        verdict = None
        while True:
            exited = proc.poll() is not None
            events = _read_events(temp_dir, np_)
            count = sum(len(e) for e in events.values())
            if count != seen:
                seen, last_progress = count, time.monotonic()
            ends = {r: {e["test"]: e for e in evs if e["event"] == "end"} for r, evs in events.items()}
            for name in names:
                if name in done:
                    continue
                if all(name in ends[r] for r in range(np_)):
                    status, reason = _merge(name, {r: ends[r][name] for r in range(np_)})
                    done[name] = (status, reason, max(ends[r][name]["seconds"] for r in range(np_)))
                    continue
                break
            current = next((n for n in names if n not in done), None)
            if current is None:
                proc.wait()
                return done, []
            if exited or time.monotonic() - last_progress > test_timeout:
                ended = {r: ends[r][current] for r in range(np_) if current in ends[r]}
                failed = {r: e for r, e in ended.items() if e["status"] in ("failed", "error")}
                if exited:
                    verdict = ("crashed", f"the job exited (status {proc.returncode}) during the test")
                else:
                    _stop(proc)
                    waiting = [r for r in range(np_) if r not in ended]
                    verdict = ("hung", f"no progress for {test_timeout:g} s; ranks {waiting} still in it")
                if failed:
                    r = min(failed)
                    verdict = ("failed", f"rank {r}: {failed[r]['reason']} (then: {verdict[1]})")
                started = any(e["test"] == current for evs in events.values() for e in evs)
                if not started and exited:
                    if done:
                        # the ranks end a job after a failed test: the next job takes it from here
                        return done, [n for n in names if n not in done]
                    verdict = ("crashed", f"the job exited (status {proc.returncode}) before the test")
                done[current] = (*verdict, round(time.monotonic() - last_progress, 1))
                return done, [n for n in names if n not in done]
            time.sleep(0.2)


def run_suite(np_: int, backend: str, pattern: list[str], test_timeout: float, log_path: Path,
              rank_script: Path = RANK_SCRIPT) -> dict:
    """Every test at world size np_: {test: (status, reason, seconds)}, in the suite's order."""
    listing = list_tests(np_, backend, rank_script)
    results: dict[str, tuple] = {}
    todo, isolate = [], {t["test"] for t in listing if t.get("isolate")}
    for t in listing:
        if pattern and not any(p in t["test"] for p in pattern):
            continue
        if t["skip"] is not None:
            results[t["test"]] = ("skipped", t["skip"], None)   # None: not run
        else:
            todo.append(t["test"])
    order = [t["test"] for t in listing if t["test"] in results or t["test"] in todo]
    with open(log_path, "a") as log:
        while todo:
            # a test that breaks its group by design runs alone; the others up to it in one job
            cut = 1 if todo[0] in isolate else next((i for i, n in enumerate(todo) if n in isolate), len(todo))
            log.write(f"=== np={np_}: job over {cut} tests from {todo[0]}\n")
            log.flush()
            done, rest = run_job(np_, todo[:cut], backend, test_timeout, log, rank_script)
            todo = rest + todo[cut:]
            results.update(done)
            for name, (status, reason, seconds) in done.items():
                print(f"np={np_} {status:8} {name}" + (f"  [{reason}]" if reason else ""), flush=True)
    return {n: results[n] for n in order}


def static_skips(results: dict) -> list[str]:
    """The tests skipped without running (by the suite's decorators or psrt's list)."""
    return [n for n, (status, _, seconds) in results.items() if status == "skipped" and seconds is None]


def summary(np_: int, results: dict) -> str:
    counts = {s: 0 for s in ("passed", "failed", "hung", "crashed", "skipped")}
    for status, _, _ in results.values():
        counts[status] += 1
    return f"np={np_}: " + ", ".join(f"{v} {k}" for k, v in counts.items()) + f" ({len(results)} tests)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="PyTorch's distributed test suite on the psrt backend")
    ap.add_argument("--np", default="2,3,4", help="world sizes, comma-separated (default 2,3,4)")
    ap.add_argument("--backend", default="psrt", choices=("psrt", "gloo"),
                    help="the backend under test (gloo: the reference, on the same selection)")
    ap.add_argument("-k", default="", help="only tests whose name contains one of these comma-separated words")
    ap.add_argument("--test-timeout", type=float, default=180.0,
                    help="seconds without progress after which a job counts as hung and is killed")
    ap.add_argument("--log", default="out/torch_suite.log", help="the ranks' output (default %(default)s)")
    ap.add_argument("--json", default=None, help="also write every result to this file")
    ap.add_argument("--rank-script", default=str(RANK_SCRIPT),
                    help="what each rank runs (default: %(default)s; the driver's own tests pass a "
                         "stand-in that speaks the same protocol)")
    args = ap.parse_args(argv)
    try:
        sizes = [int(n) for n in args.np.split(",")]
    except ValueError:
        ap.error(f"--np {args.np!r}: expected world sizes like 2,3,4")
    if any(n < 2 for n in sizes):
        ap.error(f"--np {args.np!r}: the suite needs at least 2 ranks")
    log_path = Path(args.log)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text("")
    pattern = [p for p in args.k.split(",") if p]
    lines, every, bad = [], {}, 0
    t0 = time.monotonic()
    for n in sizes:
        results = run_suite(n, args.backend, pattern, args.test_timeout, log_path, Path(args.rank_script))
        every[n] = results
        bad += sum(1 for s, _, _ in results.values() if s in BAD)
        for name in static_skips(results):
            print(f"np={n} skipped  {name}  [{results[name][1]}]", flush=True)
        lines.append(summary(n, results))
    print(f"torch {__import__('torch').__version__}, DistributedTest._DistTestBase on backend {args.backend} "
          f"(gloo's selection), {time.monotonic() - t0:.0f} s:")
    for line in lines:
        print("  " + line)
    if args.json:
        Path(args.json).write_text(json.dumps({str(n): {t: list(v) for t, v in r.items()} for n, r in every.items()},
                                              indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
