"""Sends and receives of the psrt backend: MPI requests seen by torch.distributed as `Work`.

A send or a receive starts a non-blocking MPI request at once, so a paired
`batch_isend_irecv` cannot deadlock.  Each group's `Progress` thread tests the requests in
flight and completes a Work as soon as MPI completes its request: its future is done, and
what is chained on it runs, without anyone calling wait() (as with NCCL, whose futures
complete when the transfer does).  wait() tests as well, so a caller that waits sees the
completion without the thread's back-off.  A request not matched within its group's timeout
(`init_process_group(timeout=)`) fails its Work with an error naming the call, the group and the
peer, waited for or not.

CUDA: MPI touches a tensor's memory from the moment its request starts, so the stream that
is current at call time is synchronised first (what it still has to write into a send
buffer, or to read from a receive buffer, is done by then); a receive staged through host
memory is copied back on that same stream.
"""
from __future__ import annotations

import datetime
import math
import threading
import time
from typing import Callable

import torch

from psrt.c10d.work import Work, timeout_message
from psrt.collectives.p2p import FIRST_PAUSE_S, MAX_PAUSE_S, poll
from psrt.errors import PsrtError
from psrt.transport import CudaDevice


def store(flat: torch.Tensor, into: torch.Tensor) -> None:
    """Copy a result produced by `tensors.flat_view`-style tensors back into the user's tensor."""
    if flat.dtype != into.dtype:
        flat = flat.view(into.dtype)
    if flat.data_ptr() != into.data_ptr() or not into.is_contiguous():
        into.copy_(flat.view(into.shape))


def caller_stream(t: torch.Tensor, touched: bool):
    """The CUDA stream current at call time on t's device, None for a CPU tensor.  When MPI
    is to touch t's memory from now on (`touched`), what the stream has queued so far is
    done first."""
    if not t.is_cuda:
        return None
    stream = torch.cuda.current_stream(t.device)
    if touched:
        stream.synchronize()
    return stream


def copy_back(buf: torch.Tensor, into: torch.Tensor, stream) -> Callable[[], None]:
    """What a receive does once its message has landed in `buf`: copy it into the caller's
    tensor (nothing when it landed there), on the caller's stream for a CUDA tensor."""
    def run() -> None:
        if stream is None:
            store(buf, into)
            return
        with torch.cuda.stream(stream):
            store(buf.to(into.device), into)
        stream.synchronize()
    return run


class P2PWork(Work):
    """A send or receive in flight: an MPI request, completed by the group's `Progress`
    thread or by wait(), and failed after `timeout_s` without a match.

    Args:
        request: the started MPI request.
        result: the tensors the future resolves to.
        keep: the buffer MPI reads or writes (kept alive until the request is done).
        what: "send to rank 2 (tag 0) on group 0 (global ranks [0, 1, 2])": how errors name it.
        timeout_s: how long the request may stay unmatched (the group's timeout).
        landed: for a receive, run once the message is in `keep` (see `copy_back`).
    """

    def __init__(self, request, result: list, keep: torch.Tensor, what: str, timeout_s: float,
                 landed: Callable[[], None] | None = None, source: int | None = None, waits_for: str = ""):
        from mpi4py import MPI
        super().__init__(result, name=what, waits_for=waits_for)
        self._request, self._keep, self._landed = request, keep, landed
        self._sender = source            # group rank a receive is from; None for any, until it lands
        self._status = MPI.Status()
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s
        self._lock = threading.Lock()
        self._over = False             # the outcome is decided (the future may still be setting)

    def test(self) -> bool:
        """Finish the Work if its request is complete, or fail it past its deadline; whether
        it is over.  The progress thread and wait() call it, one at a time."""
        with self._lock:
            if self._over:
                return True
            error = None
            try:
                if not self._request.Test(self._status):
                    if time.monotonic() < self._deadline:
                        return False
                    self._withdraw()
                    raise TimeoutError(timeout_message(self.name, self._timeout_s, self.waits_for))
                if self._landed is not None:
                    self._sender = self._status.Get_source()
                    self._landed()
            except BaseException as err:  # noqa: BLE001 - handed to the Work, raised by wait()
                error = err
            self._over = True
        # Outside the lock: the future's callbacks run here and may test this Work again.
        self._finish(error)
        return True

    def fail(self, error: BaseException) -> None:
        """End the Work with `error` unless it is over (its group is shutting down)."""
        with self._lock:
            if self._over:
                return
            self._withdraw()
            self._over = True
        self._finish(error)

    def _withdraw(self) -> None:
        """Cancel a receive that nobody will wait for, so a late message cannot land in the
        caller's tensor (MPI 4.1 sec. 3.8.4; a send is left to complete: MPI 4 deprecates
        cancelling one)."""
        if self._landed is not None:
            self._request.Cancel()
            self._request.Wait()

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        seconds = timeout.total_seconds() if timeout else 0.0
        # Without a timeout of the caller's, the request's own deadline ends the loop.
        poll(self.test, seconds if seconds > 0 else math.inf,
             lambda: timeout_message(self.name, seconds, self.waits_for))
        return super().wait(timeout)

    def is_completed(self) -> bool:
        return self.test() and self._done.is_set()

    def _source_rank(self) -> int:
        """The group rank a completed receive came from (what `recv(src=None)` returns)."""
        if self._landed is None:
            raise RuntimeError(f"psrt backend: source_rank() of {self.name}: only a receive has a source")
        self.wait()
        return self._sender

    source_rank = _source_rank


class Progress:
    """The thread that completes a group's sends and receives as MPI completes them.

    It runs only while some request is in flight: it tests them all, then sleeps from a few
    microseconds up to a millisecond (doubling while nothing completes, as
    psrt.collectives.p2p.poll), and waits on a condition when nothing is in flight."""

    def __init__(self, name: str = "psrt-c10d-p2p"):
        self._name = name
        self._works: list[P2PWork] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._cuda = CudaDevice()       # the callers' GPU, current in this thread too

    def add(self, work: P2PWork) -> P2PWork:
        self._cuda.note()
        with self._cond:
            if self._closed:       # the group checks first; this is shutdown racing the call
                work.fail(PsrtError(f"psrt backend: {work.name} on a group that was shut down"))
                return work
            self._works.append(work)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()
        return work

    def _loop(self) -> None:
        pause = FIRST_PAUSE_S
        while True:
            with self._cond:
                while not self._works and not self._closed:
                    self._cond.wait()
                    pause = FIRST_PAUSE_S
                if self._closed:
                    return
                works = list(self._works)
            self._cuda.adopt()
            over = {id(w) for w in works if w.test()}
            if over:
                with self._cond:
                    self._works = [w for w in self._works if id(w) not in over]
                pause = FIRST_PAUSE_S
            else:
                time.sleep(pause)
                pause = min(MAX_PAUSE_S, pause * 2)

    def close(self) -> None:
        """Stop the thread; a send or receive still in flight fails, naming itself."""
        with self._cond:
            self._closed = True
            works, self._works = self._works, []
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for w in works:
            w.fail(PsrtError(f"psrt backend: {w.name} was still in flight when its group was shut down"))
