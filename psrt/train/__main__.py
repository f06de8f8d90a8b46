"""`python -m psrt.train`: train a model with any data-parallel strategy over MPI ranks.

    ./mpi_launch -np 8 python -m psrt.train                      # ring all-reduce, MLP on digits
    ./mpi_launch -np 4 python -m psrt.train --dp ps,ring         # both in turn, compared side by side

The command line is checked before any rank imports torch: flags, output paths, the grid and
the global batch against every strategy's workers.  Then every strategy's options are checked,
each strategy trains in turn (psrt/train/loop.py) and rank 0 prints one summary table.
See docs/how-to/training.md.
"""
from __future__ import annotations

import sys

import psrt
from psrt import env, faults
from psrt.errors import cli_main, launcher_rank
from psrt.train import prediction, report
from psrt.train.config import check_paths, parse_args, plan_batch


@cli_main("psrt.train")
def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if ("-h" in args or "--help" in args) and launcher_rank() not in (None, 0):
        return 0                  # under mpirun: the help once, from rank 0
    cfg = parse_args(argv)
    check_paths(cfg)
    world = psrt.init()           # MPI only: nothing so far needs torch
    faults.install("psrt.train")
    note = plan_batch(cfg, world.size)
    if note and world.rank == 0:  # even with --quiet: the batch trained is not the one asked for
        print(f"psrt.train: {note}", file=sys.stderr, flush=True)
    from psrt.train.loop import run_job   # torch from here on
    rows, job = run_job(cfg, world)
    if rows is not None:
        what = f"{cfg.model} on {cfg.data}"
        if cfg.profile:
            what = (f"{cfg.model} on {cfg.data}, timed by profile {cfg.profile}" if cfg.real_arithmetic
                    else f"profile {cfg.profile} (emulated compute, gradients seeded by {cfg.data})")
        print(f"\n{what}: global batch {cfg.batch_size}, {world.size} "
              f"rank{'s' * (world.size != 1)}, "
              f"{cfg.optimizer} lr {cfg.lr:g}")
        print(report.summary_table(rows))
        if "mem_states" in rows[0]:
            print("\n" + report.memory_block(rows, cfg.optimizer, cfg.precision))
        if "link" in rows[0]:
            print("\n" + prediction.describe(rows))
        elif "no_prediction" in rows[0]:
            print("\n" + rows[0]["no_prediction"])
        for row in rows:
            if "loss_scale" in row:
                print(f"{row['dp']}: fp16 loss scaling skipped {row['skipped_steps']} of {row['steps']} steps "
                      f"(every rank the same ones); the scale is now {row['loss_scale']:g}")
        for row in rows:
            if "left_out" in row:
                print(f"{row['dp']}: backup workers {row['backup_workers']}: the server left out "
                      f"{row['left_out']} worker gradients over {row['steps_run']} steps (the last to "
                      "arrive each step)")
        for row in rows:
            if row.get("cpu_bound"):
                print(f"{row['dp']}: CPU-bound: the ranks waited for a core {row['run_queue']:.0%} of the time "
                      f"(busy {row['cpu_busy']:.0%}): these steps measure the host's CPU, not the link")
        if cfg.profile and (cfg.time_dilation, cfg.byte_divisor) != (1.0, 1.0):
            print(f"time dilation: compute x{cfg.time_dilation:g}, gradient bytes /{cfg.byte_divisor:g}: over an "
                  f"emulated link of B this stands for a cluster with links of {cfg.time_dilation * cfg.byte_divisor:g} x B "
                  f"and the real gradient sizes, its step times {cfg.time_dilation:g}x shorter (latency not dilated)")
        for row in rows:
            line = report.axes_line(row)
            if line:
                print(line)
        for row in rows:
            if row.get("moe"):
                print("\n" + report.moe_block(row))
        if not cfg.quiet:
            print(report.LEGEND)
        sys.stdout.flush()
    if env.in_job_recovery():
        from psrt.train.in_job import leave
        leave(0, speaks_for_survivors=job.speaks_for_survivors)
    return 0


if __name__ == "__main__":
    sys.exit(main())
