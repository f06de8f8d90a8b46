"""`Work`: how a psrt collective reports back to torch.distributed.

torch.distributed hands every collective's result back as a `Work` whose `wait()` blocks until
it is done and whose `get_future()` feeds DDP's reducer, comm hooks and functional
collectives.  A failure has to reach all of them: `wait()` raises the error in the caller, and
the future is completed with the error, so `future.wait()` and `future.value()` raise it too
(DDP's reducer reads the value, so a failed bucket surfaces in `loss.backward()`).
"""
from __future__ import annotations

import datetime
import threading

import torch
import torch.distributed as dist


def timeout_message(what: str, seconds: float, waits_for: str) -> str:
    """The error of a call that did not finish within its group's timeout.  "Timed out" is the
    wording torch's own backends use (ProcessGroupGloo), which callers match on."""
    return (f"psrt backend: {what}: Timed out after {seconds:g} s waiting for {waits_for or 'its peers'} "
            "(the timeout= of the group, or of the call)")


class _Failed:
    """The value of a source future whose collective failed."""

    def __init__(self, error: BaseException):
        self.error = error if isinstance(error, Exception) else RuntimeError(str(error))


def _unwrap(source: torch.futures.Future):
    value = source.value()
    if isinstance(value, _Failed):
        raise value.error
    return value


class Work(dist.Work):
    """One collective in flight on a psrt process group."""

    def __init__(self, result: list, timeout: datetime.timedelta | None = None, name: str = "collective",
                 waits_for: str = "", on_timeout=None):
        super().__init__()
        self._on_timeout = on_timeout          # told when wait() gives up (the call may be wedged)
        self.name = name                      # "allreduce on group 0 (global ranks [0, 1, 2])"
        self.waits_for = waits_for            # "ranks [1, 2]": whom a timeout names
        self._timeout = timeout               # the group's: wait() without one waits this long
        self._result = result                 # the tensors the future resolves to
        # A Python future completed with set_exception holds the exception as its *value*:
        # C++ readers (DDP's reducer) take that for success and crash on it.  An exception
        # raised inside a `then` callback is a real error of the child future in C++ too, so
        # the future handed out is a child that re-raises a failure.
        self._source = torch.futures.Future()
        self._future = self._source.then(_unwrap)
        self._done = threading.Event()
        self._error: BaseException | None = None

    # ---------------------------------------------------------- completion (worker thread)
    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        # The future first: whoever wait() releases may read the future's value at once.
        self._source.set_result(self._result if error is None else _Failed(error))
        self._done.set()

    # ---------------------------------------------------------- dist.Work
    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        seconds = (timeout or self._timeout or datetime.timedelta(0)).total_seconds()
        if not self._done.wait(seconds if seconds > 0 else None):
            if self._on_timeout is not None:
                self._on_timeout(self.name)
            raise TimeoutError(timeout_message(self.name, seconds, self.waits_for))
        if self._error is not None:
            raise self._error
        return True

    def synchronize(self) -> None:
        self.wait()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self):
        return self._error

    def result(self) -> list:
        self.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        return self._future

