"""A model profile: what an emulated accelerator needs to stand in for a real model's compute.

A profile lists the model's layers in forward order; each layer names its parameter tensors
(name and shape) and the time its forward and its backward take at the profile's stated
batch (samples per accelerator).  `psrt.train --profile NAME|FILE` builds the real
parameters from it and replaces the computation by timed waits (psrt/train/emulated.py), so
the gradients, their sizes, their order and the moment each appears during backward are the
real model's while the host CPU does none of its arithmetic.

Times scale linearly with the micro-batch (the regime where an accelerator is busy; at very
small batches real kernels do not shrink as much, which a profile recorded at the batch one
trains with avoids).  Time dilation (`dilated`) multiplies every time and divides every
tensor's size, so that a slow emulated link keeps the real cluster's ratio of compute to
communication (docs/explanation/scaling.md).

This module needs no torch and no MPI: the format, its checks and its arithmetic are tested
on their own (tests/unit/test_profile.py).  The shipped profiles live in profiles/*.json,
made from the architectures of psrt/train/architectures.py.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

from psrt.errors import PsrtError

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")
FORMAT = "psrt-profile/1"


@dataclass(frozen=True)
class Layer:
    """One layer: its parameter tensors [(name, shape)] and its forward and backward
    seconds at the profile's batch."""
    name: str
    params: tuple
    forward_s: float
    backward_s: float

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for _, shape in self.params)


@dataclass(frozen=True)
class Profile:
    """A model's layers in forward order, timed at `batch` samples per accelerator.

    name, source: what the profile is and where its shapes and times come from (cited);
    device: the accelerator the times stand for (e.g. "100 TFLOP/s sustained");
    dilation: the time factor already applied (1: real time), see `dilated`."""
    name: str
    batch: int
    layers: tuple
    source: str = ""
    device: str = ""
    dilation: float = 1.0
    byte_scale: float = 1.0
    notes: dict = field(default_factory=dict)

    # ---------------------------------------------------------------- figures
    @property
    def numel(self) -> int:
        return sum(layer.numel for layer in self.layers)

    def grad_bytes(self, itemsize: int = 4) -> int:
        return self.numel * itemsize

    @property
    def forward_s(self) -> float:
        return sum(layer.forward_s for layer in self.layers)

    @property
    def backward_s(self) -> float:
        return sum(layer.backward_s for layer in self.layers)

    def compute_s(self, samples: int | None = None) -> float:
        """Forward plus backward of `samples` (default: the profile's batch)."""
        return (self.forward_s + self.backward_s) * self.scale(samples)

    def scale(self, samples: int | None) -> float:
        """The factor from the profile's batch to `samples` (linear: see the module)."""
        return 1.0 if samples is None else samples / self.batch

    def forward_ends(self, samples: int | None = None) -> list[float]:
        """Seconds from the start of forward at which each layer's forward ends."""
        return _cumulative([layer.forward_s for layer in self.layers], self.scale(samples))

    def gradient_times(self, samples: int | None = None) -> list[float]:
        """Seconds from the start of backward at which each layer's gradients appear, in
        forward order: backward runs the layers in reverse, so the last layer's come first."""
        back = _cumulative([layer.backward_s for layer in reversed(self.layers)], self.scale(samples))
        return back[::-1]

    # ---------------------------------------------------------------- changes
    def dilated(self, time_factor: float, byte_divisor: float = 1.0) -> "Profile":
        """Every time multiplied by `time_factor` and every tensor's size divided by
        `byte_divisor` (a tensor of n elements becomes one of ceil(n / divisor), flat).
        With an emulated link of B_e bytes/s standing for a real one of B_r, a divisor k and
        a time factor k x B_r / B_e keep each step's ratio of compute to bandwidth time that
        of the real cluster; latency is not dilated (docs/explanation/scaling.md)."""
        if not (time_factor > 0 and math.isfinite(time_factor)):
            raise PsrtError(f"time dilation {time_factor}: must be a positive finite number", everywhere=True)
        if not (byte_divisor >= 1 and math.isfinite(byte_divisor)):
            raise PsrtError(f"byte divisor {byte_divisor}: must be a finite number of at least 1", everywhere=True)
        layers = tuple(Layer(layer.name,
                             tuple((n, s if byte_divisor == 1 else (max(1, math.ceil(math.prod(s) / byte_divisor)),))
                                   for n, s in layer.params),
                             layer.forward_s * time_factor, layer.backward_s * time_factor)
                       for layer in self.layers)
        return Profile(self.name, self.batch, layers, self.source, self.device,
                       self.dilation * time_factor, self.byte_scale / byte_divisor, dict(self.notes))

    # ---------------------------------------------------------------- the file
    def to_dict(self) -> dict:
        return {"format": FORMAT, "name": self.name, "batch": self.batch, "source": self.source,
                "device": self.device, "dilation": self.dilation, "byte_scale": self.byte_scale,
                "notes": self.notes,
                "layers": [{"name": layer.name, "forward_s": layer.forward_s, "backward_s": layer.backward_s,
                            "params": [[n, list(s)] for n, s in layer.params]} for layer in self.layers]}

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    def describe(self) -> str:
        """One line: name, size, compute at its batch, what it stands for."""
        return (f"profile {self.name}: {len(self.layers)} layers, {self.numel / 1e6:.2f} M parameters "
                f"({self.grad_bytes() / 2**20:.1f} MiB of fp32 gradients), forward {self.forward_s * 1e3:.1f} ms + "
                f"backward {self.backward_s * 1e3:.1f} ms at batch {self.batch}"
                + (f", {self.device}" if self.device else "")
                + (f"; dilated x{self.dilation:g} in time, x{self.byte_scale:g} in bytes"
                   if (self.dilation, self.byte_scale) != (1.0, 1.0) else ""))


def _cumulative(times: list[float], factor: float) -> list[float]:
    out, t = [], 0.0
    for x in times:
        t += x * factor
        out.append(t)
    return out


def from_dict(data, where: str) -> Profile:
    """A Profile from its JSON form, or one line saying what is wrong and where."""
    def bad(why: str):
        return PsrtError(f"--profile {where}: {why}", everywhere=True)
    if not isinstance(data, dict):
        raise bad("expected a JSON object with name, batch and layers")
    if data.get("format", FORMAT) != FORMAT:
        raise bad(f"format {data.get('format')!r}, expected {FORMAT!r}")
    for key in ("name", "batch", "layers"):
        if key not in data:
            raise bad(f"missing {key!r}")
    batch = data["batch"]
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise bad(f"batch {batch!r}: must be a positive whole number of samples")
    if not isinstance(data["layers"], list) or not data["layers"]:
        raise bad("layers: expected a non-empty list")
    layers, names = [], set()
    for i, entry in enumerate(data["layers"]):
        if not isinstance(entry, dict):
            raise bad(f"layer {i}: expected an object with name, params, forward_s, backward_s")
        name = entry.get("name", f"layer{i}")
        for key in ("forward_s", "backward_s"):
            value = entry.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value >= 0 and math.isfinite(value)):
                raise bad(f"layer {name!r}: {key} {value!r} must be a non-negative number of seconds")
        params = entry.get("params", [])
        checked = []
        for p in params if isinstance(params, list) else [None]:
            ok = (isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], list)
                  and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in p[1]))
            if not ok:
                raise bad(f"layer {name!r}: a parameter is [name, [positive dims...]], got {p!r}")
            full = f"{name}.{p[0]}"
            if full in names:
                raise bad(f"parameter {full!r} is listed twice")
            names.add(full)
            checked.append((p[0], tuple(p[1])))
        layers.append(Layer(name, tuple(checked), float(entry["forward_s"]), float(entry["backward_s"])))
    if not any(layer.params for layer in layers):
        raise bad("no layer has parameters: nothing to train or to reduce")
    return Profile(str(data["name"]), batch, tuple(layers), str(data.get("source", "")),
                   str(data.get("device", "")), float(data.get("dilation", 1.0)),
                   float(data.get("byte_scale", 1.0)), dict(data.get("notes", {})))


def shipped() -> list[str]:
    """The names of the profiles psrt ships (profiles/NAME.json)."""
    return sorted(f[:-5] for f in os.listdir(HERE) if f.endswith(".json")) if os.path.isdir(HERE) else []


def load(name_or_path: str) -> Profile:
    """A shipped profile by name, or a profile file; bad input is one line."""
    path = name_or_path
    if os.path.sep not in name_or_path and not name_or_path.endswith(".json"):
        path = os.path.join(HERE, name_or_path + ".json")
        if not os.path.exists(path):
            raise PsrtError(f"--profile {name_or_path!r}: choose one of {', '.join(shipped())}, or give a "
                            "profile file (.json)", everywhere=True)
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as err:
        raise PsrtError(f"--profile {name_or_path}: cannot read it ({err.strerror or err})", everywhere=True) from None
    except json.JSONDecodeError as err:
        raise PsrtError(f"--profile {name_or_path}: not JSON ({err.msg}, line {err.lineno})", everywhere=True) from None
    return from_dict(data, name_or_path)
