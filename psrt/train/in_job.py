"""In-job recovery: after a lost rank the survivors carry on inside the same job (MPI's ULFM).

Under `mpi_launch --in-job-recovery` (Open MPI 5 started with `--with-ft ulfm`) a rank that
dies makes the survivors' calls that wait for it fail with MPI_ERR_PROC_FAILED instead of
ending the job.  The survivors then follow the recipe of User-Level Failure Mitigation (Bland
et al., "Post-failure recovery of MPI communication capability: design and rationale",
IJHPCA 27(3), 2013: revoke, shrink, agree):

1. a rank that sees the failure revokes every communicator the run uses (the strategy's, the
   loop's, the watchdog's), so that a survivor waiting in a call for a live peer (its ring
   neighbour) returns with MPI_ERR_REVOKED instead of waiting for a message that will never
   come, and does the same;
2. every survivor shrinks the world's communicator to the processes still alive and builds
   psrt's World, the strategy and its Communicator again on the result;
3. they agree on the step to go on from.  Each rank keeps in memory the state after its last
   two finished steps (Horovod Elastic's `state.commit()`): one rank may have finished the
   all-reduce of the step in which another saw the failure, and stepped, but no rank can be
   two steps ahead, since a step's all-reduce needs every rank's gradients of that step.  The
   latest step every survivor holds (an MPI_MIN over them) wins, and rank 0's copy of it is
   broadcast so that every replica is the same;
4. the data order goes on: data.ShardedSampler depends on the step alone and splits each
   global batch over the survivors, so the lost rank's share goes to them and the run computes
   the training an uninterrupted run on the survivors' number of ranks computes.

No restart and no disk read for the strategies whose every rank holds all parameters and the
whole optimizer state (`FULL_REPLICA`).  The strategies that keep a state on one rank only
(ZeRO's shards, the parameter servers' state: `FROM_CHECKPOINT`) lose it with that rank; the
survivors then read the last complete --checkpoint in the same job, resharded to their number
(the reshard a restart does, without the restart), and compute again the steps after it.
Keeping a second copy of every shard on a buddy rank would spare that read at twice the
optimizer memory and a second transfer of every shard each step (see docs/how-to/reliability.md,
"Recovery inside the job").
"""
from __future__ import annotations

import copy
import os
import sys
import time
from collections import deque

from psrt.errors import IN_JOB_DONE
from psrt.world import init, revoke

# Every rank holds the whole model and optimizer state and the gradients travel through MPI.
# (--dp torch reduces through torch.distributed's gloo, whose process group cannot shrink.)
FULL_REPLICA = ("ring", "native")
# A state on one rank only, read back from the last checkpoint after the shrink.
FROM_CHECKPOINT = ("zero1", "zero2", "zero3", "zero", "ps", "ps-sharded")


def refusal(dp: str, grid: bool, precision: str, why_not_ulfm: str | None, checkpoint: bool = False,
            servers: int | None = None) -> str | None:
    """Why in-job recovery cannot serve --dp `dp` in this run, or None."""
    where = f"--dp {dp} under mpi_launch --in-job-recovery"
    if why_not_ulfm:
        return f"{where}: {why_not_ulfm}; use mpi_launch --restarts N instead"
    if dp == "torch":
        return (f"{where}: torch reduces through torch.distributed's gloo, whose process group cannot "
                "shrink: use --dp ring or native, or mpi_launch --restarts N")
    if dp in FROM_CHECKPOINT and not checkpoint:
        return (f"{where}: the state a lost rank of {dp} holds alone comes back from the last checkpoint: "
                "give --checkpoint FILE (written every twentieth of the run unless --checkpoint-every says)")
    if dp in FROM_CHECKPOINT and servers:
        return (f"{where}: dedicated servers (--servers {servers}) cannot recover inside the job: "
                "use the co-located ones (--servers 0) or mpi_launch --restarts N")
    if dp not in FULL_REPLICA + FROM_CHECKPOINT:
        return f"{where}: {dp} cannot recover inside the job: use mpi_launch --restarts N"
    if grid:
        return f"{where}: a pipeline or tensor-parallel grid cannot recover inside the job: use --restarts N"
    if precision == "fp16":
        return f"{where}: fp16's loss scale is not kept across a recovery: use --precision bf16 or fp32"
    return None


class InJob:
    """One strategy's in-job recovery: the in-memory commits, the shrink, what to say.

    Args:
        lead: this rank speaks (prints the recovery lines).
    """

    def __init__(self, lead: bool, keep: bool = True):
        self.commits: deque = deque(maxlen=2)      # (step, state or None), oldest first
        self.keep = keep                           # copy the state (FULL_REPLICA), or note the step
        self.count = 0
        self.lead = lead
        self.lost: list[int] = []
        self._pending: dict | None = None          # until the first step after a recovery

    def commit(self, step: int, state) -> None:
        """Keep a copy of `state` (a Driver) as it is after `step` (only the step without `keep`)."""
        self.commits.append((step, copy.deepcopy(state.state_dict()) if self.keep else None))

    def shrink(self, err: str, world, comms, groups=(), dog=None):
        """Revoke `comms` (MPI communicators) and `groups` (psrt Communicators), stop the
        watchdog `dog`, and return the World of the survivors."""
        seen = time.time()
        for g in groups:
            g.revoke()
        for c in comms:
            revoke(c)
        if dog is not None:
            dog.abandon()
        shrunk = world.comm.Shrink()
        from mpi4py import MPI
        kept = MPI.Group.Translate_ranks(shrunk.Get_group(), list(range(shrunk.Get_size())), world.comm.Get_group())
        self.lost = sorted(set(range(world.size)) - set(kept))
        # the World alone (psrt.world.init starts no watchdog): the loop starts the survivors'
        survivors = init(comm=shrunk, export_env=False)
        shrunk.Free()
        self.count += 1
        self._pending = {"error": err, "seen": seen, "from": world.size}
        return survivors

    def agree(self, world) -> tuple[int, dict]:
        """(step, state) every survivor goes on from: the latest step all of them committed,
        rank 0's state of it (see the module)."""
        from mpi4py import MPI
        from psrt.errors import PsrtError
        step = world.comm.allreduce(self.commits[-1][0], op=MPI.MIN)
        held = dict(self.commits)
        if step not in held:     # cannot happen (see the module); a clear error if it does
            raise PsrtError(f"in-job recovery: rank {world.rank} holds steps {sorted(held)}, not step {step}")
        state = world.comm.bcast(held[step] if world.rank == 0 else None, root=0)
        ahead = world.comm.allreduce(self.commits[-1][0], op=MPI.MAX)
        self._pending.update(step=step, ahead=ahead)
        return step, state

    def reload(self, world, load) -> int:
        """The step every survivor goes on from when the lost state comes from the last
        checkpoint: `load()` reads it (collective) and returns its step."""
        from mpi4py import MPI
        step = load()
        ahead = world.comm.allreduce(self.commits[-1][0], op=MPI.MAX)
        self._pending.update(step=step, ahead=ahead, read=True)
        return step

    def started(self, label: str, lead: bool) -> None:
        """Say where the run goes on from (the lead worker after the recovery)."""
        self.lead = lead
        p = self._pending
        if not lead or p is None:
            return
        again = f"; steps {p['step'] + 1}-{p['ahead']} are done again" if p["ahead"] > p["step"] else ""
        read = " of its last checkpoint" if p.get("read") else ""
        print(f"psrt.train: in-job recovery {self.count}: rank{'s' * (len(self.lost) > 1)} "
              f"{', '.join(map(str, self.lost))} of {p['from']} lost ({p['error']}); {label} continues "
              f"from step {p['step']}{read}{again}", file=sys.stderr, flush=True)

    def step_done(self, step: int) -> dict:
        """After each finished step: on the first one after a recovery, say how long it took.
        Returns what the metrics row adds (the fields of psrt.train.recovery's restarts)."""
        p, self._pending = self._pending, None
        if p is None:
            return {}
        took = round(time.time() - p["seen"], 3)
        if self.lead:
            print(f"psrt.train: in-job recovery {self.count}: step {step} done {took:.2f} s after the "
                  "failure was seen", file=sys.stderr, flush=True)
        return {"in_job_recovery": self.count, "unix_time": round(time.time(), 3), "recovery_s": took,
                "steps_lost": max(0, p["ahead"] - p["step"]), "lost_ranks": self.lost,
                "resumed_from": p["step"]}


def leave(code: int = 0, speaks_for_survivors: bool = False) -> None:
    """End a process of an in-job run without MPI_Finalize, once everything is written.

    Open MPI 5.0's MPI_Finalize can spin for ever in a survivor after a recovery (seen here with
    8 ranks, 4 of them killed: every survivor's main thread in ompi_mpi_finalize ->
    opal_progress; with 3 ranks, 1 killed, it returned), and nothing is left to communicate:
    the run's last collective and the watchdog's farewell have made every survivor wait for
    every other.

    After a recovery the survivors' rank 0 (`speaks_for_survivors`, psrt.train.loop.Job) says
    that they have all finished: when the lost ranks' host is gone, Open MPI 5's runtime waits
    at the job's end for its daemon there for ever, and mpi_launch ends the job on that line
    (psrt.launch.mpi.ENDINGS)."""
    if speaks_for_survivors:
        print(IN_JOB_DONE, file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
