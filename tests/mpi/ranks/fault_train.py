"""Rank-side: `python -m psrt.train` in which one worker dies at a given step.

    fault_train.py MODE WORKER STEP HOOK [TAG] -- TRAIN ARGS...
MODE raise (RuntimeError inside the strategy's step) or kill (SIGKILL).  WORKER is the
strategy's worker rank that dies (0-based, servers excluded), before its step STEP (1-based).
HOOK 1 installs psrt.faults before training.
"""
import os
import signal
import sys
import time

from psrt.train import __main__ as train
from psrt.dp import STRATEGIES, strategy_class

mode, victim, at, hook = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
argv = sys.argv[sys.argv.index("--") + 1:]
if hook:
    from psrt import faults
    faults.install("psrt.train")

for name in STRATEGIES:
    if name == "horovod":
        continue
    cls = strategy_class(name)
    if getattr(cls.step, "_faulty", False):
        continue
    original = cls.step

    def step(self, loss_fn, microbatches, _original=original):
        self._fault_steps = getattr(self, "_fault_steps", 0) + 1
        if self.worker_rank == victim and self._fault_steps == at:
            print("PSRT-RESULT {\"fault_at\": %r}" % time.time(), flush=True)
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected failure on worker {victim} at step {at}")
        return _original(self, loss_fn, microbatches)
    step._faulty = True
    cls.step = step

sys.exit(train.main(argv))
