"""DP x PP x TP configuration checks (pure; tests/mpi/test_hybrid.py runs 2 x 2 x 2 against
one process)."""
from types import SimpleNamespace

import pytest

from psrt.errors import PsrtError
from psrt.train.hybrid import HybridConfig


def test_config_check_refuses_layouts_that_cannot_work():
    with pytest.raises(PsrtError, match=r"pp=4 x virtual_stages=2 = 8 stages but the model has only 4"):
        HybridConfig(layers=2, virtual_stages=2, schedule="interleaved").check(SimpleNamespace(pp=4, tp=1))
    with pytest.raises(PsrtError, match=r"tp=3 needs heads \(4\) divisible by tp"):
        HybridConfig(heads=4).check(SimpleNamespace(pp=1, tp=3))


def test_config_for_model_reads_the_transformer():
    from psrt.train.models import MLP, TransformerLM
    cfg = HybridConfig.for_model(TransformerLM(vocab=50, dim=32, layers=3, heads=2, max_len=16),
                                 microbatches=2)
    assert (cfg.vocab, cfg.dim, cfg.layers, cfg.heads, cfg.seq_len, cfg.microbatches) == (50, 32, 3, 2, 16, 2)
    with pytest.raises(PsrtError, match="need --model transformer"):
        HybridConfig.for_model(MLP(4, 2))
