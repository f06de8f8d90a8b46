"""Your own component of the training loop: count the steps each strategy trains and write
them to a file, from `python -m psrt.train` or from your own psrt.data_parallel loop.

    # psrt.train: the component named by --callback (its module on PYTHONPATH)
    PYTHONPATH=examples ./mpi_launch -np 2 python -m psrt.train --dp ps,ring --steps 20 \\
        --callback callback_steps:StepCounter
    # your own loop: the same component, and psrt's metrics and TensorBoard ones beside it
    ./mpi_launch -np 2 python examples/callback_steps.py --steps 20 --tensorboard out/tb

A component subclasses psrt.train.events.Callback and overrides the events it needs
(docs/how-to/training.md, "Components"); every rank hears every event, so one that writes checks
`run.is_lead`.  The file (STEP_COUNT_FILE, default steps.json) gets one line per strategy.
"""
import argparse
import json
import os

import torch

import psrt
from psrt.train.callbacks.metrics import Metrics
from psrt.train.events import Callback, WithCallbacks


class StepCounter(Callback):
    """Counts the steps a strategy trains, notes where it started and the last loss."""

    def __init__(self):
        self.path = os.environ.get("STEP_COUNT_FILE", "steps.json")
        self.steps, self.loss = 0, None

    def on_run_start(self, run):
        self.steps, self.start = 0, run.start

    def on_step_end(self, run, stats):
        if stats is not None:           # None on a dedicated parameter server
            self.steps += 1
            self.loss = stats.loss

    def on_run_end(self, run, everyone, row):
        if run.is_lead:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"dp": run.dp, "start": self.start, "steps": self.steps,
                                    "last_step": run.step, "loss": self.loss}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--strategy", default="ring")
    ap.add_argument("--metrics", help="JSONL metrics file (psrt.train's Metrics component)")
    ap.add_argument("--tensorboard", metavar="DIR", help="TensorBoard log directory (needs tensorboard)")
    args = ap.parse_args()
    world = psrt.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    components = [StepCounter()] + ([Metrics(args.metrics)] if args.metrics else [])
    if args.tensorboard:
        from psrt.train.callbacks.tensorboard import TensorBoard
        components.append(TensorBoard(args.tensorboard))
    ddp = WithCallbacks(psrt.data_parallel(model, lambda p: torch.optim.SGD(p, lr=0.05), args.strategy, world=world),
                        components, total=args.steps, hparams={"batch_size": 32, "lr": 0.05})
    data = torch.Generator().manual_seed(1 + world.rank)
    for _ in range(args.steps):
        x = torch.randn(32 // world.size, 8, generator=data)
        ddp.step(lambda mb: torch.nn.functional.mse_loss(model(mb[0]), mb[1]), (x, x.sum(1, keepdim=True)))
    ddp.finish()


if __name__ == "__main__":
    main()
