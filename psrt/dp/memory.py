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
keeps only its input, sbh elements.  Under --precision bf16/fp16 see transformer_activations.

These are the bytes one micro-batch's forward leaves for its backward: with --accum the
micro-batches run one after another, each backward freeing them before the next forward, so
for the data-parallel strategies this is the most saved activations held at once.  It leaves
out temporaries that live within one operation or one backward (the logits before the
log-softmax, the gradients flowing back).
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


def storages(tensors) -> dict[int, int]:
    """{(device type, address): bytes} of the storages behind `tensors`, each once (views share one)."""
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
    counted once, in the first part that names it; and all of them split by where they live,
    `host` (CPU memory) and `device` (an accelerator's: what --offload-optimizer moves off)."""
    parts = strategy.memory()
    seen: dict = {}
    out = {}
    for name in PARTS + ("buffers",):
        value = parts.get(name) or []
        tensors = optimizer_tensors(value) if hasattr(value, "state") else list(value)
        mine = {k: v for k, v in storages(tensors).items() if k not in seen}
        seen.update(mine)
        out[name] = sum(mine.values())
    out.update(by_place(seen))
    return out


def by_place(storages: dict) -> dict[str, int]:
    """{"host": bytes in CPU memory, "device": bytes elsewhere} of `storages`' result."""
    device = sum(v for (kind, _), v in storages.items() if kind != "cpu")
    return {"host": sum(storages.values()) - device, "device": device}


def allocator(device: torch.device) -> dict[str, int]:
    """What the CUDA caching allocator counts for this process on `device`: bytes of live
    tensors now (`allocated`: the model states and buffers above, plus whatever else is
    alive) and the most at any moment since `reset_peak` (`peak`: activations included).
    Empty off CUDA."""
    if device.type != "cuda":
        return {}
    return {"allocated": torch.cuda.memory_allocated(device), "peak": torch.cuda.max_memory_allocated(device)}


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def state_bytes_per_param(optimizer: str, momentum: float = 0.0) -> int:
    """K of the formula for fp32 states: Adam keeps two moments, SGD one momentum buffer."""
    return 8 if optimizer == "adam" else (4 if momentum else 0)


def formula(dp: str, phi: int, n: int, k: int, d: int = 4, offload: bool = False) -> dict[str, float] | None:
    """Per-rank bytes of each model state by the ZeRO formula; None for a strategy it does
    not describe (the parameter servers).  With `offload` (zero1/2/3's --offload-optimizer,
    ZeRO-Offload) the optimizer part lives in host memory and holds, besides its K bytes of
    state, the rank's master copy and gradient copy: (K + 2 d) Phi / N."""
    if dp in _REPLICATED:
        return {"params": d * phi, "grads": d * phi, "optimizer": k * phi}
    if dp not in _SHARDING:
        return None
    whole = _SHARDING[dp]
    return {"params": d * phi / (1 if whole["params"] else n), "grads": d * phi / (1 if whole["grads"] else n),
            "optimizer": (k + (2 * d if offload else 0)) * phi / n}


def activation_bytes(forward: Callable[[], torch.Tensor], exclude: list[torch.Tensor]) -> int:
    """Bytes autograd saves for backward while `forward()` runs (storages counted once),
    leaving out the storages of `exclude` (the parameters, which are model state)."""
    skip = set(storages(exclude))
    saved: dict = {}

    def pack(t):
        saved.update((k, v) for k, v in storages([t]).items() if k not in skip)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out
    return sum(saved.values())


def transformer_activations(seq: int, batch: int, width: int, layers: int, vocab: int, d: int = 4,
                            recompute: bool = False, compute: int | None = None) -> int:
    """The formula above for psrt's transformer, in bytes: per block 16 sbh elements, of d
    bytes in fp32; under autocast (`compute`: bytes of the compute dtype, 2 for bf16 and
    fp16) 14 sbh of them in the compute dtype and the two LayerNorm inputs in fp32 (LayerNorm
    runs in fp32 and the residual stream stays fp32: 36 sbh bytes in 16-bit, Korthikanti's
    34 sbh without dropout's 2 and with the LayerNorm inputs' 4 more), plus autocast's cast
    copy of the block's matmul weights (12 h^2 elements), kept for backward.  With recompute
    a block keeps its fp32 input, sbh elements.  The head adds its LayerNorm input (fp32),
    its projection's input (and its weight's cast copy under autocast) and the fp32
    log-softmax the loss keeps (s b vocab)."""
    sbh, sbv = seq * batch * width, seq * batch * vocab
    c = compute or d
    cast = compute is not None                 # autocast's copies of the matmul weights
    if recompute:
        block = d * sbh
    else:
        block = 14 * c * sbh + 2 * d * sbh + (c * 12 * width * width if cast else 0)
    head = d * sbh + c * sbh + (c * width * vocab if cast else 0) + d * sbv
    return layers * block + head
