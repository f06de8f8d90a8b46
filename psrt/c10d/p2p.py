"""Sends and receives of the psrt backend: MPI requests seen by torch.distributed as `Work`."""
from __future__ import annotations

import datetime
import threading

import torch

from psrt import env
from psrt.c10d.work import Work
from psrt.collectives.p2p import poll


def store(flat: torch.Tensor, into: torch.Tensor) -> None:
    """Copy a result produced by `_flat`-style tensors back into the user's tensor."""
    if flat.dtype != into.dtype:
        flat = flat.view(into.dtype)
    if flat.data_ptr() != into.data_ptr() or not into.is_contiguous():
        into.copy_(flat.view(into.shape))


class P2PWork(Work):
    """A send or receive in flight: an MPI request, completed by wait() (within PSRT_TIMEOUT,
    so a message that never comes is an error naming the peer, not a hang)."""

    def __init__(self, request, result: list, keep: torch.Tensor, what: str,
                 into: torch.Tensor | None = None):
        super().__init__(result, name=what)
        self._request, self._keep, self._into = request, keep, into
        self._lock = threading.Lock()

    def _complete(self) -> None:
        with self._lock:
            if self._done.is_set():
                return
            timeout_s = env.timeout_s()
            poll(self._request.Test, timeout_s,
                 lambda: f"psrt backend: {self.name} not matched after {timeout_s:g} s (PSRT_TIMEOUT)")
            if self._into is not None:
                store(self._keep.to(self._into.device), self._into)
            self._finish()

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        try:
            self._complete()
        except BaseException as err:  # noqa: BLE001
            self._finish(err)
        return super().wait(timeout)

    def is_completed(self) -> bool:
        if not self._done.is_set() and self._request.Test():
            self._complete()
        return self._done.is_set()
