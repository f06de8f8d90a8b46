"""Stall detection: say which rank is stuck where, then end the job instead of hanging.

Every rank runs a watchdog thread that, once per `interval`, sends a small heartbeat to
every other rank on a communicator of its own: the collective call it is in (and for how
long) or the last one it finished, and the training step.  A rank's heartbeats keep
flowing while its main thread waits inside MPI (mpi4py releases the GIL there), so a stuck
rank 0 is seen like any other.  When some rank has waited in one collective for longer than
`timeout_s`, or a rank has not been heard from for that long (SILENT_S, at most `timeout_s`,
for a rank heard from before: its host may be lost), the lowest-numbered rank still
heard from prints one report naming every rank's position and aborts the job (MPI_Abort),
so mpirun exits non-zero on every host.

`psrt.init()` starts one per process (timeout PSRT_TIMEOUT), and every psrt Communicator
made on its ranks is watched by it (`running_for`): a bare Communicator, the group of
`psrt.data_parallel`, the torch.distributed backend's groups and psrt.train's all are, with
nothing to call.

A rank that shuts down (`stop()`: torch.distributed's destroy_process_group, the end of a
`with Watchdog(...)`, MPI_Finalize, or the interpreter's exit, `sys.exit(0)` in the middle of
a training loop included) tells every other rank so with a last heartbeat.  A rank waiting
in a call of a group with that rank in it does not wait for the timeout when it hears that:
after LEFT_GRACE_S (the peer may have finished its part of this very call just before
leaving) it prints one line naming the call it waits in and the rank that left, and ends
the job.  A
rank's `stop()` returns once every rank has stopped, or the job ends through the others.

The timeout comes from the argument, else PSRT_TIMEOUT (seconds), else 300 s (psrt.env).
"""
from __future__ import annotations

import atexit
import dataclasses
import sys
import threading
import time
import weakref

from psrt import env
from psrt.errors import PsrtError, abort, launcher_rank, write_line
from psrt.world import init as init_world
from psrt.world import lost_peer, revoke

TAG = 7717
LEFT_GRACE_S = 1.0      # how long a call may still wait after a peer left before it is stuck
# A rank heard from before and silent this long (or PSRT_TIMEOUT, if shorter) is taken for
# dead: its heartbeats come from a thread of their own every `interval`, so 30 missed ones
# mean a lost process or host, not a slow step.  Ranks never heard from get PSRT_TIMEOUT
# (a crowded host may take long to start them).
SILENT_S = 30.0


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

    def __init__(self, world, groups=(), timeout_s: float | None = None, interval: float = 1.0,
                 on_stall=None):
        self.world = world
        self._every = interval
        self.retime(env.timeout_s() if timeout_s is None else timeout_s)
        self.on_stall = on_stall
        # Weak: a Communicator the program dropped is no longer watched, and is not kept
        # alive by the watchdog of a long job that makes many.
        self._groups: list[weakref.ref] = []
        for group in groups:
            self.watch(group)
        self._step = 0
        self._comm = world.comm.Dup()
        # Every rank's host, known from the start: a rank lost before its first heartbeat
        # (its node died while it was starting) is still named with its host.
        self._hosts = self._comm.allgather(world.hostname)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._heard: dict[int, tuple[float, dict]] = {}
        self._sends: list = []          # heartbeat requests in flight (they own their buffers)
        self._left = False
        self._keyval = None             # MPI_COMM_SELF's attribute that calls stop() at MPI_Finalize
        self.report: str | None = None

    # ------------------------------------------------------------ user side
    def watch(self, group) -> None:
        """Watch `group` too (once, however often it is given)."""
        if not any(ref() is group for ref in self._groups):
            self._groups = [ref for ref in self._groups if ref() is not None] + [weakref.ref(group)]

    def groups(self) -> list:
        """The Communicators watched now."""
        return [g for g in (ref() for ref in self._groups) if g is not None]

    def retime(self, timeout_s: float) -> None:
        """Set the timeout (psrt.train's --timeout on the world's watchdog)."""
        if not timeout_s > 0:
            raise PsrtError(f"watchdog timeout_s must be positive, got {timeout_s}", everywhere=True)
        self.timeout_s = timeout_s
        self.interval = min(self._every, timeout_s / 4)

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def covers(self, comm) -> bool:
        """Whether every process of the MPI communicator `comm` is one of this watchdog's."""
        from mpi4py import MPI
        mine, theirs = self._comm.Get_group(), comm.Get_group()
        try:
            return MPI.UNDEFINED not in MPI.Group.Translate_ranks(theirs, list(range(theirs.Get_size())), mine)
        finally:
            mine.Free()
            theirs.Free()

    def step(self, step: int) -> None:
        """Mark the training step this rank is on (shown in reports)."""
        self._step = step

    def start(self) -> "Watchdog":
        from mpi4py import MPI
        self._thread = _Thread(self)
        self._thread.start()
        # A program that ends without stop() still tells the others: sys.exit(0) on one rank
        # in the middle of a loop must not leave the others waiting for it.  mpi4py's own
        # exit handler, MPI_Finalize, runs after Python's atexit handlers; a program that
        # calls MPI.Finalize() itself first deletes MPI_COMM_SELF's attributes, which stops
        # this watchdog (MPI 4.1 sec. 11.2.4) before its thread could send after MPI ended.
        atexit.register(self._at_exit)
        self._keyval = MPI.Comm.Create_keyval(delete_fn=self._at_finalize)
        MPI.COMM_SELF.Set_attr(self._keyval, True)
        return self

    def stop(self) -> None:
        """Tell every rank this one has shut down, and return when all have (a rank still
        waiting for this one in a call ends the job instead: see the module's docstring)."""
        from mpi4py import MPI
        atexit.unregister(self._at_exit)
        self._forget_finalize()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._left:
            return
        self._left = True
        me, n = self._comm.Get_rank(), self._comm.Get_size()
        last = dict(self._state(), left=True)
        self._sends += [self._comm.isend(last, dest=peer, tag=TAG) for peer in range(n) if peer != me]
        # Until every peer has said it left: nobody stops listening while a peer may still
        # count on hearing it; polled with back-off, not a busy MPI_Barrier.
        pause = 1e-4
        while True:
            self._drain()
            if all(self._has_left(r) for r in range(n) if r != me):
                break
            time.sleep(pause)
            pause = min(0.02, pause * 2)
        MPI.Request.Waitall(self._sends)
        self._comm.Free()

    def _at_exit(self) -> None:
        from mpi4py import MPI
        if MPI.Is_initialized() and not MPI.Is_finalized():
            self.stop()

    def _at_finalize(self, comm, keyval, value) -> None:
        """MPI_Finalize (or stop()) deletes the attribute: say farewell while MPI still runs."""
        if self._keyval is not None:
            self._keyval = None
            self.stop()

    def _forget_finalize(self) -> None:
        """Drop the MPI_COMM_SELF attribute (without calling stop() again)."""
        from mpi4py import MPI
        keyval, self._keyval = self._keyval, None
        if keyval is not None and MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.COMM_SELF.Delete_attr(keyval)
            MPI.Comm.Free_keyval(keyval)

    def left(self, comm, ranks: list[int]) -> list[int]:
        """Those of `ranks` (ranks of the MPI communicator `comm`) heard leaving the job more
        than LEFT_GRACE_S ago: whatever they sent before leaving has landed by then, so a wait
        for them (a parameter server's for a worker's gradient) will not end."""
        from mpi4py import MPI
        if not ranks:
            return []
        theirs, mine = comm.Get_group(), self._comm.Get_group()
        try:
            mapped = MPI.Group.Translate_ranks(theirs, list(ranks), mine)
        finally:
            theirs.Free()
            mine.Free()
        now = time.monotonic()
        return [r for r, m in zip(ranks, mapped)
                if m != MPI.UNDEFINED and self._has_left(m) and now - self._heard[m][0] > LEFT_GRACE_S]

    def _has_left(self, rank: int) -> bool:
        heard = self._heard.get(rank)
        return bool(heard and heard[1] and heard[1].get("left"))

    def __enter__(self) -> "Watchdog":
        return self.start()

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.stop()

    # ------------------------------------------------------------ thread side
    def _state(self) -> dict:
        """This rank's position: the longest-running call in progress, else the latest one."""
        now = time.monotonic()
        groups = self.groups()
        busy = [(c.state, c) for c in groups if c.state[2] is not None]
        if busy:
            (seq, name, start), group = min(busy, key=lambda b: b[0][2])
            return {"call": seq, "name": name, "waiting": now - start, "step": self._step,
                    "group": _describe(group)}
        latest = max((c.state for c in groups), default=(0, "", None))
        return {"call": latest[0], "name": latest[1], "waiting": None, "step": self._step}

    def _drain(self) -> None:
        from mpi4py import MPI
        status = MPI.Status()
        while self._comm.iprobe(source=MPI.ANY_SOURCE, tag=TAG, status=status):
            msg = self._comm.recv(source=status.Get_source(), tag=TAG)
            self._heard[status.Get_source()] = (time.monotonic(), msg)
        self._sends = [r for r in self._sends if not r.Test()]

    def abandon(self) -> None:
        """After a lost rank (ULFM, psrt.train.in_job): stop this watchdog without the farewell
        that `stop()` waits for, which a dead rank would never answer; its communicator is
        revoked and left.  The survivors then start a new one on their shrunk world."""
        atexit.unregister(self._at_exit)
        self._forget_finalize()
        self._stop.set()
        self._left = True
        revoke(self._comm)
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        try:
            self._beat()
        except Exception as err:
            # A dead peer under ULFM: the training thread sees it too, and recovers or ends the job.
            if lost_peer(err) is None:
                raise

    def _beat(self) -> None:
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
                write_line(report)
                abort(3)
                return

    def _check(self, me: int, n: int, started: float) -> str | None:
        now = time.monotonic()
        left = [r for r in range(n) if self._has_left(r)]
        mine = self._heard[me][1]
        if left and mine["waiting"] is not None and mine["waiting"] > LEFT_GRACE_S:
            # Only those of the group it waits in: a rank may well leave once it is done
            # while others go on in a group without it.
            among = self._members_waited_on(left)
            if among:
                return self._format_left(me, among, mine)
        silent = [r for r in range(n) if r not in left and now - self._heard.get(r, (started, None))[0]
                  > (min(SILENT_S, self.timeout_s) if r in self._heard else self.timeout_s)]
        stalled = [r for r, (_, s) in self._heard.items()
                   if s and s["waiting"] is not None and s["waiting"] > self.timeout_s]
        if not silent and not stalled:
            return None
        alive = [r for r in range(n) if r not in silent]
        if not alive or me != min(alive):
            return None   # the lowest rank still heard from speaks for everyone
        return self._format(n, now, silent, stalled)

    def _members_waited_on(self, left: list[int]) -> list[int]:
        """Those of `left` (this watchdog's ranks) in the group of the call this rank has
        waited in longest (all of them where that cannot be told)."""
        from mpi4py import MPI
        busy = [c for c in self.groups() if c.state[2] is not None]
        if not busy:
            return left
        group = min(busy, key=lambda c: c.state[2] or 0.0)
        try:
            theirs, mine = group.comm.Get_group(), self._comm.Get_group()
            try:
                members = set(MPI.Group.Translate_ranks(theirs, list(range(theirs.Get_size())), mine))
            finally:
                theirs.Free()
                mine.Free()
        except Exception:  # noqa: BLE001 - closed as it was looked at: take every rank that left
            return left
        return [r for r in left if r in members]

    def _format_left(self, me: int, left: list[int], mine: dict) -> str:
        """One line: the call this rank waits in and the ranks that shut down without it."""
        who = "; ".join(f"rank {r} ({self._hosts[r]}) shut down after its "
                        f"{self._heard[r][1]['name'] or 'no'} call #{self._heard[r][1]['call']}"
                        for r in left)
        prefix = f"[rank {launcher_rank()}] " if launcher_rank() is not None else ""
        return (f"{prefix}psrt: error: rank {me} waits in {mine['name']} call #{mine['call']} "
                f"(on {mine['group']}) for ranks that left: {who}; every rank of a group must make "
                "the same collective calls before it shuts down")

    def _format(self, n: int, now: float, silent: list[int], stalled: list[int]) -> str:
        front = max((self._heard[r][1]["call"] for r in stalled), default=0)
        lines = [f"psrt: watchdog: no progress for {self.timeout_s:g} s (PSRT_TIMEOUT); aborting the job"
                 if stalled or not silent else
                 f"psrt: watchdog: rank(s) {', '.join(map(str, silent))} silent for "
                 f"{min(SILENT_S, self.timeout_s):g} s, lost; aborting the job"]
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


class _Thread(threading.Thread):
    """A watchdog's thread, which knows its watchdog: what `running_for` finds."""

    def __init__(self, dog: Watchdog):
        super().__init__(target=dog._loop, name="psrt-watchdog", daemon=True)
        self.watchdog = dog


def init(comm=None, export_env: bool = True, watchdog: bool = True):
    """psrt.init: MPI started and this process described (psrt.world.init), and with more than
    one rank a Watchdog (PSRT_TIMEOUT) that every Communicator made on these ranks reports
    to, unless one already runs for them (a second init() shares it), kept on World.watchdog:
    a rank that leaves early or stops calling is named and the job ends, instead of hanging.
    Collective, as psrt.world.init is.  watchdog=False: the World alone."""
    world = init_world(comm, export_env=export_env)
    if not watchdog or world.size < 2:
        return world
    return dataclasses.replace(world, watchdog=running_for(world.comm) or Watchdog(world).start())


def running_for(comm) -> Watchdog | None:
    """The running watchdog of this process whose ranks include all of `comm`'s, if any.
    Found among the process's threads (the interpreter's own list), so that a Communicator
    made anywhere (a user's, a strategy's, a torch.distributed group's) is watched by the
    watchdog psrt.init() started without being handed it."""
    for thread in threading.enumerate():
        dog = getattr(thread, "watchdog", None) if isinstance(thread, _Thread) else None
        if dog is not None and dog.running() and dog.covers(comm):
            return dog
    return None


def _describe(group) -> str:
    """A watched Communicator as a report names it: its size and, where the MPI communicator
    has one, its name."""
    comm = getattr(group, "comm", None)
    name = ""
    try:
        name = comm.Get_name() if comm is not None else ""
    except Exception:  # noqa: BLE001 - a name is a nicety
        pass
    size = getattr(group, "size", "?")
    return f"a group of {size} ranks" + (f" named {name!r}" if name and not name.startswith("MPI") else "")
