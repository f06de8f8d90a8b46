"""Data-parallel strategies, selected by `--dp NAME`, and the names a user may choose.

Entries are import paths so a strategy's module (and its optional dependencies, such as
horovod, and torch) is only imported when it is chosen: a command line is checked first.
"""
from __future__ import annotations

import importlib

from psrt.errors import PsrtError

STRATEGIES = {
    "ps": "psrt.dp.ps:ParameterServer",                      # synchronous, one server
    "ps-sharded": "psrt.dp.ps_sharded:ShardedParameterServer",
    "ps-async": "psrt.dp.ps_async:AsyncParameterServer",     # bounded staleness (SSP)
    "ring": "psrt.dp.ddp:RingDDP",                           # psrt's ring all-reduce, bucketed
    "native": "psrt.dp.ddp:NativeDDP",                       # same shape, MPI library allreduce
    "torch": "psrt.dp.ddp:TorchDDP",                         # same shape, torch.distributed
    "zero1": "psrt.dp.zero:ZeroOptimizer",                   # ZeRO-1: sharded optimizer state
    "zero2": "psrt.dp.zero:Zero2",                           # ZeRO-2: ... and gradients
    "zero3": "psrt.dp.zero3:Zero3",                          # ZeRO-3 / FSDP: ... and parameters
    "zero": "psrt.dp.zero:ZeroAlias",                        # zero1 under its earlier name
    "horovod": "psrt.dp.horovod:HorovodStrategy",
}


# Which strategies take each option (the fields of their Options dataclasses), readable before
# torch loads: psrt.train's help text is generated from it, and tests/unit/test_options.py
# checks it against the Options classes themselves.
OPTION_TAKERS = {
    "algorithm": ("ring", "native", "torch", "zero1", "zero2", "zero3", "zero"),
    "bucket_mb": ("ring", "native", "torch", "zero2"),
    "overlap": ("ring", "native", "torch", "zero3"),
    "compress": ("ring", "native", "torch", "zero1", "zero2", "zero3", "zero", "horovod"),
    "servers": ("ps", "ps-sharded", "ps-async"),
    "staleness": ("ps", "ps-sharded", "ps-async"),
    "offload_optimizer": ("zero1", "zero2", "zero3", "zero"),
    "local_aggregation": ("ps", "ps-sharded"),
    "backup_workers": ("ps",),
}

# --compress: the dtypes gradients may travel in (psrt.dp.common.COMPRESS maps them).
COMPRESSIONS = ("none", "fp16", "bf16")
OPTIMIZERS = ("sgd", "adam")
DEFAULT_LR = {"sgd": 0.1, "adam": 3e-3}
# The gradient bucket of the bucketed all-reduce strategies, in MiB: PyTorch DDP's bucket_cap_mb.
DEFAULT_BUCKET_MB = 25.0


def strategy_class(name: str):
    if name not in STRATEGIES:
        raise PsrtError(f"unknown data-parallel strategy {name!r}; choose one of {', '.join(STRATEGIES)}",
                        everywhere=True)
    module, cls = STRATEGIES[name].split(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as err:
        raise PsrtError(f"--dp {name} is not available: {err}", everywhere=True) from err
