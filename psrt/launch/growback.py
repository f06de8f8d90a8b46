"""Grow-back: a host that a job lost answers again, and the job widens to it at its next checkpoint.

While `mpi_launch --restarts` runs a job on fewer hosts than it was given, a thread asks the
lost hosts every PSRT_GROW_BACK_S seconds whether they answer, with the probe a restart uses
(ssh as MPI reaches a host; the emulated cluster's agent).  When one does, the thread creates a
file the ranks were told of (PSRT_GROW_FILE); rank 0 of `python -m psrt.train` looks for it after
each periodic checkpoint (psrt.train.recovery.stop_if_asked), and the job stops right there,
every rank with exit GROW_BACK_EXIT.  The launcher then starts it again on every host that
answers, from that checkpoint, which reshards to the wider job.  A grow-back is not a failure:
it does not count against --restarts.

The file is in this machine's temporary directory: rank 0 must see it, as it does on the
launcher's own host (the first of the hostfile, where mpirun puts rank 0) or on a shared one.

Under `--in-job-recovery` the ranks of a running MPI job cannot be added to (ULFM shrinks a
communicator; it does not grow one), so a host that answers again is only said in one line,
and the job goes on on the ranks it has, until Open MPI 5.0's runtime hears the host refuse
the connection of the daemon it lost there (its kernel answers with a reset), which ends the
job; with --restarts N it then starts again on every host from the last checkpoint.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
from contextlib import contextmanager
from typing import Callable

from psrt.launch.probe import survivors

IN_JOB_LINE = ("{hosts} answer(s) again: under --in-job-recovery the job cannot widen to it (ULFM adds no "
               "ranks) and goes on narrowed, until Open MPI 5's runtime hears from that host and ends the job "
               "(--restarts N then starts it again on every host from the last checkpoint)")


class Watch:
    """Asks `hosts` every `every` seconds; `on_back(names)` hears those that answer again after
    not answering (those in `down` are taken as not answering at the start).  `once`: stop
    after the first such call."""

    def __init__(self, hosts, probe, every: float, on_back: Callable[[list[str]], None],
                 down=(), once: bool = True):
        self.hosts, self.probe, self.every, self.on_back, self.once = tuple(hosts), probe, every, on_back, once
        self.answered = {h.name: h.name not in set(down) for h in self.hosts}
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="psrt-grow-back", daemon=True)

    def _run(self) -> None:
        while not self.stopped.wait(self.every):
            alive = {h.name for h in survivors(self.hosts, self.probe)}
            back = [h.name for h in self.hosts if h.name in alive and not self.answered[h.name]]
            self.answered = {h.name: h.name in alive for h in self.hosts}
            if back and not self.stopped.is_set():
                self.on_back(back)
                if self.once:
                    return

    def __enter__(self):
        if self.hosts and self.every > 0:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(timeout=30)


@contextmanager
def asking(all_hosts, running, probe, every: float, say) -> dict:
    """While a start runs on `running`, fewer hosts than `all_hosts`: the variables that tell its
    ranks where a grow-back request appears, and the watch that makes it.  Yields the ranks'
    extra environment; afterwards `asked` in it says whether the request was made."""
    lost = tuple(h for h in all_hosts if h not in running)
    state = {"env": {}, "asked": False}
    if not lost or every <= 0:
        yield state
        return
    folder = tempfile.mkdtemp(prefix="psrt-grow-back-")
    path = os.path.join(folder, "request")
    state["env"] = {"PSRT_GROW_FILE": path}

    def ask(names):
        with open(path, "w") as f:
            f.write(" ".join(names) + "\n")
        state["asked"] = True
        say(f"{', '.join(names)} answer(s) again: asking the job to stop at its next checkpoint, "
            "to start again on every host")
    try:
        with Watch(lost, probe, every, ask, down=[h.name for h in lost]):
            yield state
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def telling(hosts, probe, every: float, say) -> Watch:
    """Under --in-job-recovery: a watch that says in one line when a host answers again."""
    return Watch(hosts, probe, every, lambda names: say(IN_JOB_LINE.format(hosts=", ".join(names))), once=False)
