"""Restart on the survivors: relaunch a failed job on the hosts that still answer.

`mpi_launch --restarts N` runs the job; when it fails it asks every host of the hostfile
whether it answers (the way MPI reaches it: ssh, or the emulated cluster's agent), and starts
the same command again on those that do, at most N times.  When every host answers (a rank
died, not a host) the job starts again as asked, -np included: a slot count is a limit only
for the hosts that are gone.  When hosts are lost the survivors run as many ranks as they have
slots (never more than asked for), and a job that shrinks says so in one line.  The ranks
learn of it from the environment (PSRT_RESTART_COUNT, like torchrun's
TORCHELASTIC_RESTART_COUNT; PSRT_FAILED_AT, the time the failure was seen), and
`python -m psrt.train` then continues from its last complete checkpoint: the data-parallel
strategies compute the same training at any number of workers for a fixed global batch, and
sharded state reshards on load (see docs/how-to/reliability.md).

The policy here is the launchers' own: each passes `run_restarting` its probe (here `answers`,
ssh as mpirun reaches a host; the emulated cluster's agent; under srun a one-task step on a
node of the allocation, psrt/launch/srun.py) and its `start` (mpirun, or a new srun step).

A host that answers again (or a new one named in the hostfile) is back in at the next restart;
while the job runs narrowed, a lost host that answers again asks for that restart itself, at
the job's next checkpoint (a grow-back: psrt/launch/growback.py).
What is not worth another try ends the run: a usage error (exit 2: the same flags would fail
again), the user's own Ctrl-C or SIGTERM, too few ranks left (--min-np), or the launcher's own
host gone.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import time
from dataclasses import dataclass
from typing import Callable

from psrt.errors import GROW_BACK_EXIT, PsrtError, StorageError
from psrt.launch.growback import asking
from psrt.launch.hostfile import slots_of
from psrt.launch.probe import answers, survivors

USAGE_ERROR = 2                 # PsrtError.exit_code: the same command fails the same way
STORAGE_ERROR = StorageError.exit_code               # StorageError.exit_code: a write refused (a full disk)
STOPPED_BY_USER = {128 + s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}


@dataclass(frozen=True)
class Policy:
    restarts: int = 0           # how many times a failed job is started again
    min_np: int = 1             # fewer ranks than this left: stop instead


def worth_retrying(code: int) -> str | None:
    """Why a job that ended with `code` is not started again (None: it is)."""
    if code == 0:
        return "it succeeded"
    if code == USAGE_ERROR:
        return "exit 2 is a usage error, which a restart would repeat"
    if code == STORAGE_ERROR:
        return ("exit 4: a file could not be written (a full disk?), and a restart would fail at the "
                "same write until there is room")
    if code in STOPPED_BY_USER:
        return f"stopped by a signal to the launcher (exit {code})"
    return None


def next_request(original, cores: int, policy: Policy, probe=answers, say=print):
    """The request for the next attempt, on the hosts of `original` that answer.

    Every host answers: `original` as it is, with its -np (or one rank per slot, as at the
    first start); a slotless localhost runs more ranks than cores as it did then (plan.place).
    Hosts lost: min(asked, the survivors' slots) ranks, said in one line with the reason when
    that is fewer than asked.  PsrtError when no host answers or the count is under
    policy.min_np."""
    alive = survivors(original.hosts, probe)
    lost = [h.name for h in original.hosts if h not in alive]
    if not alive:
        raise PsrtError("no host of the job answers: nothing to restart on")
    asked = original.np if original.np is not None else sum(slots_of(h, cores) for h in original.hosts)
    slots = sum(slots_of(h, cores) for h in alive)
    np_ = min(asked, slots) if lost else asked
    if np_ < policy.min_np:
        raise PsrtError(f"{np_} rank(s) left on {', '.join(h.name for h in alive)} "
                        f"({', '.join(lost) or 'no host'} lost), under --min-np {policy.min_np}")
    if lost:
        shrinks = (f"; {np_} rank(s) instead of {asked}: the slots of the hosts that answer "
                   f"({', '.join(f'{h.name} {slots_of(h, cores)}' for h in alive)})") if np_ < asked else ""
        say(f"not answering: {', '.join(lost)}{shrinks}")
    # A hostfile passed on as it is would name the lost hosts too: the survivors go as a list.
    return dataclasses.replace(original, hosts=alive, hostfile=None if lost else original.hostfile, np=np_)


def run_restarting(req, start: Callable, cores: int, policy: Policy, probe=answers, say=print,
                   precheck: Callable[[], None] | None = None, grow_every: float = 0.0) -> int:
    """Run `start(req, env_extra) -> exit code`, and after each failure `next_request` and
    `start` again, at most policy.restarts times.  Returns the last exit code.

    `precheck()`, once the hosts have answered (a lost host's fate is known by then), raises
    PsrtError when no restart can run whatever they said (under srun: the allocation is over).
    `grow_every` > 0: while a start runs on fewer hosts than `req`, the lost ones are asked that
    often, and one that answers again widens the job at its next checkpoint (growback.py); such
    a start again on every host does not count as a restart."""
    told = {"PSRT_RESTARTS": str(policy.restarts)} if policy.restarts else {}
    starts = failures = 0
    code, grew = _start_watching(req, req, start, told, probe, grow_every, say)
    while True:
        failed_at = None
        if grew and code == GROW_BACK_EXIT:
            say(f"the job stopped at its checkpoint for the host(s) back; restart {starts + 1}: asking the hosts")
        else:
            if failures == policy.restarts:
                if code != 0 and policy.restarts:
                    say(f"giving up after {policy.restarts} restart(s) (exit {code})")
                return code
            why_not = worth_retrying(code)
            if why_not:
                if code != 0:
                    say(f"not restarting: {why_not}")
                return code
            failures += 1
            failed_at = time.time()
            say(f"the job failed (exit {code}); restart {failures} of {policy.restarts}: asking the hosts")
        starts += 1
        try:
            again = next_request(req, cores, policy, probe, say)
            if precheck is not None:
                precheck()
        except PsrtError as err:
            say(f"not restarting: {err}")
            return code
        say(f"restart {starts}: {again.np} rank(s) on "
            f"{', '.join(h.name for h in again.hosts)}, from the last checkpoint")
        extra = {**told, "PSRT_RESTART_COUNT": str(starts)}
        if failed_at is not None:
            extra["PSRT_FAILED_AT"] = f"{failed_at:.3f}"
        code, grew = _start_watching(req, again, start, extra, probe, grow_every, say)


def _start_watching(req, this, start: Callable, extra: dict, probe, grow_every: float, say) -> tuple[int, bool]:
    """(exit code, whether a grow-back was asked) of `start(this, extra)`, the hosts of `req`
    that `this` leaves out asked meanwhile every `grow_every` seconds (growback.asking)."""
    with asking(req.hosts, this.hosts, probe, grow_every, say) as ask:
        code = start(this, {**extra, **ask["env"]})
    return code, ask["asked"]


def ssh_for(env) -> str:
    """The ssh a probe uses: the first `ssh` on the job's PATH (the emulated cluster puts its
    agent there)."""
    return shutil.which("ssh", path=env.get("PATH", os.defpath)) or "ssh"
