"""Stall detection: say which rank is stuck where, then end the job instead of hanging.

Every rank runs a watchdog thread that, once per `interval`, sends a small heartbeat to
every other rank on a communicator of its own: the collective call it is in (and for how
long) or the last one it finished, and the training step.  A rank's heartbeats keep
flowing while its main thread waits inside MPI (mpi4py releases the GIL there), so a stuck
rank 0 is seen like any other.  When some rank has waited in one collective for longer than
`timeout_s`, or a rank has not been heard from for that long, the lowest-numbered rank still
heard from prints one report naming every rank's position and aborts the job (MPI_Abort),
so mpirun exits non-zero on every host.

The timeout comes from the argument, else PSRT_TIMEOUT (seconds), else 300 s (psrt.env).
"""
from __future__ import annotations

import sys
import threading
import time

from psrt import env
from psrt.errors import PsrtError, abort

TAG = 7717


class Watchdog:
    """Watch the Communicators of this rank.

    Args:
        world: the `World` (its comm is Dup'ed for heartbeats).
        groups: psrt Communicators whose `state` (call number, name, start) is watched; more can be
            added with `watch()`.
        timeout_s: seconds a collective may wait, or a rank may stay silent, before the job
            ends (default PSRT_TIMEOUT).
        interval: seconds between heartbeats.
        on_stall: called with the report instead of aborting (for tests and embedding).
    """

    def __init__(self, world, groups=(), timeout_s: float | None = None, interval: float = 2.0,
                 on_stall=None):
        self.world = world
        self.timeout_s = env.timeout_s() if timeout_s is None else timeout_s
        if not self.timeout_s > 0:
            raise PsrtError(f"watchdog timeout_s must be positive, got {self.timeout_s}", everywhere=True)
        self.interval = min(interval, self.timeout_s / 4)
        self.on_stall = on_stall
        self._groups = list(groups)
        self._step = 0
        self._comm = world.comm.Dup()
        # Every rank's host, known from the start: a rank lost before its first heartbeat
        # (its node died while it was starting) is still named with its host.
        self._hosts = self._comm.allgather(world.hostname)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._heard: dict[int, tuple[float, dict]] = {}
        self._sends: list = []          # heartbeat requests in flight (they own their buffers)
        self.report: str | None = None

    # ------------------------------------------------------------ user side
    def watch(self, group) -> None:
        self._groups.append(group)

    def step(self, step: int) -> None:
        """Mark the training step this rank is on (shown in reports)."""
        self._step = step

    def start(self) -> "Watchdog":
        self._thread = threading.Thread(target=self._loop, name="psrt-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        from mpi4py import MPI
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        MPI.Request.Waitall(self._sends)
        self._comm.Barrier()   # nobody stops sending while a peer still counts on hearing it
        self._drain()
        self._comm.Free()

    def __enter__(self) -> "Watchdog":
        return self.start()

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.stop()

    # ------------------------------------------------------------ thread side
    def _state(self) -> dict:
        """This rank's position: the longest-running call in progress, else the latest one."""
        now = time.monotonic()
        busy = [(c.state, c) for c in self._groups if c.state[2] is not None]
        if busy:
            (seq, name, start), _ = min(busy, key=lambda b: b[0][2])
            return {"call": seq, "name": name, "waiting": now - start, "step": self._step}
        latest = max((c.state for c in self._groups), default=(0, "", None))
        return {"call": latest[0], "name": latest[1], "waiting": None, "step": self._step}

    def _drain(self) -> None:
        from mpi4py import MPI
        status = MPI.Status()
        while self._comm.iprobe(source=MPI.ANY_SOURCE, tag=TAG, status=status):
            msg = self._comm.recv(source=status.Get_source(), tag=TAG)
            self._heard[status.Get_source()] = (time.monotonic(), msg)
        self._sends = [r for r in self._sends if not r.Test()]

    def _loop(self) -> None:
        me, n = self._comm.Get_rank(), self._comm.Get_size()
        started = time.monotonic()
        while not self._stop.wait(self.interval):
            state = self._state()
            self._heard[me] = (time.monotonic(), state)
            for peer in range(n):
                if peer != me:
                    self._sends.append(self._comm.isend(state, dest=peer, tag=TAG))
            self._drain()
            report = self._check(me, n, started)
            if report is not None:
                self.report = report
                if self.on_stall is not None:
                    self.on_stall(report)
                    return
                print(report, file=sys.stderr, flush=True)
                abort(3)
                return

    def _check(self, me: int, n: int, started: float) -> str | None:
        now = time.monotonic()
        silent = [r for r in range(n)
                  if now - self._heard.get(r, (started, None))[0] > self.timeout_s]
        stalled = [r for r, (_, s) in self._heard.items()
                   if s and s["waiting"] is not None and s["waiting"] > self.timeout_s]
        if not silent and not stalled:
            return None
        alive = [r for r in range(n) if r not in silent]
        if not alive or me != min(alive):
            return None   # the lowest rank still heard from speaks for everyone
        return self._format(n, now, silent, stalled)

    def _format(self, n: int, now: float, silent: list[int], stalled: list[int]) -> str:
        front = max((self._heard[r][1]["call"] for r in stalled), default=0)
        lines = [f"psrt: watchdog: no progress for {self.timeout_s:g} s (PSRT_TIMEOUT); aborting the job"]
        for r in range(n):
            seen, s = self._heard.get(r, (None, None))
            if r in silent or s is None:
                ago = f"{now - seen:.0f} s" if seen else "ever"
                lines.append(f"  rank {r} ({self._hosts[r]}): not heard from for {ago}: dead, or frozen without releasing the GIL")
            elif s["waiting"] is not None:
                lines.append(f"  rank {r} ({self._hosts[r]}): waiting in {s['name']} call #{s['call']} for "
                             f"{s['waiting']:.0f} s (step {s['step']})")
            else:
                behind = f": has not reached call #{front}" if s["call"] < front else ""
                lines.append(f"  rank {r} ({self._hosts[r]}): running its own code after {s['name'] or 'no'} call "
                             f"#{s['call']} (step {s['step']}){behind}")
        return "\n".join(lines)
