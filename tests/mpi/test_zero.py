"""ZeRO stages against their references and their formulas.

- zero3 against PyTorch's own FSDP2 (fully_shard, on gloo) on the same transformer, seeds and
  data, and both against one process (tests/mpi/ranks/zero3_vs_fsdp.py), N = 2, 3, 4, SGD and
  Adam.  At N = 2 zero3 and FSDP2 are equal bit for bit.  Otherwise fp32 sums in different
  orders, a few ulps (SGD: atol 1e-6); Adam divides by sqrt(v), which turns those ulps into up
  to ~3e-4 on parameters whose gradient is near zero, so atol 1e-3 there.
- what the ledger claims, measured without asking the strategies (tests/mpi/ranks/ledger_probe.py):
  the tensors reachable from a strategy add up to what its memory() names; zero2 never holds
  more than two buckets of .grad during backward; no zero3 unit outlives its forward; bytes
  counted at the ring's sends are 2(N-1)/N Phi d (zero1/2) and 3(N-1)/N Phi d (zero3).
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
    """One launch per N, SGD and Adam in it: {(optimizer, n): one record per rank}."""
    from conftest import launch_ranks
    out = {}
    for n in (2, 3, 4):
        for r in launch_ranks(n, "zero3_vs_fsdp.py", "--optimizer", "sgd,adam").check().records():
            out.setdefault((r["optimizer"], n), []).append(r)
    return out


@pytest.mark.parametrize("optimizer,n,atol", [("sgd", 2, 1e-6), ("sgd", 3, 1e-6), ("sgd", 4, 1e-6),
                                              ("adam", 2, 1e-3), ("adam", 3, 1e-3), ("adam", 4, 1e-3)])
def test_zero3_equals_pytorch_fsdp2_and_one_process(fsdp_records, optimizer, n, atol):
    recs = fsdp_records[optimizer, n]
    assert sorted(r["rank"] for r in recs) == list(range(n))
    for r in recs:
        assert all(v <= atol for v in r["max_abs"].values()), r["max_abs"]
        if n == 2:
            # Two ranks' gradients are summed as a + b by both (addition commutes exactly):
            # zero3 and FSDP2 end bit for bit equal, with either optimizer.
            assert r["max_abs"]["zero3 vs fsdp2"] == 0.0, r["max_abs"]
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


@pytest.fixture(scope="module")
def probe():
    """tests/mpi/ranks/ledger_probe.py: zero1/2/3 at N = 2 and 4 in one launch, measured from
    outside the strategies: {(dp, n): one record per rank}."""
    from conftest import launch_ranks
    out = {}
    for r in launch_ranks(4, "ledger_probe.py", timeout=300).check().records():
        out.setdefault((r["dp"], r["size"]), []).append(r)
    return out


SHARDED = [(dp, n) for n in (2, 4) for dp in ("zero1", "zero2", "zero3")]


@pytest.mark.parametrize("dp,n", SHARDED)
def test_the_ledger_names_every_tensor_a_rank_holds(probe, dp, n):
    """memory() lists what the strategy holds: the storages reachable from the strategy and the
    model, walked without asking it, add up to the ledger's sum (within the few bytes of the
    loss's all-reduce)."""
    for r in probe[dp, n]:
        assert r["held_ledger"] == pytest.approx(r["held_walk"], rel=0.005, abs=4096), r


@pytest.mark.parametrize("n", (2, 4))
def test_zero2_never_holds_the_whole_gradient(probe, n):
    """During backward, zero2's parameters hold at most two buckets of gradients (each bucket's
    .grad dropped once it is reduced), where zero1's hold the whole 4 Phi; everything a zero2
    rank holds at its busiest moment of backward stays within ZeRO-2's 4 Phi + 12 Phi / N plus
    two bucket buffers and two buckets of live gradients."""
    for r1, r2 in zip(probe["zero1", n], probe["zero2", n]):
        phi, bucket = r2["phi"], max(r2["units"])
        assert len(r2["units"]) >= 6 and bucket < 0.2 * 4 * phi, r2["units"]
        assert r1["peak_live_grads"] == 4 * phi
        assert 0 < r2["peak_live_grads"] <= 2 * bucket, (r2["peak_live_grads"], bucket)
        formula = 4 * phi + 12 * phi / n
        assert formula < r2["peak_held"] <= formula + 4 * bucket + 4096, (r2["peak_held"], formula, bucket)
        assert r1["peak_held"] >= 8 * phi + 8 * phi / n


@pytest.mark.parametrize("n", (2, 4))
def test_zero3_frees_every_unit_between_forward_and_backward(probe, n):
    """No all-gathered unit outlives its forward (autograd keeps no view of one: its storage is
    gone at the end of forward), and at no time are more than three units whole (the one
    computing, the one prefetched, the one whose gradients are on their way)."""
    for r in probe["zero3", n]:
        phi, unit = r["phi"], max(r["units"])
        assert len(r["units"]) == 7 and r["end_of_forward"] == [0, 0], r
        assert 0 < r["peak_gathered"] <= 3 * unit < 4 * phi, (r["peak_gathered"], unit)


@pytest.mark.parametrize("dp,n", SHARDED)
def test_bytes_sent_counted_at_the_sends(probe, dp, n):
    """The bytes the ring's sends carry, counted at the MPI calls: 2(N-1)/N Phi d per step for
    zero1 and zero2 (reduce-scatter + all-gather), 3(N-1)/N Phi d for zero3 (two all-gathers
    and a reduce-scatter), and what the step reports (psrt's cost model) is that count."""
    passes = 3 if dp == "zero3" else 2
    for r in probe[dp, n]:
        want = passes * (n - 1) / n * r["phi"] * 4
        assert r["sent_counted"] == pytest.approx(want, rel=0.01), r
        assert r["sent_model"] == pytest.approx(r["sent_counted"], rel=0.01), r


def test_a_sharded_checkpoint_resumes_on_more_and_on_fewer_ranks(tmp_path):
    """zero1/2/3 and ps-sharded with Adam, checkpointed every 2 steps and resumed on another
    number of ranks each time (reshard on load): 2 ranks (ps-sharded: 1 dedicated server),
    then 4 (2 servers: growing), then 3 (a shard on every rank: shrinking), end where 6
    straight steps on 3 ranks do.  The parts of the parameters and of Adam's moments are
    reassembled and cut again; a lost or misplaced part moves a parameter by about the learning
    rate (3e-3), far above the tolerance of sums in another order.  (The fp16 loss scale's
    passage through a reshard: test_precision.py.)"""
    import torch
    from conftest import launch_ranks
    train = ["-m", "psrt.train", "--dp", "zero1,zero2,zero3,ps-sharded", "--optimizer", "adam",
             "--batch-size", "24", "--bucket-mb", "0.01", "--quiet"]
    ckpt = str(tmp_path / "c.pt")
    launch_ranks(3, *train, "--steps", "6", "--save", str(tmp_path / "straight.pt")).check()
    for n, steps, servers in ((2, 2, ["--servers", "1"]), (4, 4, ["--servers", "2"]), (3, 6, [])):
        resume = ["--resume"] if steps > 2 else []
        run = launch_ranks(n, *train, *servers, "--steps", str(steps), "--checkpoint", ckpt, *resume,
                           "--save", str(tmp_path / "resumed.pt")).check()
        assert "Traceback" not in run.stderr
    for dp in ("zero1", "zero2", "zero3", "ps-sharded"):
        a = torch.load(tmp_path / f"straight.{dp}.pt", weights_only=True)
        b = torch.load(tmp_path / f"resumed.{dp}.pt", weights_only=True)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6), (dp, k, (a[k] - b[k]).abs().max())
        saved = torch.load(tmp_path / f"c.{dp}.pt", weights_only=True)
        assert saved["step"] == 6 and saved["world_size"] == 3


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
