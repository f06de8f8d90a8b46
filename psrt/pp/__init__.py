"""Pipeline parallelism: schedules as data (schedule.py), model splitting (partition.py),
tensor transfer between ranks (p2p.py) and the runtime that executes a schedule (runtime.py).

    sched = schedule.make_schedule("1f1b", num_ranks=grid.pp, num_microbatches=8)
    stages = partition.build_stages(blocks, sched.num_stages, sched.stages_of(grid.pp_rank))
    rt = PipelineRuntime(stages, sched, grid.pp_comm, loss_fn)
    stats = rt.step(inputs, targets, weights)     # grads accumulate in the stages' .grad
"""
from psrt.pp.partition import build_stages, split_batch, stage_ranges
from psrt.pp.runtime import PipelineRuntime, PipelineStats
from psrt.pp.schedule import SCHEDULES, Action, Schedule, make_schedule, table, validate

__all__ = ["Action", "Schedule", "SCHEDULES", "make_schedule", "table", "validate", "build_stages",
           "stage_ranges", "split_batch", "PipelineRuntime", "PipelineStats"]
