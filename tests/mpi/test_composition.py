"""Every data-parallel strategy on the data-parallel axis of every layout equals one process.

One launch per layout trains every strategy the layout supports in turn (--dp a,b,c) and
saves each whole model (--save FILE: FILE.<dp>.pt); each must load into the one-process
model and equal a one-process run on the same global batch.  The optimizer is SGD with
momentum (state that the sharded strategies split): Adam would hide a wrong gradient
scale, since its update does not depend on it, and would turn float noise in directions
whose true gradient is zero (a key bias, under softmax's shift invariance) into +-lr.
"""
import json
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import launch_ranks

pytestmark = pytest.mark.mpi

ARGS = ["-m", "psrt.train", "--steps", "3", "--accum", "2", "--batch-size", "8", "--quiet",
        "--layers", "2", "--momentum", "0.9"]
MOE = ["--model", "moe", "--experts", "4", "--capacity-factor", "4"]   # no token dropped
DENSE = ["--model", "transformer"]

# layout -> (ranks, its flags, the model's flags, the strategies it trains)
LAYOUTS = {
    "pp2": (4, ["--pp", "2"], DENSE, ["ring", "zero1", "zero2", "ps", "ps-sharded"]),
    "tp2": (4, ["--tp", "2"], DENSE, ["ring", "native", "zero1", "zero2", "zero3", "ps", "ps-sharded"]),
    "pp2xtp2": (8, ["--pp", "2", "--tp", "2"], DENSE, ["ring", "zero1", "zero2", "ps", "ps-sharded"]),
    "moe-ep2": (4, ["--ep", "2"], MOE, ["ring", "zero1", "zero2", "ps", "ps-sharded"]),
}
PAIRS = [(layout, dp) for layout, (_, _, _, dps) in LAYOUTS.items() for dp in dps]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """layout -> (the launch's directory); model -> the one-process run's state."""
    root = tmp_path_factory.mktemp("composition")
    runs = {}
    for layout, (np_, flags, model, dps) in LAYOUTS.items():
        out = root / layout
        out.mkdir()
        launch_ranks(np_, *ARGS, *model, *flags, "--dp", ",".join(dps), "--save", str(out / "model.pt"),
                     "--metrics", str(out / "metrics.jsonl"), timeout=600).check()
        runs[layout] = out
    single = {}
    for name, model in (("dense", DENSE), ("moe", MOE)):
        path = root / f"{name}.pt"
        subprocess.run([sys.executable, *ARGS, *model, "--save", str(path)], check=True, timeout=300,
                       capture_output=True, stdin=subprocess.DEVNULL)
        single[name] = torch.load(path, weights_only=True)
    return runs, single


@pytest.mark.parametrize("layout,dp", PAIRS)
def test_strategy_on_layout_equals_one_process(saved, layout, dp):
    runs, single = saved
    reference = single["moe" if LAYOUTS[layout][2] is MOE else "dense"]
    got = torch.load(runs[layout] / f"model.{dp}.pt", weights_only=True)
    # every expert, every stage, every TP shard, named as the one-process model names them
    assert got.keys() == reference.keys()
    for k in got:
        # fp32, another summation order across stages, shards and ranks: the customary bar
        torch.testing.assert_close(got[k], reference[k], rtol=1e-5, atol=4e-5, msg=f"{layout} {dp}: {k}")


def test_the_ledger_of_zero1_on_pp2_tp2_is_its_formula(saved):
    """ZeRO's terms over the dp group, for the largest rank's share of the model."""
    runs, _ = saved
    rows = [json.loads(line) for line in open(runs["pp2xtp2"] / "metrics.zero1.jsonl")]
    row = next(r for r in rows if r.get("summary"))
    assert abs(row["mem_states"] / row["formula_states"] - 1) < 0.10, row
    # bytes per axis: the dp reductions, the pipeline's activations, the TP collectives
    assert row["dp_bytes_per_rank"] > 0 and row["pp_bytes_per_rank"] > 0 and row["tp_bytes_per_rank"] > 0


def test_a_refused_pair_says_why_in_one_line_on_stderr():
    """(the whole table of refusals: tests/unit/test_layout_table.py)"""
    run = launch_ranks(2, *ARGS, *DENSE, "--pp", "2", "--dp", "zero3", timeout=120)
    assert run.returncode == 2, run.stderr
    # one line from psrt (every rank refuses alike; rank 0 speaks), whatever mpirun adds
    lines = [line for line in run.stderr.splitlines() if "psrt" in line]
    assert len(lines) == 1 and "zero3 would gather every unit again" in lines[0], run.stderr
    assert "Traceback" not in run.stderr


def _run(np_, tmp, name, *extra):
    path = tmp / f"{name}.pt"
    launch_ranks(np_, *ARGS, *DENSE, "--pp", "2", "--dp", "zero1", "--save", str(path), *extra,
                 timeout=300).check()
    return torch.load(path, weights_only=True)


def test_a_pipeline_zero1_run_resumes_bit_for_bit_and_on_another_dp_degree(tmp_path):
    """Stopped after the checkpoint of step 2 and resumed, a --pp 2 --dp zero1 run ends with
    the parameters of the run that was not stopped, bit for bit; resumed on 2 ranks (dp 1
    instead of 2, the optimizer's shards reassembled) within fp32 tolerance."""
    ckpt = tmp_path / "ckpt.pt"
    whole = _run(4, tmp_path, "whole", "--steps", "4")
    _run(4, tmp_path, "first", "--steps", "2", "--checkpoint", str(ckpt))
    at_two = tmp_path / "at_two.pt"
    shutil.copy(ckpt, at_two)
    resumed = _run(4, tmp_path, "resumed", "--steps", "4", "--checkpoint", str(ckpt), "--resume")
    for k in whole:
        assert torch.equal(whole[k], resumed[k]), k
    fewer = _run(2, tmp_path, "fewer", "--steps", "4", "--checkpoint", str(at_two), "--resume")
    for k in whole:
        torch.testing.assert_close(fewer[k], whole[k], rtol=1e-5, atol=4e-5, msg=k)
