"""`psrt.train --pp/--tp`: the CLI's model-parallel path trains the same model as one process."""
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.mpi

ARGS = ["-m", "psrt.train", "--model", "transformer", "--steps", "3", "--accum", "2",
        "--batch-size", "8", "--quiet", "--layers", "2"]


def test_pp2_tp2_equals_one_process(run_ranks, tmp_path):
    hybrid = tmp_path / "hybrid.pt"
    run_ranks(4, *ARGS, "--pp", "2", "--tp", "2", "--save", str(hybrid), timeout=300).check()
    single = tmp_path / "single.pt"
    subprocess.run([sys.executable, *ARGS, "--save", str(single)], check=True, timeout=300,
                   capture_output=True, stdin=subprocess.DEVNULL)
    a = torch.load(hybrid, weights_only=True)
    b = torch.load(single, weights_only=True)
    assert a.keys() == b.keys()
    moved = 0
    for k in a:
        # fp32, a different summation order across stages and shards: the customary bar
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=4e-5, msg=k)
        moved += int(not torch.equal(a[k], torch.zeros_like(a[k])))
    assert moved > 0


def test_hybrid_needs_the_transformer():
    out = subprocess.run([sys.executable, "-m", "psrt.train", "--pp", "2", "--model", "mlp"],
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 2
    assert "use --model transformer" in out.stderr and "Traceback" not in out.stderr
