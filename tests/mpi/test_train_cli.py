"""`python -m psrt.train` end to end: --help, bad input, JSONL metrics, --save / --resume."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, RankRun, mpirun_argv


def env():
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("OMPI_COMM_", "OMPI_MCA_orte_", "OMPI_MCA_ess", "PMIX_", "PMI_"))}
    return dict(clean, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def single(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "psrt.train", *args], capture_output=True,
                          text=True, timeout=300, env=env(), stdin=subprocess.DEVNULL)


def ranks(np_: int, *args: str) -> RankRun:
    cmd = mpirun_argv(np_) + [sys.executable, "-m", "psrt.train", *args]
    return RankRun(subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env(),
                                  stdin=subprocess.DEVNULL))


def test_help():
    out = single("--help")
    assert out.returncode == 0
    assert "--dp NAME[,NAME]" in out.stdout and "GLOBAL batch size" in out.stdout


def test_quiet_prints_what_its_help_says():
    """--quiet keeps the table's notes (about 20 lines with the ledger): the help says so."""
    out = single("--steps", "1", "--quiet")
    assert out.returncode == 0, out.stderr
    assert "memory per rank" in out.stdout and "compute s, comm s:" not in out.stdout
    help_ = " ".join(single("--help").stdout.split())
    quiet = help_[help_.rindex("--quiet"):][:300]
    assert "the memory ledger" in quiet and "no column legend" in quiet, quiet


@pytest.mark.parametrize("argv,words", [(["--dp", "rin"], "--dp 'rin'"),
                                        (["--batch-size", "abc"], "--batch-size: invalid int value")])
def test_bad_flag_is_one_line_and_exit_2(argv, words):
    out = single(*argv)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("psrt.train: error:") and words in lines[0], out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.mpi
def test_uneven_batch_on_three_ranks_is_one_line():
    run = ranks(3, "--batch-size", "64", "--steps", "1")
    assert run.returncode == 2, run.stderr
    errors = [l for l in run.stderr.splitlines() if "psrt.train: error:" in l]
    assert len(errors) == 1 and "--batch-size 64 does not split evenly over the 3 workers of --dp ring" \
        in errors[0], run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.mpi
def test_default_batch_adapts_to_the_workers_and_says_so():
    """ps with a dedicated server on 4 ranks has 3 workers: the default batch becomes 66."""
    run = ranks(4, "--dp", "ps", "--servers", "1", "--steps", "2", "--data", "synthetic", "--width", "8")
    run.check()
    assert "psrt.train: global batch 66: the default 64 rounded up to split over 3 workers" in run.stderr
    assert "global batch 66, 4 ranks" in run.stdout


def test_command_line_errors_come_before_torch_is_imported():
    """A bad layout or batch is refused before the rank imports torch (it costs seconds per
    rank on a crowded host): python's import log shows no torch."""
    for argv, words in ((["--dp", "ps-async"], "--dp ps-async needs at least 2 ranks"),
                        (["--dp", "ps", "--servers", "2"], "use --dp ps-sharded"),
                        (["--pp", "2", "--model", "transformer"], "--pp 2 --tp 1: process grid pp=2 x tp=1 does not divide 1 ranks")):
        out = subprocess.run([sys.executable, "-X", "importtime", "-m", "psrt.train", *argv], capture_output=True,
                             text=True, timeout=120, env=env(), stdin=subprocess.DEVNULL)
        errors = [line for line in out.stderr.splitlines() if "psrt.train: error:" in line]
        assert out.returncode == 2 and len(errors) == 1 and words in errors[0], out.stderr[-2000:]
        imported = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")]
        assert "mpi4py" in imported and "torch" not in imported, [m for m in imported if "torch" in m][:3]


@pytest.mark.mpi
def test_metrics_save_and_resume_round_trip(tmp_path):
    """6 steps straight == 3 steps, checkpoint, resume for 3 more (bit for bit: same ranks,
    same reduction order); the metrics file has one valid JSON line per step + a summary."""
    common = ["--dp", "ring,zero", "--optimizer", "adam", "--batch-size", "32", "--quiet"]
    full = tmp_path / "full.pt"
    ranks(2, *common, "--steps", "6", "--save", str(full), "--metrics", str(tmp_path / "m.jsonl")).check()
    ckpt = tmp_path / "ck.pt"
    ranks(2, *common, "--steps", "3", "--checkpoint", str(ckpt), "--checkpoint-every", "2").check()
    resumed = tmp_path / "resumed.pt"
    ranks(2, *common, "--steps", "6", "--checkpoint", str(ckpt), "--resume", "--save", str(resumed)).check()
    for dp in ("ring", "zero"):
        lines = (tmp_path / f"m.{dp}.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        assert [r["step"] for r in records[:-1]] == [1, 2, 3, 4, 5, 6]
        assert all(r["dp"] == dp and r["loss"] > 0 for r in records[:-1])
        summary = records[-1]
        assert summary["summary"] and summary["steps"] == 6 and 0 <= summary["test_acc"] <= 1
        assert summary["bytes_per_rank"] > 0
        a = torch.load(tmp_path / f"full.{dp}.pt", weights_only=True)
        b = torch.load(tmp_path / f"resumed.{dp}.pt", weights_only=True)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), dp
        assert not (tmp_path / f".ck.{dp}.pt.tmp").exists()


@pytest.mark.mpi
def test_resume_on_another_world_size(tmp_path):
    """ring continues on 2 ranks from a 1-rank checkpoint (every replica holds the whole
    state); ps-async, whose state does not reshard, is refused in one line naming both sizes."""
    ckpt = tmp_path / "ck.pt"
    single("--steps", "2", "--checkpoint", str(ckpt), "--quiet").check_returncode()
    run = ranks(2, "--steps", "4", "--checkpoint", str(ckpt), "--resume", "--quiet")
    assert run.returncode == 0, run.stderr
    assert torch.load(ckpt, weights_only=True)["step"] == 4
    ckpt = tmp_path / "async.pt"
    ranks(2, "--dp", "ps-async", "--steps", "2", "--checkpoint", str(ckpt), "--quiet").check()
    run = ranks(3, "--dp", "ps-async", "--steps", "4", "--checkpoint", str(ckpt), "--resume")
    assert run.returncode == 2
    errors = [l for l in run.stderr.splitlines() if "psrt.train: error:" in l]
    assert len(errors) == 1 and "written by 2 ranks, this job has 3" in errors[0], run.stderr


# ------------------------------------------------------------------ the user's own model and data
USER = "tests.mpi.ranks.user_model"
OWN = ["--model", f"{USER}:build_model", "--data", f"{USER}:build_dataset"]


# The same global batch each step, so the same losses and parameters (ps-async too: its
# default staleness bound is 0, each update waits for every worker's gradients).
STRATEGIES = ("ps", "ring", "zero3", "ps-sharded", "ps-async")


@pytest.mark.mpi
def test_own_model_and_data_train_with_every_kind_of_strategy(tmp_path):
    """A model and data set from a test module, named by import path, on 3 ranks: ps and
    ps-sharded with a dedicated server (2 workers), ring and zero3 (3; zero3 cuts the model
    into units by its wrap policy), ps-async (2 workers and its server).  Each prints its
    summary row, writes metrics, a checkpoint and the model, and all train alike."""
    run = ranks(3, *OWN, "--dp", ",".join(STRATEGIES), "--servers", "1", "--steps", "4", "--quiet",
                "--metrics", str(tmp_path / "m.jsonl"), "--checkpoint", str(tmp_path / "ck.pt"),
                "--save", str(tmp_path / "final.pt")).check()
    assert f"{USER}:build_model on {USER}:build_dataset: global batch 66, 3 ranks" in run.stdout
    table, _, model = run.stdout.partition("alpha-beta model (ping-pong rank 0")
    table = table.partition("memory per rank")[0]
    names = STRATEGIES
    rows = {line.split()[0]: line.split() for line in table.splitlines() if line.split()[:1] and line.split()[0] in names}
    workers = {"ps": "2", "ring": "3", "zero3": "3", "ps-sharded": "2", "ps-async": "2"}
    assert {dp: row[1:3] for dp, row in rows.items()} == {dp: [w, "4"] for dp, w in workers.items()}, run.stdout
    # More than one strategy compared: the alpha-beta prediction, regime and crossover follow the table.
    assert "crossover: ring communicates faster than ps above" in model, run.stdout
    predicted = {line.split()[0]: line for line in model.splitlines() if line.split()[:1] and line.split()[0] in names}
    assert {"ps", "ring"} <= set(predicted) and all("-bound" in line for line in predicted.values()), model
    summary = {dp: json.loads((tmp_path / f"m.{dp}.jsonl").read_text().splitlines()[-1]) for dp in names}
    assert all(s["summary"] and s["pred_comm_s"] > 0 and s["regime"].endswith("-bound") for s in summary.values())
    assert summary["ring"]["crossover_vs"] == "ps"
    final = {dp: torch.load(tmp_path / f"final.{dp}.pt", weights_only=True) for dp in names}
    keys = {"embed.weight", "embed.bias", "mix.weight", "mix.bias", "head.weight", "head.bias", "scale"}
    assert all(set(f) == keys for f in final.values()), {dp: sorted(f) for dp, f in final.items()}
    for dp in STRATEGIES[1:]:
        assert summary[dp]["train_loss"] == pytest.approx(summary["ps"]["train_loss"], rel=1e-5), dp
        assert summary[dp]["test_loss"] == pytest.approx(summary["ps"]["test_loss"], rel=1e-5), dp
        for k in keys:
            assert torch.allclose(final[dp][k], final["ps"][k], rtol=1e-5, atol=1e-6), (dp, k)
    assert 0 <= summary["ring"]["test_acc"] <= 1
    assert summary["ring"]["grad_bytes"] == sum(t.numel() * 4 for k, t in final["ring"].items() if k != "scale")  # a buffer
    ckpt = torch.load(tmp_path / "ck.ps.pt", weights_only=True)
    assert ckpt["step"] == 4 and ckpt["config"]["model"] == f"{USER}:build_model"


@pytest.mark.parametrize("argv,words", [
    (["--model", "user_model"], "--model 'user_model': choose one of mlp, cnn, transformer, moe, or name your own as module:callable"),
    (["--model", "no_such_package_psrt.models:build"], "--model no_such_package_psrt.models:build: cannot import "
     "no_such_package_psrt.models (ModuleNotFoundError"),
    (["--data", f"{USER}:no_such_data"], f"--data {USER}:no_such_data: module {USER} has no attribute 'no_such_data'"),
    (["--model", f"{USER}:not_a_model"], f"--model {USER}:not_a_model returned a list; expected a torch.nn.Module"),
    (["--model", f"{USER}:not_callable"], "not_callable is not callable (type int)"),
    (["--data", f"{USER}:not_a_dataset"], f"--data {USER}:not_a_dataset returned a str; expected a psrt.train.data.Dataset"),
])
def test_bad_own_model_or_data_is_one_line_and_exit_2(argv, words):
    out = single(*argv, "--steps", "1", "--quiet")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "psrt.train: error:" in lines[0], out.stderr
    assert words in lines[0], out.stderr


@pytest.mark.mpi
def test_bad_own_model_on_two_ranks_is_said_once():
    run = ranks(2, "--model", f"{USER}:not_a_model", "--steps", "1")
    errors = [line for line in run.stderr.splitlines() if "psrt.train: error:" in line]
    assert run.returncode == 2 and len(errors) == 1 and "expected a torch.nn.Module" in errors[0], run.stderr
    assert "Traceback" not in run.stderr
