"""`python -m psrt.bench`: parameter server vs ring, against every peer, with the model.

    python -m psrt.bench demo                     # PS vs ring on 4 emulated hosts (make demo)
    python -m psrt.bench suite --out out/bench    # all of it: report.md, JSON, CSV, PNG
    python -m psrt.bench suite --quick            # a small version, under a minute
    ./mpi_launch -np 4 python -m psrt.bench collectives --max-size 64MiB --json out/coll.json
    ./mpi_launch -np 4 python -m psrt.bench training    # step time of every --dp strategy
    python -m psrt.bench c10d --np 2,4            # torch DDP/FSDP2 on psrt vs gloo vs psrt's ring
    ./mpi_launch -np 2 python -m psrt.bench horovod     # where Horovod's all-reduce time goes
    ./mpi_launch -np 4 python -m psrt.bench memory      # ZeRO's memory table; zero3 vs FSDP2 step
    ./mpi_launch -np 4 python -m psrt.bench moe         # MoE all-to-all vs model; dense vs MoE step
    ./mpi_launch -np 4 python -m psrt.bench pipeline    # pipeline bubble, activations, TP bytes
    ./mpi_launch -np 2 python -m psrt.bench pingpong    # one-way time and the alpha-beta fit
    python -m psrt.bench network                  # shaped emulated hosts (root)
    python -m psrt.bench oversubscription --srun  # PSRT_YIELD=0 vs 1 under mpirun and srun
    python -m psrt.bench tune --np 2,4,8          # re-measure the table behind 'auto'
    python -m psrt.bench recovery                 # a lost host: restart on the survivors (root)
    python -m psrt.bench scaling --quick          # speed-up 1..8 workers on emulated accelerators (root)
    python -m psrt.bench chaos --trials 8 --seed 1      # seeded faults at random moments (root)
    ./mpi_launch -np 4 python -m psrt.bench backup      # backup workers with a straggler: time and loss
    python -m psrt.bench publish                  # run the results pages' commands into them (make bench)

Each subcommand is a module of this package with HELP, add_arguments(parser) and
command(args) -> exit code; COMMANDS is the registry.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from psrt.errors import ArgumentParser, cli_main

COMMANDS = ("demo", "suite", "collectives", "training", "c10d", "horovod", "memory", "moe", "pipeline", "pingpong", "network", "oversubscription", "tune",
            "recovery", "chaos", "backup", "scaling", "publish")


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python -m psrt.bench", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"psrt.bench.{name}")
        module.add_arguments(sub.add_parser(name, help=module.HELP))
        sub.choices[name].set_defaults(run=module.command)
    return ap


@cli_main("psrt.bench")
def main(argv=None) -> int:
    # The subcommands import psrt's collectives, whose import starts MPI: decide now whether
    # the ranks yield when idle (psrt.world), while MPI can still be told.
    from psrt.world import yield_before_mpi_starts
    yield_before_mpi_starts()
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
