"""Tensor parallelism under MPI (tests/mpi/ranks/tp_equivalence.py on 2 ranks): column/row-parallel
linear, vocabulary-parallel embedding and cross-entropy, attention with heads split, and the
TP transformer loaded from psrt.train.models.TransformerLM, each against the dense module (values
and gradients, fp32 rtol 1e-5 / atol 4e-5); TP=2 equals TP=1; Megatron-LM's communication
count per block."""
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
    for r in recs:
        counts, bsh = r["counts"], r["counts"]["bsh_bytes"]
        if r["tp"] == 1:
            assert counts["forward"] == [{}, {}] and counts["backward"] == [{}, {}]
        else:
            # Shoeybi et al. 2019, sec. 3: two all-reduces of b*s*h per block forward (g after
            # attention and after the MLP) and two backward (f before QKV and before fc1).
            assert counts["forward"] == [{"allreduce": 2}, {"allreduce": 2 * bsh}]
            assert counts["backward"] == [{"allreduce": 2}, {"allreduce": 2 * bsh}]
