"""A --callback that paces a run: each step takes 0.25 s more (a sleep, no CPU), and the lead
worker notes `STEP RANKS` after each one in CHECKPOINT.widths, so that a test sees from outside
how many ranks trained each step (tests/netns/test_growback.py)."""
import time

from psrt.train.events import Callback

PACE_S = 0.25


class Paced(Callback):
    def on_step_end(self, run, stats) -> None:
        if run.is_lead and stats is not None:
            with open(run.path("checkpoint") + ".widths", "a") as f:
                f.write(f"{run.step} {run.ctl.Get_size()}\n")
        time.sleep(PACE_S)
