"""Tensor parallelism under MPI (tests/mpi/ranks/tp_equivalence.py on 2 ranks): column/row-parallel
linear, vocabulary-parallel embedding and cross-entropy, attention with heads split, and the
TP transformer loaded from psrt.train.models.TransformerLM, each against the dense module (values
and gradients, fp32 rtol 1e-5 / atol 4e-5); TP=2 equals TP=1; Megatron-LM's communication
count per block; with sequence parallelism (an uneven sequence of 7 over 2 ranks) the same
loss and gradients as the dense model, and its all-gather / reduce-scatter count."""
import pytest


def test_tp_layers_and_transformer_match_dense(run_ranks):
    recs = run_ranks(2, "tp_equivalence.py", timeout=300).check().records()
    assert sorted((r["rank"], r["tp"]) for r in recs) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    failures = [(r["rank"], r["tp"], r["errors"]) for r in recs if r["errors"]]
    assert not failures
    one = [r["lm_loss"] for r in recs if r["tp"] == 1]
    two = [r["lm_loss"] for r in recs if r["tp"] == 2]
    assert two[0] == two[1]                       # both TP ranks report the same loss
    assert two[0] == pytest.approx(one[0], rel=1e-5, abs=4e-5)
    sp = [r["sp_loss"] for r in recs if r["tp"] == 2]
    assert sp[0] == sp[1]
    assert sp[0] == pytest.approx([r["sp_loss"] for r in recs if r["tp"] == 1][0], rel=1e-5, abs=4e-5)
    for r in recs:
        counts, bsh = r["counts"], r["counts"]["bsh_bytes"]
        if r["tp"] == 1:
            assert counts["forward"] == [{}, {}] and counts["backward"] == [{}, {}]
        else:
            # Shoeybi et al. 2019, sec. 3: two all-reduces of b*s*h per block forward (g after
            # attention and after the MLP) and two backward (f before QKV and before fc1).
            assert counts["forward"] == [{"allreduce": 2}, {"allreduce": 2 * bsh}]
            assert counts["backward"] == [{"allreduce": 2}, {"allreduce": 2 * bsh}]
            # Sequence parallelism (Korthikanti et al. 2022, sec. 4.2.2): each all-reduce
            # becomes an all-gather (f-bar) or a reduce-scatter (g-bar) along the sequence.
            assert counts["sp_forward"] == {"allgather": 2, "reduce_scatter": 2}
            assert counts["sp_backward"] == {"allgather": 2, "reduce_scatter": 2}


def test_sequence_parallel_training_follows_the_same_losses(run_ranks, tmp_path):
    """psrt.train --tp 2 with and without --sequence-parallel: the same loss at every step (the
    LayerNorm and bias gradients summed over the TP group; a missing sum changes them)."""
    import json
    losses = {}
    for flag in ("", "--sequence-parallel"):
        metrics = tmp_path / f"m{flag}.jsonl"
        run_ranks(2, "-m", "psrt.train", "--tp", "2", "--model", "transformer", "--steps", "4", "--quiet",
                  "--metrics", str(metrics), *([flag] if flag else [])).check()
        losses[flag] = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()
                        if not json.loads(line).get("summary")]
    assert len(losses[""]) == 4
    assert losses["--sequence-parallel"] == pytest.approx(losses[""], rel=1e-5)
