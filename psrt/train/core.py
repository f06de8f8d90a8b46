"""The loop core of psrt.train: batches through the layout's step, events to the components.

Workers step through their share of each global batch; a dedicated parameter server serves
up to each boundary some component asked for (a checkpoint every rank joins), which is its
"step".  Everything else is a component on psrt.train.events' events (psrt/train/callbacks/),
so that a new concern is a new component, not another branch here.
"""
from __future__ import annotations

import time

from psrt import faults
from psrt.train.events import Events


def train(run, events: Events) -> dict | None:
    """Run `run` (a psrt.train.state.RunState) to its end; the summary row on the lead
    worker, None elsewhere."""
    start = events.resume(run)
    run.start = run.step = start or 0
    run.resumed = start is not None
    events.emit("on_run_start", run)
    run.ctl.Barrier()
    run.t0 = time.perf_counter()
    if run.is_worker:
        work(run, events)
    else:
        serve(run, events)
    events.emit("on_loop_end", run)
    run.layout.finish()
    run.wall = time.perf_counter() - run.t0
    run.model = run.layout.whole()   # the one-process model: every rank of a plain run, rank 0 of a grid
    events.emit("on_evaluate", run, run.model)
    mine: dict = {}
    events.emit("on_gather", run, mine)
    faults.strike_if_asked("gather", run.total)
    everyone = run.ctl.gather(mine, root=run.lead)
    row = {} if run.is_lead else None
    events.emit("on_run_end", run, everyone, row)
    return row


def work(run, events: Events) -> None:
    """A worker's steps, from run.step to run.total."""
    while run.step < run.total:
        batches = run.microbatches()
        faults.kill_if_asked(run.step + 1)
        faults.strike_if_asked("step", run.step + 1)
        try:
            with run.stepping():
                stats = run.layout.step(batches)
        except Exception as err:
            if not events.recovered(run, err):
                raise
            events.emit("on_recovered", run)
            continue
        run.step += 1
        run.notes = {}
        events.emit("on_step_end", run, stats)


def serve(run, events: Events) -> None:
    """A dedicated server: serve up to each boundary, join it, and serve on to the end."""
    for at in events.boundaries(run):
        run.layout.serve(rounds=at - run.step)
        run.step = at
        run.notes = {}
        events.emit("on_step_end", run, None)
    run.layout.serve()
