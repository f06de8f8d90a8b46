"""--device: where a rank's model, its gradients and the batches it trains on live.

`cuda` gives each rank GPU `local_rank % device_count()` of the GPUs this process sees (torch
numbers them after CUDA_VISIBLE_DEVICES, so a launcher's or scheduler's choice is respected),
the mapping torchrun and Horovod use (one rank per GPU when the counts match, ranks sharing
GPUs round-robin when they do not).  `auto` is cuda where a GPU is visible, else cpu.
"""
from __future__ import annotations

import torch

from psrt.errors import PsrtError

DEVICES = ("cpu", "cuda", "auto")


def add_argument(parser, what: str, default: str | None = "cpu") -> None:
    """`--device` of a command line: one of DEVICES, `what` saying what it places there."""
    parser.add_argument("--device", default=default, choices=DEVICES,
                        help=f"{what} (cuda: GPU local_rank %% device_count; auto: cuda where a GPU is visible)")


def pick(name: str, local_rank: int) -> torch.device:
    """This rank's device for --device `name` (one of DEVICES); a one-line PsrtError for cuda
    where no GPU is visible."""
    if name not in DEVICES:
        raise PsrtError(f"--device {name!r}: choose one of {', '.join(DEVICES)}", everywhere=True)
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise PsrtError("--device cuda: no CUDA device is visible to this process (torch "
                        f"{torch.__version__}, CUDA_VISIBLE_DEVICES as set); use --device cpu or auto",
                        everywhere=True)
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def to(batch, device: torch.device):
    """`batch` (a tensor, or tuples, lists and dicts of them) on `device`; anything else as it is."""
    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        moved = [to(b, device) for b in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    if isinstance(batch, dict):
        return {k: to(v, device) for k, v in batch.items()}
    return batch
