"""Horovod interop: `--dp horovod` trains like one process on the global batch (under mpirun
and horovodrun), refuses clearly when horovod is missing or runs on other ranks, and is a
correct peer in the collectives bench.  Multi-rank tests are skipped when horovod is not
installed (scripts/install_horovod.sh)."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import horovodrun

ROOT = Path(__file__).resolve().parents[2]
MPI_SCRIPTS = ROOT / "tests" / "mpi" / "ranks"
SKIP_REASON = "horovod is not installed: run scripts/install_horovod.sh"


@pytest.fixture(scope="module")
def horovod():
    """Skip unless horovod imports and was built with MPI (checked in a child process: the
    pytest process must not load an MPI library itself, see conftest.py)."""
    if importlib.util.find_spec("horovod") is None:
        pytest.skip(SKIP_REASON)
    probe = subprocess.run([sys.executable, "-c", "import horovod.torch as h, sys; sys.exit(not h.mpi_built())"],
                           capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        pytest.skip(f"horovod does not import or was built without MPI ({probe.stderr.strip()[-200:]}): "
                    "run scripts/install_horovod.sh")


def _records(text: str) -> list[dict]:
    decoder, out, tag = json.JSONDecoder(), [], "PSRT-RESULT "
    pos = text.find(tag)
    while pos >= 0:
        obj, end = decoder.raw_decode(text, pos + len(tag))
        out.append(obj)
        pos = text.find(tag, end)
    return out


def _check_equivalent(records: list[dict], np_: int) -> None:
    workers = [r for r in records if r["dp"] == "horovod"]
    assert sorted(r["rank"] for r in workers) == list(range(np_))
    for r in workers:
        assert r["size"] == np_
        assert r["ok"], f"rank {r['rank']}: parameters differ from one process ({r['bad_params']}, max {r['max_abs']:.2e})"
        assert r["loss_ok"], f"rank {r['rank']}: losses {r['losses']} != {r['ref_losses']}"


# ------------------------------------------------------------------ without horovod or MPI


# ------------------------------------------------------------------ under mpirun

@pytest.mark.mpi
@pytest.mark.parametrize("np_", [1, 2, 4])
def test_equivalence_sgd_accumulation(horovod, run_ranks, np_):
    """Momentum SGD, 2 micro-batches per step (backward_passes_per_step), a parameter that
    never gets a gradient, ranks other than 0 starting from perturbed parameters."""
    run = run_ranks(np_, "dp_equivalence.py", "--dp", "horovod", "--accum", "2", "--unused",
                    timeout=240).check()
    _check_equivalent(run.records(), np_)


@pytest.mark.mpi
def test_equivalence_adam_beside_ring(horovod, run_ranks):
    """Adam catches a step count off by one (a state-creating dummy step at start-up); ring
    in the same processes shows Horovod's background thread and psrt's MPI calls coexist."""
    run = run_ranks(2, "dp_equivalence.py", "--dp", "horovod,ring", "--optimizer", "adam", "--lr", "0.01",
                    timeout=240).check()
    records = run.records()
    _check_equivalent(records, 2)
    assert all(r["ok"] for r in records if r["dp"] == "ring")


@pytest.mark.mpi
def test_fp16_compression_is_applied_and_close(horovod, run_ranks):
    """fp16 on the wire: within 1e-4 of one process, but not within fp32 rounding (1e-7),
    which would mean gradients travelled in fp32 and the option was ignored."""
    run = run_ranks(2, "dp_equivalence.py", "--dp", "horovod", "--compress", "fp16", "--rtol", "1e-3",
                    "--atol", "1e-4", timeout=240).check()
    records = run.records()
    _check_equivalent(records, 2)
    assert all(r["max_abs"] > 1e-6 for r in records), [r["max_abs"] for r in records]


@pytest.mark.mpi
def test_resume_continues_exactly(horovod, run_ranks, tmp_path):
    """psrt.train with Adam: 2 steps, checkpoint, resume to 4 == 4 steps straight.  Loading
    must restore the optimizer (Adam's moments and step count) and the broadcast of that
    state from rank 0 must leave it unchanged."""
    train = ("-m", "psrt.train", "--dp", "horovod", "--optimizer", "adam", "--quiet")
    ckpt, full, resumed = tmp_path / "c.pt", tmp_path / "full.pt", tmp_path / "resumed.pt"
    run_ranks(2, *train, "--steps", "4", "--save", str(full), timeout=180).check()
    run_ranks(2, *train, "--steps", "2", "--checkpoint", str(ckpt), timeout=180).check()
    run_ranks(2, *train, "--steps", "4", "--checkpoint", str(ckpt), "--resume", "--save", str(resumed),
              timeout=180).check()
    a, b = torch.load(full, weights_only=True), torch.load(resumed, weights_only=True)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.mpi
def test_refuses_a_communicator_horovod_does_not_run_on(horovod, run_ranks):
    records = run_ranks(2, "horovod_mismatch.py", timeout=180).check().records()
    assert sorted(r["rank"] for r in records) == [0, 1]
    for r in records:
        assert r["raised"] and "horovod runs on 2 ranks" in r["message"] and "has 1" in r["message"], r


@pytest.mark.mpi
def test_bench_horovod_peer(horovod, run_ranks, tmp_path):
    out = tmp_path / "bench.json"
    run_ranks(2, "-m", "psrt.bench", "collectives", "--algorithms", "native,ring,horovod", "--sizes", "4,1000,64K",
              "--warmup", "1", "--repeats", "2", "--quiet", "--json", str(out), timeout=240).check()
    rows = json.loads(out.read_text())["rows"]
    hvd_rows = [r for r in rows if r["algorithm"] == "horovod"]
    assert sorted(r["nbytes"] for r in hvd_rows) == [4, 1000, 65536]
    assert all(r["wrong"] == 0 and r["time_us"] > 0 for r in rows)
    assert {r["algorithm"] for r in rows} == {"native", "ring", "horovod"}


@pytest.mark.mpi
def test_bench_where_horovods_time_goes(horovod, run_ranks, tmp_path):
    """bench horovod reads Horovod's own timeline: every timed call appears in it, and its
    phases fit inside the call (MPI_Allreduce is the largest part of a 1 MiB call)."""
    out = tmp_path / "hvd.json"
    run = run_ranks(2, "-m", "psrt.bench", "horovod", "--sizes", "256K,1MiB", "--repeats", "2", "--grads", "mlp",
                    "--json", str(out), timeout=240).check()
    assert "of Horovod's call is the MPI library's MPI_Allreduce" in run.stdout
    got = json.loads(out.read_text())
    rows = got["rows"]
    assert [r["nbytes"] for r in rows] == [256 << 10, 1 << 20]
    for r in rows:
        assert r["calls_timed"] >= 4 and 0 < r["mpi_allreduce_us"] and r["negotiate_us"] >= 0
        assert r["ring_vs_horovod"] == pytest.approx(r["horovod_us"] / r["ring_us"])
    # a step's gradient list: Horovod fuses the MLP's 6 tensors, its timeline merged over them
    step = got["gradient_step"]
    assert step["tensors"] == 6 and step["wrong"] == 0
    assert step["fused_calls"] >= 1 and step["mpi_allreduce_us"] > 0 and step["memcpy_us"] > 0
    assert step["ring_vs_horovod"] == pytest.approx(step["horovod_us"] / step["ring_us"])
    assert "MPI_Allreduce calls per step" in run.stdout


@pytest.mark.mpi
def test_example_horovod_vs_ring(horovod, run_ranks):
    """Same loop, same seed: the two strategies end at the same loss (fp32 rounding apart)."""
    out = run_ranks(2, "../../../examples/horovod_vs_ring.py", "--steps", "5", "--quiet", timeout=240).check().stdout
    assert re.search(r"^horovod\s+2\s+5\s", out, re.M) and re.search(r"^ring\s+2\s+5\s", out, re.M), out
    diff = float(re.search(r"\|diff\| (\S+)\)", out).group(1))
    assert diff < 1e-5, out


# ------------------------------------------------------------------ under horovodrun

@pytest.mark.mpi
def test_horovodrun_mpi_mode(horovod):
    proc = horovodrun("-np", "2", sys.executable, str(MPI_SCRIPTS / "dp_equivalence.py"),
                       "--dp", "horovod", "--accum", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _check_equivalent(_records(proc.stdout), 2)


@pytest.mark.mpi
def test_horovodrun_gloo_mode_says_to_launch_with_mpi(horovod):
    """horovodrun --gloo starts processes without MPI (each an MPI world of one): psrt cannot
    join them, and says so in one line instead of training N unrelated copies."""
    proc = horovodrun("--gloo", "-np", "2", sys.executable, "-m", "psrt.train", "--dp", "horovod",
                       "--steps", "1", "--quiet")
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    assert "psrt.train: error: horovodrun --gloo started 2 processes without MPI" in text, text[-3000:]
    # horovodrun ends with a traceback of its own; the ranks must not (their lines carry
    # horovodrun's "[rank]<stderr>:" prefix).
    assert "<stderr>:Traceback" not in text, text[-3000:]
