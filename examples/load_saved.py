"""Load what `psrt.train --save FILE` wrote into the model psrt.train builds on one process,
and evaluate it: no MPI, no psrt strategy, just the module and its state_dict.

    ./mpi_launch -np 4 python -m psrt.train --dp ps,ring --steps 4 --save out/model.pt --quiet
    python examples/load_saved.py out/model.ring.pt      # one file per strategy: FILE.<dp>.pt

The model's settings (--model, --data, --width, --layers) must be the run's; the defaults are
psrt.train's (an MLP on digits)."""
from __future__ import annotations

import argparse

import torch

from psrt.train import data, models


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("file", help="a state_dict written by psrt.train --save")
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--data", default="digits")
    ap.add_argument("--width", type=int, default=0)
    ap.add_argument("--layers", type=int, default=0)
    args = ap.parse_args()
    dataset = data.load(args.data)
    model = models.build_model(args.model, dataset, args.width, args.layers)
    model.load_state_dict(torch.load(args.file, weights_only=True))
    model.eval()
    with torch.no_grad():
        predicted = model(dataset.test_x).argmax(-1)
    accuracy = (predicted == dataset.test_y).float().mean().item()
    print(f"{args.file}: {sum(p.numel() for p in model.parameters())} parameters, test accuracy {accuracy:.1%}")


if __name__ == "__main__":
    main()
