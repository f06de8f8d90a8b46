"""--save: the trained one-process model's parameters (a state_dict that loads into the model
psrt.train builds on one process), written atomically by the lead worker.

A save that fails after the whole run (a full disk, a directory gone read-only) must not lose
the run: the parameters go to the system's temporary directory instead, and the one-line
error names both paths."""
from __future__ import annotations

import os
import tempfile

from psrt.errors import PsrtError
from psrt.train.checkpoint import atomic_save
from psrt.train.events import Callback


class SaveModel(Callback):

    def on_run_end(self, run, everyone, row) -> None:
        if row is not None and run.cfg.save:
            save(run.model, run.path("save"))


def save(model, path: str) -> None:
    """`model`'s parameters to `path`; when that fails, to a file of the temporary directory,
    and a PsrtError that names both."""
    state = {k: v.cpu() for k, v in model.state_dict().items()}
    try:
        atomic_save(state, path)
        return
    except OSError as err:
        why = err.strerror or str(err)
    fd, spare = tempfile.mkstemp(prefix="psrt-save-", suffix=".pt")
    os.close(fd)
    try:
        atomic_save(state, spare)
    except OSError as err:
        os.unlink(spare)
        raise PsrtError(f"--save {path}: cannot write it ({why}), nor {spare} ({err.strerror or err}): "
                        "the trained parameters are lost") from None
    raise PsrtError(f"--save {path}: cannot write it ({why}); the trained parameters are in {spare}")
