"""Training state survives SIGKILL: resume reaches the same parameters, bit for bit.

1. `python -m psrt.train` on 2 ranks is SIGKILLed (every process of the job) right after its
   2nd checkpoint; `--resume` then finishes the run, and the final parameters (--save) equal
   those of an uninterrupted run with torch.equal (CPU, same seed).
2. A process killed in the middle of writing a checkpoint leaves the previous one whole and
   loadable (the write goes to a temporary file that is renamed over the old one only once
   complete and fsync'ed).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch
from conftest import MPI_SCRIPTS, ROOT, mpirun_argv

pytestmark = pytest.mark.mpi

STEPS, EVERY = 12, 3
TRAIN = ["-m", "psrt.train", "--width", "16", "--batch-size", "16",
         "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--quiet", "--seed", "3"]
# --dp on the whole model, and zero1 on a pipeline (Megatron-LM's distributed optimizer shape)
LAYOUTS = {"ring": ["--data", "synthetic", "--dp", "ring"], "ps": ["--data", "synthetic", "--dp", "ps"],
           "pp2-zero1": ["--model", "transformer", "--layers", "2", "--pp", "2", "--dp", "zero1"]}


def _env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_COMM_", "OMPI_MCA_orte_", "OMPI_MCA_ess", "PMIX_", "PMI_", "PSRT_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return env


def _train(args, timeout=180):
    proc = subprocess.run(mpirun_argv(2) + [sys.executable, *args], capture_output=True, text=True,
                          env=_env(), cwd=ROOT, timeout=timeout, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def _kill_job(proc, tag):
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    for line in ps.splitlines():
        if tag in line:                    # a rank outside mpirun's process group
            try:
                os.kill(int(line.split()[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sigkill_then_resume_is_bitwise_identical(tmp_path, layout):
    common = LAYOUTS[layout]
    _train([*TRAIN, *common, "--checkpoint", str(tmp_path / "ref.ckpt"), "--save", str(tmp_path / "ref.pt")])

    ckpt, marker, tag = tmp_path / "run.ckpt", tmp_path / "frozen", f"psrt-ckpt-{uuid.uuid4().hex[:10]}"
    crashing = [str(MPI_SCRIPTS / "fault_ckpt.py"), "2", str(marker), tag, "--",
                *TRAIN[2:], *common, "--checkpoint", str(ckpt), "--save", str(tmp_path / "out.pt")]
    proc = subprocess.Popen(mpirun_argv(2) + [sys.executable, *crashing], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), f"no 2nd checkpoint (exit {proc.poll()})"
    finally:
        _kill_job(proc, tag)
    assert marker.read_text() == str(2 * EVERY)
    assert not (tmp_path / "out.pt").exists()      # the run really did not finish
    assert torch.load(ckpt, weights_only=True)["step"] == 2 * EVERY

    resumed = _train([*TRAIN, *common, "--checkpoint", str(ckpt), "--resume", "--save", str(tmp_path / "out.pt")])
    assert "Traceback" not in resumed.stderr
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert ref.keys() == out.keys()
    for key in ref:
        assert torch.equal(ref[key], out[key]), key
    assert torch.load(ckpt, weights_only=True)["step"] == STEPS


KILL_MID_WRITE = r"""
import os, signal, sys, torch
from psrt.train import checkpoint
path = sys.argv[1]
checkpoint.atomic_save({"step": 1, "w": torch.arange(100000.0)}, path)
real_save = torch.save
def dying_save(obj, f):
    import io
    buf = io.BytesIO()
    real_save(obj, buf)
    data = buf.getvalue()
    f.write(data[: len(data) // 2])
    f.flush()
    os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)
torch.save = dying_save
checkpoint.atomic_save({"step": 2, "w": torch.zeros(100000)}, path)
"""


def test_kill_during_checkpoint_write_keeps_the_previous_one(tmp_path):
    path = tmp_path / "ckpt.pt"
    proc = subprocess.run([sys.executable, "-c", KILL_MID_WRITE, str(path)], env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    partial = [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    assert len(partial) == 1 and partial[0].startswith(".ckpt.pt."), os.listdir(tmp_path)
    assert os.path.getsize(tmp_path / partial[0]) > 0            # half a file was written ...
    state = torch.load(path, weights_only=True)                   # ... but not over the old one
    assert state["step"] == 1 and torch.equal(state["w"], torch.arange(100000.0))
    with pytest.raises(Exception):
        torch.load(tmp_path / partial[0], weights_only=True)      # the torn file is unusable


def test_interrupted_write_in_process_cleans_up(tmp_path, monkeypatch):
    """An exception during the write (disk full, Ctrl-C) leaves the old file and no temp file."""
    from psrt.train import checkpoint
    path = tmp_path / "ckpt.pt"
    checkpoint.atomic_save({"step": 1}, str(path))

    def failing_save(obj, f):
        f.write(b"\x80\x02partial")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError):
        checkpoint.atomic_save({"step": 2}, str(path))
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["ckpt.pt"]
    assert torch.load(path, weights_only=True) == {"step": 1}


def test_stale_temp_files_of_killed_writes_are_removed(tmp_path):
    from psrt.train.checkpoint import atomic_save
    target = tmp_path / "ckpt.pt"
    stale = tmp_path / ".ckpt.pt.abc123.tmp"          # what a SIGKILL mid-write leaves
    stale.write_bytes(b"half a checkpoint")
    other = tmp_path / ".other.pt.abc123.tmp"          # another file's temp: not ours to remove
    other.write_bytes(b"x")
    atomic_save({"w": 1}, str(target))
    assert target.exists() and not stale.exists() and other.exists()
