"""Horovod and psrt's ring all-reduce train the same model, printed side by side.

    horovodrun -np 4 python examples/horovod_vs_ring.py
    ./mpi_launch -np 4 python examples/horovod_vs_ring.py --steps 200 --model cnn

Both runs go through the loop `python -m psrt.train` uses (psrt.train.loop.train_all): same seed,
same initial parameters, same sample order, same global batch; only the strategy that
averages the gradients differs (`--dp horovod`, then `--dp ring`).  Any psrt.train flag
may be added (--model, --batch-size, --optimizer, --compress fp16, ...); --dp is fixed.
Needs horovod (scripts/install_horovod.sh).
"""
import sys

import psrt
from psrt.errors import PsrtError, cli_main
from psrt.train import report
from psrt.train.config import check_paths, parse_args, plan_batch
from psrt.train.loop import train_all

STRATEGIES = "horovod,ring"


def compare(rows: dict) -> str:
    """One line: how far apart the two runs ended and which was faster."""
    h, r = rows["horovod"], rows["ring"]
    return (f"horovod vs ring: final train loss {h['train_loss']:.5f} vs {r['train_loss']:.5f} "
            f"(|diff| {abs(h['train_loss'] - r['train_loss']):.1e}); samples/s ratio horovod/ring "
            f"{h['samples_per_s'] / r['samples_per_s']:.2f}; comm s {h['comm_s']:.2f} vs {r['comm_s']:.2f}")


@cli_main("horovod_vs_ring")
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--dp" or a.startswith("--dp=") for a in argv):
        raise PsrtError(f"--dp is fixed to {STRATEGIES} here; use python -m psrt.train for others",
                        everywhere=True)
    if not any(a in ("--steps", "--epochs") or a.startswith(("--steps=", "--epochs=")) for a in argv):
        argv += ["--steps", "100"]
    cfg = parse_args(["--dp", STRATEGIES] + argv)
    check_paths(cfg)
    world = psrt.init()
    plan_batch(cfg, world.size)
    rows = train_all(cfg, world, watchdog=False)
    if rows is not None:
        rows = dict(zip(cfg.dp_list, rows))
        print(f"\n{cfg.model} on {cfg.data}: global batch {cfg.batch_size}, {world.size} ranks "
              f"(launcher: {world.launcher}), {cfg.optimizer} lr {cfg.lr:g}")
        print(report.summary_table(list(rows.values())))
        print(compare(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
