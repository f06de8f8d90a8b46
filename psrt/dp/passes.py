"""The forward and backward passes of a step, and one step over data-parallel components.

A layout (the plain loop, a pipeline schedule, a model with experts) owns its passes: a
callable `passes(microbatches, components) -> float` that runs forward and backward of this
rank's micro-batches and returns this rank's mean loss.  Layouts that run the micro-batches
one after another call each component around them (psrt.dp.base), so buckets can reduce
while backward goes on; a pipeline schedule interleaves them and calls nothing (the
components reduce everything after it).  `run_step` is the same for every layout: begin,
passes, complete, one StepStats.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable

from psrt.dp.precision import overflowed
from psrt.dp.stats import StepStats
from psrt.errors import PsrtError
from psrt.trace import OFF


def local(loss_fn: Callable, tracer=OFF, ready: Callable[[], None] | None = None):
    """The plain loop: micro-batch after micro-batch, forward then backward of `loss_fn(mb)`
    (a scalar mean loss), each divided by the number of micro-batches so the accumulated
    gradient is that of this rank's mean loss (equal micro-batches).  `ready()` runs once
    before the first forward (a layout's per-step set-up)."""
    def passes(microbatches: list, components: list) -> float:
        n, total = len(microbatches), 0.0
        if ready is not None:
            ready()
        for k, mb in enumerate(microbatches):
            with contextlib.ExitStack() as stack:
                for c in components:
                    stack.enter_context(c.microbatch(k))
                with tracer.span("forward", "compute", microbatch=k):
                    loss = loss_fn(mb)
                total += float(loss.detach())
                for c in components:
                    c.before_backward(k, total / n)
                with tracer.span("backward", "compute", microbatch=k):
                    (loss / n).backward()
        return total / n
    return passes


def run_step(components: list, passes, microbatches: list, scaler=None) -> StepStats:
    """One optimizer step: every component begins, the passes run, every component
    completes, in the same order on every rank.  The loss is the first component's (the
    global mean where it has it); times and bytes add up.  With fp16's `scaler` and several
    components (dense and expert parameters), one overflow decision covers them all: taken
    from every rank's local gradients before any of them updates (LossScaler.decide)."""
    if not microbatches:
        raise PsrtError("step() needs at least one micro-batch")
    start = time.perf_counter()
    for c in components:
        c.begin(len(microbatches))
    local_loss = passes(microbatches, components)
    joint = scaler is not None and len(components) > 1
    if joint:
        scaler.decide(overflowed([p.grad for c in components for p in c.params if p.grad is not None]))
    results = [c.complete(local_loss) for c in components]
    if joint:
        scaler.settle()
    elapsed = time.perf_counter() - start
    comm = sum(r.comm_s for r in results)
    extra = {}
    for r in reversed(results):
        extra.update(r.extra)
    return StepStats(loss=results[0].loss, compute_s=elapsed - comm, comm_s=comm,
                     bytes_sent=sum(r.bytes_sent for r in results), extra=extra)
