"""Non-blocking collectives: one worker thread per communicator runs them in call order.

MPI requires every rank to start collectives on a communicator in the same order (MPI 4.1
sec. 6.14); a single FIFO worker keeps that order, and a blocking call made while
non-blocking ones are pending queues behind them instead of overtaking.  With nothing
pending, a blocking call runs in the caller's thread (no thread hop on the latency path).
"""
from __future__ import annotations

import queue
import threading

from psrt.transport import CudaDevice


class Handle:
    """The result of a non-blocking collective; `wait()` returns it (or raises its error).

    Completion is a lock held from creation until the worker sets the result: waking the
    waiter is one lock release, cheaper than an Event's condition variable."""

    __slots__ = ("_lock", "_finished", "_result", "_error")

    def __init__(self):
        self._lock = threading.Lock()
        self._lock.acquire()
        self._finished = False
        self._result = None
        self._error: BaseException | None = None

    def _set(self, result=None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._finished = True
        self._lock.release()

    def is_completed(self) -> bool:
        return self._finished

    def wait(self, timeout: float | None = None):
        if not self._finished:
            if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
                raise TimeoutError(f"collective not finished after {timeout} s")
            self._lock.release()      # for the next waiter
        if self._error is not None:
            raise self._error
        return self._result


class Executor:
    def __init__(self, name: str = "psrt-comm"):
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()          # held while a collective runs
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._idle = threading.Condition(self._pending_lock)
        self._thread: threading.Thread | None = None
        self._cuda = CudaDevice()              # the submitters' GPU, current in the worker too

    def _worker(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args, handle = item
            result, error = None, None
            try:
                self._cuda.adopt()
                with self._lock:
                    result = fn(*args)
            except BaseException as err:  # noqa: BLE001 - handed to the waiter
                error = err
            # Idle before the waiter wakes: its next blocking call then runs at once.
            with self._idle:
                self._pending -= 1
                if not self._pending:
                    self._idle.notify_all()
            handle._set(result, error)
            # Drop this frame's references while it waits for the next call: the call's
            # closure, arguments and result (a gathered buffer, say) would otherwise stay
            # alive until then.
            item = fn = args = handle = result = error = None

    def submit(self, fn, *args) -> Handle:
        if threading.current_thread() is self._thread:
            # Submitted by what the worker runs (a completion callback issuing a collective):
            # queuing it would wait on itself, and running it now keeps every rank's order.
            handle = Handle()
            try:
                handle._set(fn(*args))
            except BaseException as err:  # noqa: BLE001 - handed to the waiter
                handle._set(error=err)
            return handle
        if self._thread is None:
            self._thread = threading.Thread(target=self._worker, name=self._name, daemon=True)
            self._thread.start()
        handle = Handle()
        self._cuda.note()
        with self._idle:
            self._pending += 1
        self._queue.put((fn, args, handle))
        return handle

    def idle(self) -> bool:
        """Nothing submitted is still pending (so a blocking call may run right away)."""
        return self._pending == 0

    def run(self, fn, *args):
        """Run fn(*args) now in this thread, after everything submitted before it."""
        with self._idle:
            while self._pending:
                self._idle.wait()
        with self._lock:
            return fn(*args)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
