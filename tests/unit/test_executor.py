"""The worker behind non-blocking calls (psrt/collectives/executor.py): call order, and a
submission made by a job the worker runs (a future's callback issuing a collective)."""
import threading

from psrt.collectives.executor import Executor


def test_jobs_run_in_submission_order_on_one_thread():
    ex, seen = Executor(), []
    handles = [ex.submit(lambda i=i: seen.append((i, threading.current_thread().name)) or i) for i in range(5)]
    assert [h.wait(5) for h in handles] == list(range(5))
    assert [i for i, _ in seen] == list(range(5)) and {n for _, n in seen} == {"psrt-comm"}
    ex.close()


def test_a_job_that_submits_runs_the_inner_job_at_once_instead_of_waiting_on_itself():
    ex, order = Executor(), []

    def outer():
        inner = ex.submit(lambda: order.append("inner") or "done")
        assert inner.is_completed()           # ran in line, on this worker
        order.append("outer")
        return inner.wait(0)

    assert ex.submit(outer).wait(5) == "done"
    assert order == ["inner", "outer"]
    ex.close()


def test_another_executors_worker_still_queues():
    a, b = Executor("a"), Executor("b")
    gate = threading.Event()
    first = b.submit(gate.wait)
    # a job on a's worker submits to b: it must queue behind b's first job, not jump it
    second = a.submit(lambda: b.submit(lambda: "b2")).wait(5)
    assert not second.is_completed()
    gate.set()
    assert first.wait(5) and second.wait(5) == "b2"
    a.close()
    b.close()


def test_the_worker_makes_the_submitters_gpu_current(monkeypatch):
    """A CUDA-aware MPI needs a current CUDA context in the thread that calls it: the worker
    adopts the device of the thread that submitted, once CUDA is in use, and only then."""
    import threading

    import torch

    from psrt.collectives.executor import Executor
    made_current = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: made_current.append((i, threading.current_thread().name)))
    ex = Executor(name="psrt-test-worker")
    try:
        ex.submit(lambda: None).wait()
        assert made_current == []                       # no CUDA in use: nothing made current
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
        ex.submit(lambda: None).wait()
        ex.submit(lambda: None).wait()
        assert made_current == [(3, "psrt-test-worker")]  # once, in the worker
    finally:
        ex.close()
