"""Training that carries on after `mpi_launch --restarts` started it again on the survivors.

The launcher says so in the environment (psrt.env.restarts()).  On a restart the run
continues from its last complete --checkpoint; the global batch and the data order depend on
the step alone (data.ShardedSampler), and every strategy's state reshards to the new number
of workers on load, so the run computes the same training as one that never failed.

With restarts allowed and no --checkpoint-every, a checkpoint is written every twentieth of
the run (at most 5% of it is computed twice after a failure).  The lead worker notes each
finished step next to the checkpoint (FILE.step, a few bytes, not synced: it only tells how
many steps a failure cost), and on the first step after a restart prints what the recovery
cost: the steps done again and the time from the failure to that step.

While the job runs on fewer hosts than it was given, the launcher may ask it to stop at its
next checkpoint, for a host that answers again (a grow-back: psrt/launch/growback.py):
`stop_if_asked` after each periodic checkpoint.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time

from psrt import env
from psrt.errors import GROW_BACK_EXIT

SHARE = 20      # checkpoints per run when restarts are allowed and no --checkpoint-every is given


def interval(checkpoint: str | None, every: int, total: int) -> int:
    """Steps between checkpoints: --checkpoint-every, else every twentieth of the run when a
    restart or an in-job recovery may read it back, else 0 (only the final one)."""
    if every or not checkpoint:
        return every
    allowed = env.restarts()[0]
    return max(1, total // SHARE) if allowed or env.in_job_recovery() else 0


class Recovery:
    """What a run does about restarts: when to checkpoint, whether to resume, what to say."""

    def __init__(self, checkpoint: str | None, every: int, total: int, lead: bool, quiet: bool = False):
        self.allowed, self.count, self.failed_at = env.restarts()
        self.path = checkpoint
        self.every = interval(checkpoint, every, total)
        self.lead, self.quiet = lead, quiet
        self.reached: int | None = None   # the last step finished before the failure
        self._pending = False

    def resume(self, asked: bool, ctl) -> bool:
        """--resume, or a restart with a checkpoint there (rank 0 writes it: it decides)."""
        if asked or not self.count or not self.path:
            return asked
        found = ctl.bcast(os.path.exists(self.path) if ctl.rank == 0 else None, root=0)
        if self.lead or ctl.rank == 0:
            try:
                with open(self.path + ".step") as f:
                    self.reached = int(f.read().strip() or 0)
            except (OSError, ValueError):
                self.reached = None
        return bool(found)

    def started(self, start: int, label: str) -> None:
        """Say where a restart continues from (the lead worker; even with --quiet)."""
        if not self.count:
            return
        self._pending = True
        if self.lead:
            lost = f"; steps {start + 1}-{self.reached} are done again" if self.reached and self.reached > start else ""
            print(f"psrt.train: restart {self.count}: {label} continues from step {start}{lost}",
                  file=sys.stderr, flush=True)

    def step_done(self, step: int) -> dict:
        """After each finished step: note it, and on the first one after a restart say how long
        the recovery took.  Returns what the metrics row adds."""
        if self.lead and self.allowed and self.path:
            _note(self.path + ".step", str(step))
        if not self._pending:
            return {}
        self._pending = False
        extra = {"restart": self.count, "unix_time": round(time.time(), 3)}
        if self.failed_at is not None:
            extra["recovery_s"] = round(time.time() - self.failed_at, 3)
            if self.lead:
                print(f"psrt.train: restart {self.count}: step {step} done {extra['recovery_s']:.1f} s "
                      "after the failure was seen", file=sys.stderr, flush=True)
        if self.reached is not None:
            extra["steps_lost"] = max(0, self.reached - (step - 1))
        return extra


def _note(path: str, text: str) -> None:
    """Write a small note so that a reader, or a restart after this host is lost mid-write,
    finds the old text or the new one, never an empty file: a new file renamed over the old
    (rename(2) is atomic).  On a full disk, where no new file fits, the note is rewritten in
    place (its block is already there), or left as it was: the checkpoint's own write is what
    reports the full disk (exit 4, naming the checkpoint)."""
    try:
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        with contextlib.suppress(OSError), open(path, "w") as f:
            f.write(text)


def stop_if_asked(ctl, step: int, lead: bool) -> None:
    """After the checkpoint of `step`: end every rank with exit GROW_BACK_EXIT when the launcher
    asked for a grow-back (rank 0 looks for its file, PSRT_GROW_FILE, and tells the others)."""
    path = env.grow_file()
    if not path or not ctl.bcast(os.path.exists(path) if ctl.rank == 0 else None, root=0):
        return
    if lead:
        print(f"psrt.train: stopping after the checkpoint of step {step}: a lost host answers again, "
              "and the job starts again on every host from there", file=sys.stderr, flush=True)
    ctl.Barrier()       # every rank has seen the request before any leaves
    raise SystemExit(GROW_BACK_EXIT)
