"""ZeRO stages against their references and their formulas.

- zero3 against PyTorch's own FSDP2 (fully_shard, on gloo) on the same transformer, seeds and
  data, and both against one process (tests/mpi/ranks/zero3_vs_fsdp.py).  SGD: fp32 sums in
  different orders, a few ulps (atol 1e-6); Adam divides by sqrt(v), which turns those ulps
  into up to ~1e-4 on parameters whose gradient is near zero, so atol 1e-3 there.
- the memory ledger of psrt.train: what each rank holds, measured, within 10% of ZeRO's
  formula at N = 2 and 4 for a 1.7M-parameter transformer; zero3's model states at most 0.3x
  DDP's at N = 4; bytes sent per step 2(N-1)/N Phi d for zero1 and zero2, 3(N-1)/N Phi d for
  zero3; the activations of one micro-batch within 10% of the adapted Korthikanti formula.
"""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def fsdp_records():
    from conftest import launch_ranks
    out = {}
    for n in (2, 3, 4):
        out["sgd", n] = launch_ranks(n, "zero3_vs_fsdp.py", "--optimizer", "sgd").check().records()
    out["adam", 2] = launch_ranks(2, "zero3_vs_fsdp.py", "--optimizer", "adam").check().records()
    return out


@pytest.mark.parametrize("optimizer,n,atol", [("sgd", 2, 1e-6), ("sgd", 3, 1e-6), ("sgd", 4, 1e-6),
                                              ("adam", 2, 1e-3)])
def test_zero3_equals_pytorch_fsdp2_and_one_process(fsdp_records, optimizer, n, atol):
    recs = fsdp_records[optimizer, n]
    assert sorted(r["rank"] for r in recs) == list(range(n))
    for r in recs:
        assert all(v <= atol for v in r["max_abs"].values()), r["max_abs"]
        ref = r["losses"]["one process"]
        for name in ("zero3", "fsdp2"):
            assert all(abs(a - b) <= 1e-5 * abs(b) + 1e-6 for a, b in zip(r["losses"][name], ref)), r["losses"]


@pytest.fixture(scope="module")
def ledgers(tmp_path_factory):
    from conftest import launch_ranks
    out = {}
    for n in (2, 4):
        metrics = tmp_path_factory.mktemp("ledger") / "m.jsonl"
        run = launch_ranks(n, "-m", "psrt.train", "--dp", "ring,zero1,zero2,zero3", "--model", "transformer",
                           "--width", "256", "--layers", "2", "--optimizer", "adam", "--steps", "2",
                           "--bucket-mb", "1", "--quiet", "--metrics", str(metrics), timeout=400).check()
        rows = {}
        for dp in ("ring", "zero1", "zero2", "zero3"):
            path = metrics.with_name(f"m.{dp}.jsonl")
            rows[dp] = [json.loads(line) for line in path.read_text().splitlines()][-1]
            assert rows[dp]["summary"]
        out[n] = (rows, run.stdout)
    return out


@pytest.mark.parametrize("n", (2, 4))
def test_measured_memory_is_the_formula(ledgers, n):
    rows, stdout = ledgers[n]
    phi = rows["ring"]["params"]
    assert phi > 1_000_000
    expect = {"ring": 16 * phi, "zero1": 8 * phi + 8 * phi / n, "zero2": 4 * phi + 12 * phi / n,
              "zero3": 16 * phi / n}
    for dp, want in expect.items():
        assert rows[dp]["formula_states"] == pytest.approx(want)
        assert rows[dp]["mem_states"] == pytest.approx(want, rel=0.10), dp
        assert rows[dp]["mem_activations"] == pytest.approx(rows[dp]["formula_activations"], rel=0.10), dp
    assert rows["zero2"]["mem_grads"] == pytest.approx(4 * phi / n, rel=0.01)
    assert "memory per rank" in stdout and "activations/micro-batch" in stdout


def test_zero3_holds_under_a_third_of_ddp_at_four_ranks(ledgers):
    rows, _ = ledgers[4]
    assert rows["zero3"]["mem_states"] <= 0.3 * rows["ring"]["mem_states"]


@pytest.mark.parametrize("n", (2, 4))
def test_bytes_sent_per_step(ledgers, n):
    rows, _ = ledgers[n]
    grad = rows["ring"]["grad_bytes"]
    for dp, passes in (("ring", 2), ("zero1", 2), ("zero2", 2), ("zero3", 3)):
        per_step = rows[dp]["bytes_per_rank"] / rows[dp]["steps"]
        assert per_step == pytest.approx(passes * (n - 1) / n * grad, rel=0.01), dp


def test_a_sharded_checkpoint_resumes_on_another_number_of_ranks(tmp_path):
    """zero1/2/3 and ps-sharded with Adam: 2 steps on 4 ranks, checkpoint, then steps 3-4 on 3
    ranks (reshard on load) end where 4 straight steps on 4 ranks do.  The parts of the parameters and of
    Adam's moments are reassembled and cut again; a lost or misplaced part moves a parameter
    by about the learning rate (3e-3), far above the tolerance of sums in another order."""
    import torch
    from conftest import launch_ranks
    train = ["-m", "psrt.train", "--dp", "zero1,zero2,zero3,ps-sharded", "--optimizer", "adam",
             "--batch-size", "24", "--bucket-mb", "0.01", "--quiet"]
    ckpt = str(tmp_path / "c.pt")
    launch_ranks(4, *train, "--steps", "4", "--save", str(tmp_path / "straight.pt")).check()
    launch_ranks(4, *train, "--steps", "2", "--checkpoint", ckpt).check()
    run = launch_ranks(3, *train, "--steps", "4", "--checkpoint", ckpt, "--resume",
                       "--save", str(tmp_path / "resumed.pt")).check()
    assert "Traceback" not in run.stderr
    for dp in ("zero1", "zero2", "zero3", "ps-sharded"):
        a = torch.load(tmp_path / f"straight.{dp}.pt", weights_only=True)
        b = torch.load(tmp_path / f"resumed.{dp}.pt", weights_only=True)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6), (dp, k, (a[k] - b[k]).abs().max())
        assert torch.load(tmp_path / f"c.{dp}.pt", weights_only=True)["step"] == 4


def test_recompute_changes_no_bit_and_keeps_one_input_per_block(tmp_path):
    """--recompute on ring and zero3: the same parameters bit for bit (the blocks have no
    randomness), and the saved activations drop from 16 sbh to 1 sbh per block, each within
    10% of the formula."""
    import torch
    from conftest import launch_ranks
    train = ["-m", "psrt.train", "--dp", "ring,zero3", "--model", "transformer", "--width", "128",
             "--optimizer", "adam", "--steps", "3", "--quiet"]
    rows = {}
    for flag in ("", "--recompute"):
        metrics, save = tmp_path / f"m{flag}.jsonl", tmp_path / f"p{flag}.pt"
        launch_ranks(2, *train, *([flag] if flag else []), "--metrics", str(metrics), "--save", str(save)).check()
        for dp in ("ring", "zero3"):
            path = metrics.with_name(f"m{flag}.{dp}.jsonl")
            rows[flag, dp] = [json.loads(line) for line in path.read_text().splitlines()][-1]
    for dp in ("ring", "zero3"):
        a = torch.load(tmp_path / f"p.{dp}.pt", weights_only=True)
        b = torch.load(tmp_path / f"p--recompute.{dp}.pt", weights_only=True)
        assert all(torch.equal(a[k], b[k]) for k in a), dp
        full, less = rows["", dp], rows["--recompute", dp]
        for row in (full, less):
            assert row["mem_activations"] == pytest.approx(row["formula_activations"], rel=0.10)
        assert less["mem_activations"] < 0.25 * full["mem_activations"]


def test_bench_memory_reproduces_zeros_table(tmp_path):
    """bench memory: every row's model states equal the formula within 10%, in ZeRO's order
    (one device > zero1 > zero2 > zero3 = FSDP2), with a step time beside FSDP2's."""
    from conftest import launch_ranks
    out = tmp_path / "memory.json"
    launch_ranks(2, "-m", "psrt.bench", "memory", "--width", "64", "--layers", "2", "--steps", "2",
                 "--quiet", "--json", str(out), timeout=240).check()
    rows = {r["strategy"].split()[0]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["ring", "zero1", "zero2", "zero3", "fsdp2"]
    for r in rows.values():
        assert r["states"] == pytest.approx(r["formula"], rel=0.10), r
        assert r["step_s"] > 0 and r["vs_fsdp2"] > 0
    states = [rows[k]["states"] for k in ("ring", "zero1", "zero2", "zero3")]
    assert states == sorted(states, reverse=True)
    assert rows["zero3"]["states"] == pytest.approx(rows["fsdp2"]["states"], rel=0.02)


@pytest.mark.parametrize("grid", (["--pp", "2"], ["--tp", "2", "--sequence-parallel"]))
def test_recompute_under_model_parallelism_changes_no_loss(tmp_path, grid):
    """A pipeline stage's blocks, and tensor-parallel blocks whose collectives run again in the
    recomputation (in the same order on every TP rank): the same losses bit for bit."""
    from conftest import launch_ranks
    losses = {}
    for flag in ("", "--recompute"):
        metrics = tmp_path / f"pp{flag}.jsonl"
        launch_ranks(2, "-m", "psrt.train", *grid, "--model", "transformer", "--steps", "3", "--accum", "2",
                     "--quiet", "--metrics", str(metrics), *([flag] if flag else [])).check()
        losses[flag] = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()
                        if not json.loads(line).get("summary")]
    assert len(losses[""]) == 3 and losses[""] == losses["--recompute"]


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_sharded_stages_on_cuda_with_the_optimizer_offloaded():
    """On a GPU: zero1/2/3 with the model on CUDA and the optimizer on the host (pinned
    copies down and up each step) equal one process on the GPU, N = 2 sharing the device."""
    from conftest import launch_ranks
    recs = launch_ranks(2, "dp_equivalence.py", "--dp", "zero1,zero2,zero3", "--device", "cuda", "--accum", "2",
                        "--optimizer", "adam", "--lr", "0.01", "--offload-optimizer", "--rtol", "1e-4",
                        "--atol", "1e-5", timeout=300).check().records()
    assert len(recs) == 6
    for r in recs:
        assert r["ok"] and r["loss_ok"], r
