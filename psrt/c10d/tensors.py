"""Tensors as psrt's collectives take them, for the torch.distributed backend: flat views,
bytes for the dtypes psrt's transport does not reduce (int16, complex, float8, ...), complex
sums as pairs of reals, torch's reduce ops as psrt's names, and the sparse all-reduce."""
from __future__ import annotations

import torch
import torch.distributed as dist

from psrt.c10d.p2p import store as _store
from psrt.errors import PsrtError
from psrt.transport import SUPPORTED_DTYPES

RedOpType = dist.ReduceOp.RedOpType
_OPS = {RedOpType.SUM: "sum", RedOpType.AVG: "avg", RedOpType.PRODUCT: "prod",
        RedOpType.MIN: "min", RedOpType.MAX: "max", RedOpType.PREMUL_SUM: "sum",
        RedOpType.BAND: "band", RedOpType.BOR: "bor", RedOpType.BXOR: "bxor"}



def reduce_op(op) -> tuple[str, object]:
    """(psrt op name, pre-multiplication factor or None) for a torch ReduceOp."""
    kind = op.op if isinstance(op, dist.ReduceOp) else op
    if kind not in _OPS:
        raise PsrtError(f"psrt backend: reduce op {kind} is not supported")
    return _OPS[kind], (op.factor if kind == RedOpType.PREMUL_SUM else None)


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """t as a 1-D tensor of a dtype the transport moves: itself (a view when contiguous), or
    its bytes."""
    flat = t.reshape(-1)
    return flat if flat.dtype in SUPPORTED_DTYPES else flat.contiguous().view(torch.uint8)


def flat_numel(t: torch.Tensor) -> int:
    """Elements of `flat_view(t)`."""
    return t.numel() if t.dtype in SUPPORTED_DTYPES else t.numel() * t.element_size()


def split_into(flat: torch.Tensor, outs: list[torch.Tensor]) -> None:
    start = 0
    for o in outs:
        n = flat_numel(o)
        _store(flat[start:start + n], o)
        start += n


def reducible(t: torch.Tensor, op: str) -> torch.Tensor:
    """t (contiguous) in a dtype psrt reduces: complex sums as pairs of reals."""
    if t.is_complex() and op in ("sum", "avg"):
        return torch.view_as_real(t)
    if t.dtype not in SUPPORTED_DTYPES:
        raise PsrtError(f"psrt backend: cannot reduce a {t.dtype} tensor with {op!r} "
                        f"(reducible: {', '.join(str(d).replace('torch.', '') for d in SUPPORTED_DTYPES)})")
    return t


def allreduce_sparse(group, t: torch.Tensor, opts_op) -> None:
    """Sum a sparse COO tensor over `group` (a Communicator), in place, as gloo does (ProcessGroupGloo's
    AsyncSparseAllreduceWork): every rank's indices and values are all-gathered and the
    union is coalesced (duplicates summed)."""
    op, _ = reduce_op(opts_op)
    if op != "sum":
        raise PsrtError(f"psrt backend: all_reduce of a sparse tensor sums only (got {op!r}), as gloo's")
    local = t.coalesce()
    indices = local.indices().t().contiguous()        # nnz x sparse_dim
    values = local.values().contiguous()               # nnz x dense dims
    nnz = group.allgather(torch.tensor([indices.shape[0]], dtype=torch.int64),
                               counts=[1] * group.size).tolist()
    per_index = indices.shape[1]
    per_value = flat_numel(torch.empty(values.shape[1:], dtype=values.dtype))   # one entry's elements
    every_index = group.allgather(indices.reshape(-1), counts=[k * per_index for k in nnz])
    every_value = group.allgather(flat_view(values), counts=[k * per_value for k in nnz])
    total = sum(nnz)
    if every_value.dtype != values.dtype:
        every_value = every_value.view(values.dtype)
    result = torch.sparse_coo_tensor(every_index.view(total, per_index).t(),
                                     every_value.view((total,) + tuple(values.shape[1:])),
                                     t.shape).coalesce()
    t.copy_(result)
