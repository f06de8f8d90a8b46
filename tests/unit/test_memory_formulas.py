"""The memory ledger's formulas (psrt.dp.memory) in one process: the activation formula
against the bytes autograd really saves, in fp32 and under autocast, with and without
recomputation; ZeRO's model-state formula with the optimizer offloaded; where bytes live."""
import pytest
import torch
import torch.nn.functional as F

from psrt.dp import memory
from psrt.train.models import TransformerLM

S, B, H, V, L = 32, 4, 64, 96, 2


@pytest.mark.parametrize("recompute", (False, True))
@pytest.mark.parametrize("dtype", (None, torch.bfloat16, torch.float16))
def test_the_activation_formula_is_what_autograd_saves(dtype, recompute):
    torch.manual_seed(0)
    model = TransformerLM(vocab=V, dim=H, layers=L, max_len=S, recompute=recompute)
    x, y = torch.randint(0, V, (B, S)), torch.randint(0, V, (B, S))

    def forward():
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            return F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1)).float()
    measured = memory.activation_bytes(forward, exclude=list(model.parameters()))
    formula = memory.transformer_activations(S, B, H, L, V, 4, recompute,
                                             compute=None if dtype is None else 2)
    # What the formula leaves out: LayerNorm's mean and rstd, attention's log-sum-exp and the
    # targets, a few per cent at this small width.
    assert formula <= measured <= 1.03 * formula, (measured, formula)


def test_the_16_bit_block_is_korthikantis_with_fp32_layernorm_inputs():
    """36 sbh bytes per block under autocast (34 sbh - 2 sbh of dropout masks + 4 sbh for
    the LayerNorm inputs kept in fp32) plus the cast matmul weights; fp32: 16 sbh elements."""
    one = memory.transformer_activations(S, B, H, 1, V, compute=2) - memory.transformer_activations(S, B, H, 0, V, compute=2)
    assert one == 36 * S * B * H + 2 * 12 * H * H
    fp32 = memory.transformer_activations(S, B, H, 1, V) - memory.transformer_activations(S, B, H, 0, V)
    assert fp32 == 4 * 16 * S * B * H


def test_zero_formulas_with_and_without_the_optimizer_offloaded():
    phi, n, k = 1000, 4, 8
    assert memory.formula("zero2", phi, n, k) == {"params": 4000, "grads": 1000, "optimizer": 2000}
    # ZeRO-Offload: the host keeps the rank's state, master copy and gradient copy
    assert memory.formula("zero2", phi, n, k, offload=True)["optimizer"] == (8 + 8) * phi / n
    assert sum(memory.formula("zero3", phi, n, k).values()) == 16 * phi / n
    assert memory.formula("ps", phi, n, k) is None


def test_bytes_are_split_by_where_they_live():
    storages = {("cpu", 1): 10, ("cuda", 2): 30, ("cpu", 3): 5}
    assert memory.by_place(storages) == {"host": 15, "device": 30}
    assert memory.by_place({}) == {"host": 0, "device": 0}
