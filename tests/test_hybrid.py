"""DP x PP x TP (tests/mpi/hybrid_equivalence.py on 8 ranks as 2 x 2 x 2): several training
steps equal one process training the dense model on the whole batch (losses, every rank's
parameter shards and the reassembled model), with 1F1B + ring and interleaved + PS; the
grid coordinates and sub-communicators follow the TP-fastest layout."""
from types import SimpleNamespace

import pytest

from psrt.errors import PsrtError
from psrt.grid import rank_of
from psrt.train.hybrid import HybridConfig


def test_config_check_refuses_layouts_that_cannot_work():
    with pytest.raises(PsrtError, match=r"pp=4 x virtual_stages=2 = 8 stages but the model has only 4"):
        HybridConfig(layers=2, virtual_stages=2, schedule="interleaved").check(SimpleNamespace(pp=4, tp=1))
    with pytest.raises(PsrtError, match=r"tp=3 needs heads \(4\) divisible by tp"):
        HybridConfig(heads=4).check(SimpleNamespace(pp=1, tp=3))


def test_2x2x2_matches_one_process(run_ranks):
    recs = run_ranks(8, "hybrid_equivalence.py", timeout=400).check().records()
    assert sorted((r["rank"], r["schedule"]) for r in recs) == \
        sorted((k, s) for k in range(8) for s in ("1f1b", "interleaved"))
    failures = [(r["rank"], r["schedule"], r["errors"]) for r in recs if r["errors"]]
    assert not failures
    for r in recs:
        assert r["checked"] > 0
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5, abs=4e-5)
        d, p, t = r["coords"]
        assert r["rank"] == rank_of(d, p, t, 2, 2, 2)
        assert r["tp_members"] == [rank_of(d, p, i, 2, 2, 2) for i in range(2)]
        assert r["dp_members"] == [rank_of(i, p, t, 2, 2, 2) for i in range(2)]
        assert r["pp_members"] == [rank_of(d, i, t, 2, 2, 2) for i in range(2)]


def test_config_for_model_reads_the_transformer():
    from psrt.train.models import MLP, TransformerLM
    cfg = HybridConfig.for_model(TransformerLM(vocab=50, dim=32, layers=3, heads=2, max_len=16),
                                 microbatches=2)
    assert (cfg.vocab, cfg.dim, cfg.layers, cfg.heads, cfg.seq_len, cfg.microbatches) == (50, 32, 3, 2, 16, 2)
    with pytest.raises(PsrtError, match="need --model transformer"):
        HybridConfig.for_model(MLP(4, 2))
