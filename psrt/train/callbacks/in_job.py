"""In-job recovery (mpi_launch --in-job-recovery, ULFM): each step's state committed in memory,
and after a lost rank the survivors' run rebuilt on their shrunk world, from the step they
agree on or from the last checkpoint (psrt.train.in_job tells how and why)."""
from __future__ import annotations

import contextlib

from psrt import faults
from psrt.train import checkpoint
from psrt.train.events import Callback
from psrt.train.in_job import FULL_REPLICA, InJob
from psrt.watchdog import Watchdog
from psrt.world import lost_peer


class InJobRecovery(Callback):

    def __init__(self):
        self.in_job: InJob | None = None

    def on_run_start(self, run) -> None:
        self.in_job = InJob(run.is_lead, keep=run.dp in FULL_REPLICA)
        if run.is_worker:
            self.in_job.commit(run.step, run.layout.state)

    def on_step_end(self, run, stats) -> None:
        if stats is not None:
            self.in_job.commit(run.step, run.layout.state)
            run.notes.update(self.in_job.step_done(run.step))

    def on_failure(self, run, error: BaseException) -> bool:
        why = lost_peer(error)
        if why is None:
            return False
        self.recover(run, why)
        return True

    def recover(self, run, why: str) -> None:
        """Revoke, shrink, rebuild: run.built and the job on the survivors, run.step the
        step they go on from."""
        in_job, job, built = self.in_job, run.job, run.built
        comms = [job.ctl, job.world.comm, job.world.local_comm] + ([built.scaler.comm] if built.scaler else [])
        comms += [getattr(c, name) for c in built.run.components for name in ("pcomm", "scomm")
                  if getattr(c, name, None) is not None]   # the parameter servers' own channels
        job.world = in_job.shrink(why, job.world, comms, [built.group] if built.group else [], job.dog)
        job.speaks_for_survivors = job.world.rank == 0
        for close in (built.run.finish, built.group.close):
            with contextlib.suppress(Exception):     # on revoked communicators: nothing left to do
                close()
        job.ctl = job.world.comm.Dup()
        if job.dog is not None:
            job.dog = Watchdog(job.world, timeout_s=run.cfg.timeout_s).start()
        if in_job.keep:
            step, state = in_job.agree(job.world)
            run.built = run.build()
            run.layout.state.load_state_dict(state)
        else:
            run.built = run.build()
            step = in_job.reload(job.world, lambda: checkpoint.load(run.path("checkpoint"), job.ctl,
                                                                    run.layout.state, run.hparams))
        faults.strike_if_asked("recovery", step)
        run.step = step
        in_job.commit(step, run.layout.state)
        in_job.started(run.label, run.is_lead)
