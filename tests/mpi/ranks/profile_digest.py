"""A --callback for the emulated-compute tests (tests/mpi/test_profile_runs.py): after each
strategy's run, every rank prints its parameters and, where the model is a profile's or is
timed by one, when each gradient appeared in the last backward (the Clock's log)."""
import hashlib
import json

import torch
from mpi4py import MPI

from psrt.train.events import Callback


class Digest(Callback):
    def on_evaluate(self, run, model) -> None:
        flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
        clock = getattr(model, "emulation_clock", None)
        # a short line: mpirun cuts long ones and interleaves the ranks' output
        wide = flat.double()
        ramp = torch.linspace(0.0, 1.0, flat.numel(), dtype=torch.float64)
        print("PSRT-RESULT " + json.dumps({
            "rank": MPI.COMM_WORLD.rank, "dp": run.dp, "profile": run.cfg.profile,
            "worker": run.is_worker, "digest": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
            "sums": [float(wide.sum()), float((wide * wide).sum()), float((wide * ramp).sum())],
            "numel": flat.numel(),
            "log": clock.log if clock is not None else None}), flush=True)
