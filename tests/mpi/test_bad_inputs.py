"""Bad input to any command line gives one line on stderr naming the bad thing, exit 2, no traceback.

Each row is (id, command, text the line must contain, ranks).  `ranks` 0 runs the command as
one plain process; 2 runs it under mpirun with 2 ranks, where the line must still appear once
(not once per rank).  All rows run up front in a small thread pool, each in its own session so
that a command that hangs can be killed with everything it started.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import ROOT, mpirun_argv

TRAIN = ["-m", "psrt.train", "--steps", "1", "--quiet", "--data", "synthetic", "--width", "8"]
BENCH = ["-m", "psrt.bench", "collectives", "--collective", "allreduce", "--sizes", "4", "--repeats", "1",
         "--warmup", "0", "--quiet"]
LAUNCH = [str(ROOT / "mpi_launch"), "--dry-run"]
NO_GPU = "--device cuda: no CUDA device is visible"
WITH_GPU = "a GPU is visible here" if torch.cuda.is_available() else None
PER_CASE_TIMEOUT = 45


def py(*args):
    return [sys.executable, *args]


def env_train(var, value):
    return {"env": {var: value}, "argv": py(*TRAIN)}


# (id, argv or {"argv", "env"}, needle, ranks, xfail reason or None).  Paths under {tmp} are
# filled in with the test's own directory.
CASES = [
    # --- psrt.train: choices
    ("train-dp-unknown", py(*TRAIN, "--dp", "bogus"), "--dp 'bogus'", 0, None),
    ("train-dp-twice", py(*TRAIN, "--dp", "ring,ring"), "listed twice", 0, None),
    ("train-model-unknown", py(*TRAIN, "--model", "bogus"), "--model", 0, None),
    ("train-data-unknown", py(*TRAIN, "--data", "bogus"), "--data", 0, None),
    ("train-model-data-mismatch", py(*TRAIN, "--model", "transformer", "--data", "digits"), "--data digits", 0, None),
    ("train-optimizer-unknown", py(*TRAIN, "--optimizer", "lbfgs"), "--optimizer", 0, None),
    ("train-algorithm-unknown", py(*TRAIN, "--algorithm", "bogus"), "--algorithm", 0, None),
    ("train-compress-unknown", py(*TRAIN, "--compress", "int8"), "--compress", 0, None),
    ("train-unknown-flag", py(*TRAIN, "--frobnicate"), "--frobnicate", 0, None),
    ("train-lr-not-a-number", py(*TRAIN, "--lr", "abc"), "--lr", 0, None),
    # --- psrt.train: sizes, steps, rates
    ("train-batch-zero", py(*TRAIN, "--batch-size", "0"), "--batch-size 0", 0, None),
    ("train-steps-negative", py(*TRAIN, "--steps", "-1"), "--steps -1", 0, None),
    ("train-epochs-zero", py(*TRAIN, "--steps", "0", "--epochs", "0"), "--epochs 0", 0, None),
    ("train-lr-zero", py(*TRAIN, "--lr", "0"), "--lr 0", 0, None),
    ("train-lr-nan", py(*TRAIN, "--lr", "nan"), "--lr nan", 0, None),
    ("train-lr-inf", py(*TRAIN, "--lr", "inf"), "--lr inf", 0, None),
    ("train-accum-zero", py(*TRAIN, "--accum", "0"), "--accum 0", 0, None),
    ("train-width-negative", py(*TRAIN, "--width", "-1"), "--width -1", 0, None),
    ("train-bucket-zero", py(*TRAIN, "--bucket-mb", "0"), "--bucket-mb 0", 0, None),
    ("train-servers-negative", py(*TRAIN, "--servers", "-1"), "--servers -1", 0, None),
    ("train-staleness-negative", py(*TRAIN, "--staleness", "-1"), "--staleness -1", 0, None),
    ("train-weight-decay-negative", py(*TRAIN, "--weight-decay", "-1"), "--weight-decay -1", 0, None),
    ("train-checkpoint-every-negative", py(*TRAIN, "--checkpoint-every", "-1"), "--checkpoint-every -1", 0, None),
    ("train-batch-not-divisible-accum", py(*TRAIN, "--batch-size", "7", "--accum", "2"), "--batch-size 7", 0, None),
    ("train-batch-not-divisible-np2", py(*TRAIN, "--batch-size", "3"), "--batch-size 3", 2, None),
    ("train-ps-servers-too-many", py(*TRAIN, "--dp", "ps", "--servers", "1"), "--servers 1", 0, None),
    ("train-timeout-negative", py(*TRAIN, "--timeout", "-1"), "--timeout", 0, None),
    ("train-pp-needs-the-transformer", py(*TRAIN, "--pp", "2"), "--pp 2", 0, None),
    ("train-tp-grid-np2", py(*TRAIN, "--tp", "3"), "--tp 3", 2, None),
    # NCCL: no NCCL in a CPU build of torch; two ranks on one GPU are named (tests/unit/test_device.py)
    ("train-algorithm-nccl-np2", py(*TRAIN, "--dp", "ring", "--algorithm", "nccl"), "algorithm 'nccl'", 2,
     None),
    # --- psrt.train: files
    # a missing directory is made (mkdir -p); one that cannot be made (nothing is made in /proc) is refused
    ("train-save-no-dir", py(*TRAIN, "--save", "/proc/psrt-no/such/x.pt"),
     "--save /proc/psrt-no/such/x.pt: cannot make directory /proc/psrt-no/such", 0, None),
    ("train-metrics-is-dir", py(*TRAIN, "--metrics", "{tmp}"), "--metrics", 0, None),
    ("train-resume-no-checkpoint-flag", py(*TRAIN, "--resume"), "--resume needs --checkpoint", 0, None),
    ("train-checkpoint-every-no-file", py(*TRAIN, "--checkpoint-every", "2"), "--checkpoint-every", 0, None),
    ("train-resume-missing", py(*TRAIN, "--resume", "--checkpoint", "{tmp}/missing.pt"), "{tmp}/missing.pt", 0, None),
    ("train-resume-missing-np2", py(*TRAIN, "--resume", "--checkpoint", "{tmp}/missing.pt"), "{tmp}/missing.pt", 2, None),
    ("train-resume-corrupt", py(*TRAIN, "--resume", "--checkpoint", "{tmp}/corrupt.pt"), "{tmp}/corrupt.pt", 0, None),
    ("train-resume-not-psrt", py(*TRAIN, "--resume", "--checkpoint", "{tmp}/foreign.pt"), "not a psrt checkpoint", 0, None),
    ("train-resume-truncated-np2", py(*TRAIN, "--resume", "--checkpoint", "{tmp}/truncated.pt"), "{tmp}/truncated.pt", 2, None),
    ("train-resume-other-dp-np2", py(*TRAIN, "--dp", "ps", "--resume", "--checkpoint", "{tmp}/one_rank.pt"),
     "written with --dp ring, this run has --dp ps", 2, None),
    ("train-resume-other-model", py(*TRAIN, "--width", "16", "--resume", "--checkpoint", "{tmp}/one_rank.pt"), "--width", 0, None),
    # --- environment
    ("env-check-bogus", env_train("PSRT_CHECK", "bogus"), "PSRT_CHECK", 0, None),
    ("env-check-bogus-np2", env_train("PSRT_CHECK", "bogus"), "PSRT_CHECK", 2, None),
    ("env-tuning-missing", env_train("PSRT_TUNING", "/nonexistent.json"), "/nonexistent.json", 0, None),
    ("env-timeout-negative", env_train("PSRT_TIMEOUT", "-1"), "PSRT_TIMEOUT", 0, None),
    ("env-cuda-aware-yes", env_train("PSRT_CUDA_AWARE", "yes"), "PSRT_CUDA_AWARE", 0, None),
    ("env-ring-segment-bogus", env_train("PSRT_RING_SEGMENT", "abc"), "PSRT_RING_SEGMENT", 0, None),
    # --- psrt.bench
    ("bench-collective-unknown", py(*BENCH, "--collective", "bogus"), "--collective bogus", 0, None),
    ("bench-size-unparsable", py(*BENCH, "--sizes", "12Q"), "12Q", 0, None),
    ("bench-min-size-zero", py(*BENCH[:5], "--min-size", "0", "--repeats", "1"), "--min-size 0", 0, None),
    ("bench-min-above-max", py(*BENCH[:5], "--min-size", "1MiB", "--max-size", "1KiB"), "--min-size 1MiB", 0, None),
    ("bench-algorithm-unknown", py(*BENCH, "--algorithms", "bogus"), "bogus", 0, None),
    ("bench-repeats-zero", py(*BENCH, "--repeats", "0"), "--repeats", 0, None),
    ("bench-warmup-negative", py(*BENCH, "--warmup", "-1"), "--warmup", 0, None),
    ("bench-dtype-unknown", py(*BENCH, "--dtype", "int8"), "--dtype", 0, None),
    ("bench-c10d-np-unparsable", py("-m", "psrt.bench", "c10d", "--np", "x"), "--np x", 0, None),
    ("bench-c10d-grad-zero", py("-m", "psrt.bench", "c10d", "--np", "2", "--grad-mb", "0"), "--grad-mb 0", 0, None),
    # --- the torch.distributed backend in a user's script
    ("c10d-algorithm-unknown-np2", {"env": {"PSRT_ALGORITHM": "bogus"}, "argv": py(str(ROOT / "examples" / "torch_ddp.py"))},
     "PSRT_ALGORITHM='bogus'", 2, None),
    ("bench-command-unknown", py("-m", "psrt.bench", "bogus"), "bogus", 0, None),
    ("bench-tune-np-not-int", py("-m", "psrt.bench", "tune", "--np", "x"), "--np", 0, None),
    ("bench-training-dp-unknown", py("-m", "psrt.bench", "training", "--dp", "ring,bogus"), "--dp bogus", 0, None),
    ("bench-training-steps-zero", py("-m", "psrt.bench", "training", "--steps", "0"), "--steps 0", 0, None),
    ("bench-network-rate-bad", py("-m", "psrt.bench", "network", "--rates", "1gbit,fast"), "--rates fast", 0, None),
    ("bench-network-hosts-one", py("-m", "psrt.bench", "network", "--hosts", "1,8"), "--hosts 1,8", 0, None),
    ("bench-network-size-small", py("-m", "psrt.bench", "network", "--size", "4KiB"), "--size 4096 B", 0, None),
    ("bench-suite-part-unknown", py("-m", "psrt.bench", "suite", "--parts", "training,bogus"), "--parts bogus", 0, None),
    ("bench-suite-np-one", py("-m", "psrt.bench", "suite", "--np", "1"), "--np 1", 0, None),
    ("bench-pingpong-one-rank", py("-m", "psrt.bench", "pingpong", "--sizes", "8,64,1K"), "at least 2 ranks", 0, None),
    # --device cuda without a GPU: one line from every command that takes it
    ("bench-collectives-no-gpu", py(*BENCH, "--device", "cuda"), NO_GPU, 0, WITH_GPU),
    ("bench-pipeline-no-gpu-np2", py("-m", "psrt.bench", "pipeline", "--device", "cuda"), NO_GPU, 2, WITH_GPU),
    ("bench-moe-no-gpu-np2", py("-m", "psrt.bench", "moe", "--device", "cuda", "--steps", "0"), NO_GPU, 2, WITH_GPU),
    ("bench-backup-no-gpu-np2", py("-m", "psrt.bench", "backup", "--backups", "0", "--device", "cuda"), NO_GPU, 2,
     WITH_GPU),
    ("train-no-gpu", py(*TRAIN, "--device", "cuda"), NO_GPU, 0, WITH_GPU),
    # --- mpi_launch
    ("launch-np-zero", LAUNCH + ["-np", "0", "true"], "-np 0", 0, None),
    ("launch-np-negative", LAUNCH + ["-np", "-3", "true"], "-np -3", 0, None),
    ("launch-no-command", LAUNCH + ["-np", "1"], "no command", 0, None),
    ("launch-hostfile-missing", LAUNCH + ["--hostfile", "{tmp}/nofile", "-np", "1", "true"], "{tmp}/nofile", 0, None),
    ("launch-hostfile-bad-slots", LAUNCH + ["--hostfile", "{tmp}/hf_badslots", "-np", "1", "true"], "slots 'abc'", 0, None),
    ("launch-hostfile-bad-key", LAUNCH + ["--hostfile", "{tmp}/hf_badkey", "-np", "1", "true"], "unknown key 'foo'", 0, None),
    ("launch-too-many-ranks", LAUNCH + ["--hostfile", "{tmp}/hf_one", "-np", "4", "true"], "-np 4", 0, None),
    ("launch-hosts-bad-slots", LAUNCH + ["--hosts", "a:x", "-np", "1", "true"], "'a:x'", 0, None),
    ("launch-unknown-host", [str(ROOT / "mpi_launch"), "--hosts", "nosuchhost.invalid:2", "-np", "2", "true"],
     "nosuchhost.invalid", 0, None),
    ("launch-threads-zero", LAUNCH + ["--threads", "0", "-np", "1", "true"], "--threads 0", 0, None),
    ("launch-export-unset", LAUNCH + ["-x", "PSRT_NOT_SET_ANYWHERE", "-np", "1", "true"], "PSRT_NOT_SET_ANYWHERE", 0, None),
    ("launch-rate-bad", LAUNCH + ["--emulate", "--rate", "fast", "--hostfile", str(ROOT / "hostfiles/two_nodes"),
                                  "-np", "2", "true"], "--rate 'fast'", 0, None),
    ("launch-bind-unknown", LAUNCH + ["--bind", "bogus", "-np", "1", "true"], "--bind", 0, None),
    # --- other entry points
    ("info-unknown-flag", py("-m", "psrt.info", "--bogus"), "--bogus", 0, None),
]
assert len(CASES) >= 30


def _prepare(tmp: str) -> None:
    import torch
    with open(os.path.join(tmp, "hf_badslots"), "w") as f:
        f.write("node0 slots=abc\n")
    with open(os.path.join(tmp, "hf_badkey"), "w") as f:
        f.write("node0 slots=2 foo=bar\n")
    with open(os.path.join(tmp, "hf_one"), "w") as f:
        f.write("localhost slots=1\n")
    with open(os.path.join(tmp, "corrupt.pt"), "wb") as f:
        f.write(b"this is not a checkpoint\n")
    torch.save({"weights": torch.ones(3)}, os.path.join(tmp, "foreign.pt"))


def _one_rank_checkpoint(tmp: str) -> None:
    """A real checkpoint written by 1 rank (same tiny settings as TRAIN), and a truncated copy."""
    path = os.path.join(tmp, "one_rank.pt")
    subprocess.run(py(*TRAIN, "--checkpoint", path), check=True, capture_output=True, cwd=ROOT,
                   env=_env({}), timeout=120, stdin=subprocess.DEVNULL)
    data = open(path, "rb").read()
    with open(os.path.join(tmp, "truncated.pt"), "wb") as f:
        f.write(data[: len(data) // 2])


def _env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_COMM_", "OMPI_MCA_orte_", "OMPI_MCA_ess", "PMIX_", "PMI_", "PSRT_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra)
    return env


def _run(case, tmp: str):
    name, spec, needle, ranks, _ = case
    spec = spec if isinstance(spec, dict) else {"argv": spec, "env": {}}
    argv = [a.replace("{tmp}", tmp) for a in spec["argv"]]
    if ranks:
        argv = mpirun_argv(ranks) + argv
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=_env(spec["env"]), stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=PER_CASE_TIMEOUT)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        code = "timeout"
    return {"code": code, "stdout": out, "stderr": err, "seconds": time.monotonic() - t0}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("bad_inputs"))
    _prepare(tmp)
    _one_rank_checkpoint(tmp)
    with ThreadPoolExecutor(4) as pool:
        done = dict(zip([c[0] for c in CASES], pool.map(lambda c: _run(c, tmp), CASES)))
    return tmp, done


MPIRUN_BANNER = ("Primary job", "a non-zero exit code", "mpirun detected", "the job to be terminated",
                 "Process name:", "Exit code:", "ORTE_ERROR_LOG", "MPI_ABORT was invoked", "MPI_COMM_WORLD",
                 "with errorcode", "NOTE: invoking MPI_ABORT", "You may or may not see output",
                 "exactly when Open MPI kills them", "mpirun has exited due to", "the job did not call",
                 "exit code 0", "This may have caused")


def _from_mpirun(line: str) -> bool:
    return line.startswith("---") or any(s in line for s in MPIRUN_BANNER)


def _param(case):
    marks = [pytest.mark.xfail(strict=True, reason=case[4])] if case[4] else []
    return pytest.param(case, id=case[0], marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_bad_input_is_one_line_exit_2(results, case):
    tmp, done = results
    name, _, needle, ranks, _ = case
    r = done[name]
    needle = needle.replace("{tmp}", tmp)
    lines = [line for line in r["stderr"].splitlines() if line.strip()]
    if ranks:
        # mpirun adds its own banner when a rank exits non-zero; the program's lines are the
        # rest, and there must be one of them for the whole job, not one per rank.
        lines = [line for line in lines if not _from_mpirun(line)]
    shown = f"exit {r['code']} after {r['seconds']:.1f} s; stderr:\n{r['stderr'][-2000:]}"
    assert r["code"] == 2, shown
    assert "Traceback" not in r["stderr"], shown
    assert len(lines) == 1, shown
    assert "error:" in lines[0] and needle in lines[0], shown


def test_no_orphans_left(results):
    """Nothing a case started is still running (each ran in its own session)."""
    tmp, _ = results
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert tmp not in ps
