"""Mixture-of-Experts with expert parallelism (psrt/ep): equivalence with one process holding
every expert, the psrt.train command line, its summary and its bad inputs."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_train_cli import ranks  # noqa: E402

pytestmark = pytest.mark.mpi


def test_expert_parallel_equals_one_process(run_ranks):
    """EP = 1, 2, 4 inside DP = 4; top-1 and top-2; variable and padded all-to-all; a capacity
    with room for all and one that drops (tests/mpi/ranks/moe_equivalence.py)."""
    records = run_ranks(4, "moe_equivalence.py", timeout=300).check().records()
    assert len(records) == 4
    for rec in records:
        assert rec["failures"] == [] and rec["checked"] > 500, rec


@pytest.mark.parametrize("np_", [4, 8])
def test_moe_on_a_pipeline_and_tensor_parallel_grid_equals_one_process(run_ranks, np_):
    """4 ranks: pp 2 x dp 2 and tp 2 x dp 2 with ep 2 and ep 1 (expert gradients summed over
    an edp group of 2), dp 4 with ep 2, pp 2 x tp 2; 8 ranks: pp 2 x dp 4 with ep 2 and ep 4.
    Top-1 and top-2, drops, padded dispatch, --recompute; parameters, losses, dropped counts
    and the balance loss (tests/mpi/ranks/moe_hybrid_equivalence.py)."""
    records = run_ranks(np_, "moe_hybrid_equivalence.py", timeout=480).check().records()
    assert len(records) == np_
    for rec in records:
        assert rec["failures"] == [] and rec["checked"] > (100 if np_ == 4 else 30), rec


def test_train_moe_with_pp_routes_every_token_and_counts_the_all_to_all(tmp_path):
    """psrt.train --model moe --pp 2 --ep 2: the routing summary gathers both stages' layers and
    --metrics holds each step's routing; padded dispatch at capacity factor 1 sends exactly the
    uniform-routing bytes, counted in bf16, the dtype the rows travel in."""
    run = ranks(4, "--model", "moe", "--pp", "2", "--experts", "4", "--ep", "2", "--top-k", "2", "--steps", "2",
                "--width", "32", "--moe-dispatch", "padded", "--capacity-factor", "1.0", "--precision", "bf16",
                "--quiet", "--metrics", str(tmp_path / "m.jsonl")).check()
    assert "ring pp2 tp1 ep2: 4 experts, top-2, ep 2; tokens routed per expert per step and layer: e0 " \
        in run.stdout, run.stdout
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    steps, summary = lines[:-1], lines[-1]
    tokens = 64 * 64                      # global batch x sequence length
    assert len(steps) == 2 and sum(summary["routed_per_step"]) == 2 * tokens, summary  # k x tokens, per layer
    for s in steps:       # both layers (one per stage), as the plain MoE run writes them
        assert s["ep"] == 2 and sum(s["routed"]) == 2 * 2 * tokens and 0 <= s["dropped"] < 2 * 2 * tokens, s
        # alpha E sum f_i P_i lies in [alpha / E, alpha E] per layer (P_i >= f_i / E: a token's
        # first choice has probability >= 1/E)
        assert 2 * 0.01 / 4 <= s["aux_loss"] <= 2 * 0.01 * 4, s
    # every expert's buffer holds its capacity T k / E rows, full or not: 4 all-to-alls of
    # T k h d (EP-1)/EP bytes per layer and step, d = 2 for bf16, T = 2048 tokens per rank
    assert summary["a2a_bytes_per_step"] == pytest.approx(summary["a2a_uniform"], rel=1e-12), summary
    assert summary["a2a_uniform"] == 4 * 2048 * 2 * 32 * 2 * (1 / 2) * (2 / 2), summary


def test_moe_mixed_precision_reaches_the_fp32_loss():
    """--precision fp16 (loss scaling, the balance loss scaled alike) and bf16 on a pipeline:
    the final training loss within 2% of fp32's after 20 steps."""
    def final_loss(*argv):
        run = ranks(4, "--model", "moe", "--experts", "4", "--ep", "2", "--steps", "20", "--width", "32",
                    "--quiet", *argv).check()
        line = next(x for x in run.stdout.splitlines() if x.startswith("ring ") and " 20 " in x)
        return float(line.split()[line.split().index("20") + 1]), run.stdout
    fp32, _ = final_loss()
    fp16, out = final_loss("--precision", "fp16")
    assert "fp16 loss scaling skipped" in out, out
    bf16, _ = final_loss("--precision", "bf16", "--pp", "2")
    assert abs(fp16 - fp32) < 0.02 * fp32 and abs(bf16 - fp32) < 0.02 * fp32, (fp32, fp16, bf16)


def dense_bytes(experts_too: bool = False, **moe) -> int:
    """fp32 bytes of the MoE transformer's parameters outside its experts (what --dp reduces
    over dp), or of its experts."""
    from psrt.train.data import load
    from psrt.train.models import build_model
    model = build_model("moe", load("text", 64), 32, 0, **moe)
    return 4 * sum(p.numel() for n, p in model.named_parameters() if (".experts." in n) == experts_too)


def test_train_moe_summary_and_metrics(tmp_path):
    run = ranks(4, "--model", "moe", "--experts", "4", "--ep", "2", "--top-k", "2", "--steps", "3",
                "--width", "32", "--algorithm", "doubling", "--quiet", "--metrics", str(tmp_path / "m.jsonl")).check()
    assert "ring ep2: 4 experts, top-2, ep 2; tokens routed per expert per step and layer: e0 " in run.stdout
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    steps, summary = lines[:-1], lines[-1]
    assert len(steps) == 3 and summary["summary"]
    # every token's two choices are routed somewhere: 2 x tokens per layer and step, both layers
    tokens = 64 * 64                      # global batch x sequence length
    assert all(sum(s["routed"]) == 2 * 2 * tokens for s in steps), [sum(s["routed"]) for s in steps]
    assert 0.5 < summary["a2a_bytes_per_step"] / summary["a2a_uniform"] < 1.5, summary
    assert summary["dropped_frac"] < 0.25
    # --algorithm reduces the gradients: recursive doubling sends log2(4) = 2 x M of the dense
    # parameters over dp (4 ranks) and log2(2) = 1 x the rank's half of the experts over edp
    # (2 ranks); each bucket carries one element more (the loss)
    reduced = (summary["bytes_per_rank"] - 3 * summary["a2a_bytes_per_step"]) / 3
    expect = 2 * dense_bytes(experts=4, top_k=2) + dense_bytes(True, experts=4, top_k=2) / 2
    assert reduced == pytest.approx(expect, rel=1e-3), summary


@pytest.mark.parametrize("argv,words", [
    (["--model", "moe", "--experts", "3", "--ep", "2"], "--experts 3 does not split over --ep 2"),
    # more expert-parallel ranks than ranks: the ranks are named, not the experts
    (["--model", "moe", "--ep", "8"], "--ep 8 must divide the data-parallel degree 2"),
    (["--model", "moe", "--experts", "3", "--ep", "3"], "--ep 3 must divide the data-parallel degree 2"),
    (["--model", "moe", "--pp", "2", "--ep", "2"], "--ep 2 must divide the data-parallel degree 1: expert "
     "parallelism is carved out of data parallelism (here 2 ranks / (--pp 2 x --tp 1))"),
    (["--model", "moe", "--top-k", "5"], "--top-k 5: must be between 1 and --experts 4"),
    (["--model", "moe", "--capacity-factor", "-1"], "--capacity-factor -1.0: must be a positive number"),
    (["--model", "moe", "--ep", "2", "--dp", "zero3"], "--dp zero3 with --model moe --ep 2: the experts' parameters"),
    (["--experts", "8"], "--experts: for --model moe only"),
    (["--model", "moe", "--tp", "2", "--sequence-parallel"], "--sequence-parallel with --model moe"),
])
def test_bad_moe_input_is_one_line_and_exit_2(argv, words):
    run = ranks(2, *argv, "--steps", "1")
    assert run.returncode == 2, run.stderr[-2000:]
    assert words in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]


def test_bench_moe(run_ranks, tmp_path):
    """bench moe on one host: both all-to-alls at every EP that divides N, the prediction beside
    them, and the dense vs MoE step with both dispatch shapes."""
    out = tmp_path / "moe.json"
    run = run_ranks(4, "-m", "psrt.bench", "moe", "--sizes", "64KiB", "--repeats", "1", "--steps", "1",
                    "--capacity-factor", "2", "--json", str(out), timeout=240).check()
    payload = json.loads(out.read_text())
    assert [r["ep"] for r in payload["rows"]] == [2, 4]
    for r in payload["rows"]:
        assert r["pairwise"] > 0 and r["native"] > 0 and r["predicted"] > 0
        assert len(r["steps_s"]) == r["ep"] - 1 and min(r["steps_s"]) > 0, r   # each step alone
    assert set(payload["steps"]) == {"transformer", "moe", "moe padded"}
    # padded dispatch sends 3 other experts' full capacity, ceil(2 x 512 tokens / 4) rows of
    # 64 fp32 values, in 4 all-to-alls of 2 layers; variable sends the kept rows, at most 512
    a2a = payload["a2a_bytes"]
    assert a2a["moe padded"] == 4 * 2 * 3 * 256 * 64 * 4, a2a
    assert 0 < a2a["moe"] <= 4 * 2 * 512 * 64 * 4, a2a
    assert "# MoE dispatch at capacity factor 2: padded " in run.stdout, run.stdout


def test_example_prints_the_routing_table(run_ranks):
    run = run_ranks(4, str(Path(__file__).resolve().parents[2] / "examples" / "moe.py"), "--steps", "1",
                    timeout=240).check()
    lines = run.stdout.splitlines()
    assert lines[0].startswith("step 1: loss ") and "dropped" in lines[0]
    table = [line.split() for line in lines[2:6]]
    assert [row[:2] for row in table] == [["e0", "(r0)"], ["e1", "(r1)"], ["e2", "(r2)"], ["e3", "(r3)"]]
    # every choice of every token is routed: kept ones appear in the table, the rest were dropped
    kept = sum(int(row[-1]) for row in table)
    words = lines[0].split()            # step 1: loss L, balance loss B, dropped D of C choices
    dropped, choices = int(words[words.index("dropped") + 1]), int(words[words.index("of") + 1])
    assert kept + dropped == choices, run.stdout
