"""What several data-parallel strategies share: the flat view of a list of tensors, rank 0's
model on every rank, the dtypes gradients may travel in, and the optimizer they are given."""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch

from psrt.collectives.layout import group_by_size
from psrt.dp import COMPRESSIONS, DEFAULT_LR, OPTIMIZERS
from psrt.errors import PsrtError

# --compress: the dtype gradients travel in (None: their own).
COMPRESS = dict(zip(COMPRESSIONS, (None, torch.float16, torch.bfloat16)))


class Then:
    """A waitable that runs `after(result)` once the inner handle completes, and returns
    what `after` returns (a reduction's copy back out of its wire buffer, say)."""

    def __init__(self, handle, after):
        self._handle, self._after = handle, after

    def wait(self):
        return self._after(self._handle.wait())


def group_by_bytes(tensors: Sequence[torch.Tensor], nbytes: int) -> list[list[int]]:
    """Indices of consecutive `tensors` grouped into buckets of at least `nbytes` (the last
    may be smaller); a change of dtype or device starts a new bucket.  The one bucketer of
    the gradient reducers (ddp's buckets, zero2's reduce-scatter units)."""
    return group_by_size([t.numel() * t.element_size() for t in tensors], nbytes,
                         [(t.dtype, t.device) for t in tensors])


def check_compress(name: str, offered=tuple(COMPRESS), who: str = "psrt") -> None:
    if name not in offered:
        raise PsrtError(f"--compress {name!r}: {who} offers {', '.join(offered)}", everywhere=True)


def flatten(tensors: Sequence[torch.Tensor | None], like: Sequence[torch.Tensor] | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensors laid end to end in one flat tensor (into `out` when given, which may be
    longer).  A None entry stands for zeros shaped like the matching entry of `like`
    (a parameter that got no gradient on this rank)."""
    sizes = [(t if t is not None else like[i]).numel() for i, t in enumerate(tensors)]
    if out is None:
        first = next(t if t is not None else like[i] for i, t in enumerate(tensors))
        out = torch.empty(sum(sizes), dtype=first.dtype, device=first.device)
    off = 0
    for t, n in zip(tensors, sizes):
        if t is None:
            out[off:off + n].zero_()
        else:
            out[off:off + n].copy_(t.detach().reshape(-1))
        off += n
    return out


@torch.no_grad()
def copy_back(flat: torch.Tensor, tensors: Iterable[torch.Tensor]) -> None:
    """The inverse of `flatten`: consecutive slices of `flat` into `tensors`, in place."""
    off = 0
    for t in tensors:
        t.copy_(flat[off:off + t.numel()].view_as(t))
        off += t.numel()


def broadcast_model(model: torch.nn.Module, group, root: int = 0) -> None:
    """Give every rank root's parameters and buffers (one broadcast per dtype and device)."""
    broadcast_tensors(list(model.parameters()) + list(model.buffers()), group, root)


def broadcast_tensors(tensors: list[torch.Tensor], group, root: int = 0) -> None:
    """Give every rank root's values of `tensors`, in place (one broadcast per dtype and
    device; none when the list is empty, on every rank alike)."""
    if group.size == 1:
        return
    by_kind: dict = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for same in by_kind.values():
        flat = flatten(same)
        group.broadcast(flat, root=root)
        copy_back(flat, same)


def join_torch(group, model: torch.nn.Module) -> None:
    """torch.distributed over the ranks of `group` (the world's), for the strategies that
    reduce through it: gloo for a CPU model; for a CUDA model nccl where each rank of a host
    has a GPU of its own, else gloo (world.torch_backend_for)."""
    from psrt.world import join_torch_distributed
    join_torch_distributed(group.rank, group.size, None if next(model.parameters()).is_cuda else "gloo")


def optimizer_factory(name: str, lr: float | None = None, momentum: float = 0.0,
                      weight_decay: float = 0.0) -> Callable[[Iterable], torch.optim.Optimizer]:
    """`params -> optimizer`, the form every strategy takes (a strategy that shards the
    optimizer calls it on its shard only): 'sgd' (with momentum) or 'adam'."""
    if name not in OPTIMIZERS:
        raise PsrtError(f"optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}", everywhere=True)
    lr = DEFAULT_LR[name] if lr is None else lr

    def make(params):
        if name == "adam":
            return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    return make


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in `optimizer.state` (what sharding the optimizer divides)."""
    return sum(v.numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values() if torch.is_tensor(v))
