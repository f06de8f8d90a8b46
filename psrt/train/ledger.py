"""The memory ledger of a psrt.train run: what each rank holds of every model state (and, on
CUDA, what the allocator counts), the activations one micro-batch keeps, and the row of the
summary's memory table beside ZeRO's formula (psrt.dp.memory)."""
from __future__ import annotations

import torch

from psrt.dp import memory, precision, strategy_class
from psrt.dp.base import option_names
from psrt.dp.driver import AXIS_BYTES
from psrt.train.config import TrainConfig


def held_by(run) -> dict:
    """Bytes this rank holds now in each part, summed over its data-parallel components."""
    out: dict = {}
    for c in run.components:
        for part, v in memory.held(c).items():
            out[part] = out.get(part, 0) + v
    out.update(memory.allocator(device_of(run)))
    return out


def device_of(run) -> torch.device:
    """Where this rank's model lives (the CPU for a rank that holds no parameters)."""
    for c in run.components:
        for p in c.model.parameters():
            return p.device
    return torch.device("cpu")


def activations(model, forward) -> int:
    """Bytes autograd keeps for backward over one micro-batch's forward (psrt.dp.memory), the
    model's buffers and the random state left as they were."""
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    rng = torch.get_rng_state()
    try:
        return memory.activation_bytes(forward, exclude=list(model.parameters()))
    finally:
        torch.set_rng_state(rng)
        with torch.no_grad():
            for k, b in model.named_buffers():
                b.copy_(buffers[k])


def memory_row(dp: str, everyone: list[dict], model, cfg: TrainConfig, dp_size: int | None = None) -> dict:
    """The ledger's columns: the most any rank holds of each part and where (host or device
    memory), the activations of one micro-batch, and ZeRO's formula for the model states
    (psrt.dp.memory).  On a grid (dp_size given) the formula takes the largest rank's share
    of the model (its stages' TP shards) and the data-parallel degree: ZeRO's terms over the
    dp group, the model divided by pp x tp."""
    most = {part: max(r["held"][part] for r in everyone) for part in memory.PARTS + ("buffers", "host", "device")}
    phi = max(r["params"] for r in everyone) if dp_size else \
        sum(p.numel() for p in model.parameters() if p.requires_grad)
    k = memory.state_bytes_per_param(cfg.optimizer, cfg.momentum)
    d = next(model.parameters()).element_size()
    offload = bool(cfg.offload_optimizer) and "offload_optimizer" in option_names(strategy_class(dp))
    n = dp_size or sum(r["worker"] for r in everyone)
    expect = memory.formula(dp, phi, n, k, d, offload) if not (dp_size and cfg.ep > 1) else None
    row = {f"mem_{part}": v for part, v in most.items()}
    row["mem_states"] = max(sum(r["held"][part] for part in memory.PARTS) for r in everyone)
    row["mem_activations"] = max(r["held"].get("activations", 0) for r in everyone)
    row["params"] = phi
    row["offload"] = offload
    for key in ("allocated", "peak"):          # the CUDA allocator's count, beside the formula
        if any(key in r["held"] for r in everyone):
            row[f"mem_cuda_{key}"] = max(r["held"].get(key, 0) for r in everyone)
    if expect is not None:
        row["formula_states"] = sum(expect.values())
    if cfg.model == "transformer" and not dp_size:
        blocks = model.blocks
        compute = precision.DTYPES[cfg.precision]
        row["formula_activations"] = memory.transformer_activations(
            cfg.seq_len, cfg.batch_size // max(1, sum(r["worker"] for r in everyone)) // cfg.accum,
            blocks[0].ln1.normalized_shape[0], len(blocks), model.head.out.out_features, d, cfg.recompute,
            compute=None if compute is None else torch.empty(0, dtype=compute).element_size())
    for key in AXIS_BYTES:
        per_rank = [r["axis_bytes"].get(key, 0) for r in everyone]
        if any(per_rank):
            row[key.replace("_sent", "_per_rank")] = sum(per_rank) / len(per_rank)
    return row
