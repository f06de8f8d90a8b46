"""Record a model profile from a real model, by hooks, on the device it trains on.

    python -m psrt.train.recording --model cnn --batch 64 --device cuda --out cnn.json
    python -m psrt.train --profile cnn.json ...                       # then emulate it anywhere

A layer of the profile is the module that owns a run of parameters (a Linear's weight and
bias), in the order of model.named_parameters(), so the profile lists the model's parameter
tensors in order and shape (what --real-arithmetic checks).  Times, per layer, the median
over --steps steps after one warm-up step:

- forward: from the end of the previous layer's forward (or the start of the model's) to the
  end of this one's, by forward hooks on the owning modules;
- backward: from the moment the previous gradient appeared to the moment this layer's last
  gradient did (register_post_accumulate_grad_hook, where the strategies take them), from the
  start of backward (a hook on the model's output).

On CUDA every hook synchronises the device first, so that a time is the kernels' and not
their launch's; this serialises the step, which is what a per-layer time needs.  On a CPU
the times are the CPU's (what the tests use, and what a CPU cluster would see).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from psrt.errors import ArgumentParser, PsrtError, cli_main
from psrt.train.profile import Layer, Profile


def layers_of(model: torch.nn.Module) -> list[tuple[str, list[tuple[str, torch.nn.Parameter]]]]:
    """The model's trainable parameters grouped into layers: consecutive parameters with the
    same owning module, [(module name, [(parameter name, parameter)])]."""
    groups: list = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        owner, _, leaf = name.rpartition(".")
        if groups and groups[-1][0] == owner:
            groups[-1][1].append((leaf, p))
        else:
            groups.append((owner or "model", [(leaf, p)]))
    if not groups:
        raise PsrtError("the model has no trainable parameters: nothing to profile", everywhere=True)
    return groups


class Recorder:
    """The hooks of one recording and the times of each step."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.model, self.device = model, device
        self.groups = layers_of(model)
        modules = dict(model.named_modules())
        self.fwd_ends: list[float] = [0.0] * len(self.groups)
        self.grad_at: list[float] = [0.0] * len(self.groups)
        self.t0 = self.b0 = 0.0
        self.handles = []
        for i, (owner, params) in enumerate(self.groups):
            module = modules.get(owner if owner != "model" else "", model)
            self.handles.append(module.register_forward_hook(lambda m, a, o, i=i: self._forward_end(i)))
            for _, p in params:
                self.handles.append(p.register_post_accumulate_grad_hook(lambda p, i=i: self._grad(i)))

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _forward_end(self, i: int) -> None:
        self.fwd_ends[i] = self._now() - self.t0

    def _grad(self, i: int) -> None:
        self.grad_at[i] = max(self.grad_at[i], self._now() - self.b0)

    def step(self, loss_of) -> tuple[list[float], list[float]]:
        """One forward and backward: (per-layer forward seconds, per-layer backward seconds)."""
        self.model.zero_grad(set_to_none=True)
        self.grad_at = [0.0] * len(self.groups)
        self.t0 = self._now()
        loss = loss_of()
        fwd_total = self._now() - self.t0
        self.b0 = self._now()
        loss.backward()
        bwd_total = self._now() - self.b0
        fwd, last = [], 0.0
        for end in self.fwd_ends:
            fwd.append(max(0.0, end - last))
            last = max(last, end)
        fwd[-1] += max(0.0, fwd_total - last)          # the loss and what follows the last layer
        bwd, last = [0.0] * len(self.groups), 0.0
        for i in reversed(range(len(self.groups))):     # backward runs the layers in reverse
            bwd[i] = max(0.0, self.grad_at[i] - last)
            last = max(last, self.grad_at[i])
        bwd[0] += max(0.0, bwd_total - last)
        return fwd, bwd

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def record(model: torch.nn.Module, loss_of, name: str, batch: int, device: torch.device, steps: int = 5,
           source: str = "") -> Profile:
    """The profile of `model`, `loss_of()` running one forward of a batch of `batch` samples
    and returning the loss; per-layer medians over `steps` steps after one warm-up."""
    rec = Recorder(model, device)
    try:
        rec.step(loss_of)                                  # warm-up: allocations, kernel choice
        runs = [rec.step(loss_of) for _ in range(steps)]
    finally:
        rec.close()
    layers = []
    for i, (owner, params) in enumerate(rec.groups):
        layers.append(Layer(owner, tuple((leaf, tuple(p.shape)) for leaf, p in params),
                            statistics.median(r[0][i] for r in runs), statistics.median(r[1][i] for r in runs)))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"this host's CPU ({torch.get_num_threads()} threads)"
    return Profile(name, batch, tuple(layers), source or f"recorded by psrt.train.recording, median of {steps} steps",
                   f"measured on {where}")


@cli_main("psrt.train.recording")
def main(argv=None) -> int:
    parser = ArgumentParser(prog="python -m psrt.train.recording",
                            description="Record a profile (per-layer forward and backward times, parameter shapes) "
                                        "of one of psrt.train's models, for psrt.train --profile.")
    parser.add_argument("--model", default="mlp", help="as psrt.train's --model (also module:callable)")
    parser.add_argument("--data", default=None, help="as psrt.train's --data")
    parser.add_argument("--width", type=int, default=0)
    parser.add_argument("--layers", type=int, default=0)
    parser.add_argument("--batch", type=int, default=64, help="samples per step (the profile's batch)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps, after one warm-up")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--out", required=True, help="the profile file to write (.json)")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.steps < 1:
        raise PsrtError("--batch and --steps must be at least 1", everywhere=True)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise PsrtError("--device cuda: no CUDA device is visible", everywhere=True)
    from psrt.train import imported
    from psrt.train.config import TrainConfig, check_paths
    from psrt.train.models import loss_and_correct
    cfg = TrainConfig(model=args.model, data=args.data, width=args.width, layers=args.layers, save=args.out)
    check_paths(cfg)
    device = torch.device(args.device)
    dataset = imported.load_data(cfg.data, cfg.seq_len)
    torch.manual_seed(0)
    model = imported.make_model(cfg, dataset).to(device)
    criterion = imported.loss_of(cfg, dataset)
    n = min(args.batch, len(dataset.train_x))
    batch = (dataset.train_x[:n].to(device), dataset.train_y[:n].to(device))
    name = f"{args.model}" + (f"-w{args.width}" if args.width else "") + (f"-l{args.layers}" if args.layers else "")
    profile = record(model, lambda: loss_and_correct(model, batch, dataset.task, criterion)[0], name, n, device,
                     args.steps)
    profile.save(args.out)
    print(profile.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
