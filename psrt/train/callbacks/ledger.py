"""The memory ledger: what each rank holds of every model state as the last step left it, the
activations one micro-batch keeps, and the summary's memory columns beside ZeRO's formula
(psrt.train.ledger)."""
from __future__ import annotations

from psrt.dp import memory
from psrt.train.events import Callback
from psrt.train.ledger import activations, device_of, held_by, memory_row


class MemoryLedger(Callback):

    def __init__(self):
        self.held: dict = {}

    def on_run_start(self, run) -> None:
        memory.reset_peak(device_of(run.layout))

    def on_loop_end(self, run) -> None:
        self.held = held_by(run.layout)

    def on_evaluate(self, run, model) -> None:
        if run.is_worker and run.group is not None:
            first = run.sampler.microbatches(0)[0]
            x, y = run.dataset.train_x, run.dataset.train_y
            self.held["activations"] = activations(model, lambda: run.layout.loss_fn((x[first], y[first])))

    def on_gather(self, run, mine: dict) -> None:
        mine["held"] = self.held

    def on_run_end(self, run, everyone, row) -> None:
        if row is not None:
            row.update(memory_row(run.dp, everyone, run.model, run.cfg,
                                  dp_size=run.layout.num_workers if run.group is None else None))
