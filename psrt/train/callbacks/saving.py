"""--save: the trained one-process model's parameters (a state_dict that loads into the model
psrt.train builds on one process), written atomically by the lead worker."""
from __future__ import annotations

from psrt.train.checkpoint import atomic_save
from psrt.train.events import Callback


class SaveModel(Callback):

    def on_run_end(self, run, everyone, row) -> None:
        if row is not None and run.cfg.save:
            atomic_save({k: v.cpu() for k, v in run.model.state_dict().items()}, run.path("save"))
