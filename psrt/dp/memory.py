"""Where a rank's training memory goes: the bytes it holds, measured, beside the formula.

Measured from the tensors themselves: each strategy names what it holds (`memory()`:
parameters, gradients, the optimizer, communication buffers), and a storage shared by
several tensors (parameters that are views of one flat buffer, gradients that are views of
DDP's buckets) is counted once.  Activations are measured with saved-tensor hooks: the bytes
autograd keeps for backward during one micro-batch's forward.

The model-state formula is ZeRO's (Rajbhandari et al., SC 2020, sec. 3.1 and fig. 1) for
Phi parameters of d bytes, an optimizer keeping K bytes per parameter, N ranks:

    ddp   (params + grads + optimizer)   d Phi + d Phi + K Phi
    zero1                                d Phi + d Phi + K Phi / N
    zero2                                d Phi + (d + K) Phi / N
    zero3                                (2 d + K) Phi / N

In fp32 with Adam (d = 4, K = 8): 16 Phi, 8 Phi + 8 Phi / N, 4 Phi + 12 Phi / N, 16 Phi / N.

Activations of a transformer layer, Korthikanti et al. ("Reducing Activation Recomputation
in Large Transformer Models", 2022, sec. 4.1): 34 sbh + 5 a s^2 b bytes in 16-bit with
dropout (s sequence, b micro-batch, h width, a heads).  psrt's block has no dropout (its
2 sbh of one-byte masks go) and its attention kernel is fused, keeping no s x s matrix (the
5 a s^2 b terms go): 32 sbh bytes in 16-bit, i.e. 16 sbh elements.  With --recompute a block
keeps only its input, sbh elements.
"""
from __future__ import annotations

from typing import Callable

import torch

PARTS = ("params", "grads", "optimizer")

# How many parameters' worth of each model state a rank keeps, as (replicated, sharded) parts.
_SHARDING = {"zero1": {"params": 1, "grads": 1, "optimizer": 0},
             "zero": {"params": 1, "grads": 1, "optimizer": 0},
             "zero2": {"params": 1, "grads": 0, "optimizer": 0},
             "zero3": {"params": 0, "grads": 0, "optimizer": 0}}
_REPLICATED = ("ring", "native", "torch", "horovod")


def _storages(tensors) -> dict[int, int]:
    out = {}
    for t in tensors:
        if t is None or not torch.is_tensor(t) or t.numel() == 0:
            continue
        s = t.untyped_storage()
        out[(s.device.type, s.data_ptr())] = s.nbytes()
    return out


def optimizer_tensors(optimizer) -> list:
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


def held(strategy) -> dict[str, int]:
    """Bytes this rank holds now in each part (params, grads, optimizer, buffers), a storage
    counted once, in the first part that names it."""
    parts = strategy.memory()
    seen: dict = {}
    out = {}
    for name in PARTS + ("buffers",):
        value = parts.get(name) or []
        tensors = optimizer_tensors(value) if hasattr(value, "state") else list(value)
        mine = {k: v for k, v in _storages(tensors).items() if k not in seen}
        seen.update(mine)
        out[name] = sum(mine.values())
    return out


def state_bytes_per_param(optimizer: str, momentum: float = 0.0) -> int:
    """K of the formula for fp32 states: Adam keeps two moments, SGD one momentum buffer."""
    return 8 if optimizer == "adam" else (4 if momentum else 0)


def formula(dp: str, phi: int, n: int, k: int, d: int = 4) -> dict[str, float] | None:
    """Per-rank bytes of each model state by the ZeRO formula; None for a strategy it does
    not describe (the parameter servers)."""
    if dp in _REPLICATED:
        return {"params": d * phi, "grads": d * phi, "optimizer": k * phi}
    if dp not in _SHARDING:
        return None
    whole = _SHARDING[dp]
    return {"params": d * phi / (1 if whole["params"] else n), "grads": d * phi / (1 if whole["grads"] else n),
            "optimizer": k * phi / n}


def activation_bytes(forward: Callable[[], torch.Tensor], exclude: list[torch.Tensor]) -> int:
    """Bytes autograd saves for backward while `forward()` runs (storages counted once),
    leaving out the storages of `exclude` (the parameters, which are model state)."""
    skip = set(_storages(exclude))
    saved: dict = {}

    def pack(t):
        saved.update((k, v) for k, v in _storages([t]).items() if k not in skip)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out
    return sum(saved.values())


def transformer_activations(seq: int, batch: int, width: int, layers: int, vocab: int, d: int = 4,
                            recompute: bool = False) -> int:
    """The formula above for psrt's transformer: 16 sbh elements per block (1 with
    recompute), plus the head's LayerNorm input and projection input (2 sbh) and the
    log-softmax the loss keeps (s b vocab), d bytes each."""
    per_block = 1 if recompute else 16
    return d * seq * batch * (per_block * width * layers + 2 * width + vocab)
