"""Emulated accelerator compute: a model profile's timing in place of the host CPU's arithmetic.

On a real accelerator the host CPU launches kernels and moves on; the forward and the
backward take the accelerator's time, and each gradient appears when the backward reaches
its layer.  Here the same is done by waiting (time.sleep: no CPU) until the moment the
profile (psrt/train/profile.py) says, so that N ranks on a few cores behave, for
communication, like N accelerators.  Two forms:

- `ProfileModel`: the profile's real parameters and nothing else.  Each layer is an autograd
  Function whose forward waits for the layer's forward to end and whose backward waits for
  the layer's gradients to be due, then returns them (a cheap fill, derived from the batch
  through the loss, so ranks' gradients differ and the strategies' averaging is exercised).
  The backward runs layer by layer in reverse, so every hook the strategies put on the
  parameters (DDP's buckets, ZeRO's reduce-scatters, the servers' pushes) fires at the
  moment it would on an accelerator: the strategies need no change.
- `time_model`: a real model (any --model) keeps its real arithmetic, and hooks hold its
  forward's end and each gradient back until the profile's time: the parameters end exactly
  as in a plain run, only the timing changes.

Waits are deadlines from the start of each pass, not durations: time the host spends
elsewhere (a hook reducing a bucket inline) overlaps the emulated compute, as the
accelerator keeps computing while the CPU communicates.
"""
from __future__ import annotations

import time

import torch
from torch import nn

from psrt.errors import PsrtError
from psrt.train.profile import Profile


class Clock:
    """The deadlines of the current micro-batch: each layer's forward end and gradient time,
    from the start of the forward and of the backward.  `log` keeps (layer, seconds after
    the backward's start) of the last backward, for tests and the bench."""

    def __init__(self, profile: Profile):
        self.profile = profile
        self.fwd_t0 = self.bwd_t0 = None
        self.ends: list[float] = []
        self.grads: list[float] = []
        self.log: list[tuple[int, float]] = []
        self.waited_s = 0.0          # seconds slept: what the host did not compute

    def start_forward(self, samples: int) -> None:
        self.fwd_t0, self.bwd_t0 = time.perf_counter(), None
        self.ends = self.profile.forward_ends(samples)
        self.grads = self.profile.gradient_times(samples)

    def wait_forward(self, layer: int) -> None:
        if self.fwd_t0 is not None:
            self._until(self.fwd_t0 + self.ends[layer])

    def start_backward(self) -> None:
        if self.fwd_t0 is not None and self.bwd_t0 is None:
            self.bwd_t0 = time.perf_counter()
            self.log = []

    def wait_backward(self, layer: int) -> None:
        if self.fwd_t0 is None:
            return
        self.start_backward()
        self._until(self.bwd_t0 + self.grads[layer])
        self.log.append((layer, time.perf_counter() - self.bwd_t0))

    def _until(self, deadline: float) -> None:
        left = deadline - time.perf_counter()
        if left > 0:
            time.sleep(left)
            self.waited_s += left


class _Emulated(torch.autograd.Function):
    """A layer of a profile: waits instead of computing, passes `h` through, and in backward
    returns its parameters' gradients when they are due."""

    @staticmethod
    def forward(ctx, h, clock, index, *params):
        ctx.clock, ctx.index = clock, index
        ctx.shapes = [(p.shape, p.dtype, p.device) for p in params]
        clock.wait_forward(index)
        return h.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.clock.wait_backward(ctx.index)
        # A fill (memset speed) with a value that depends on this rank's batch through the
        # loss: ranks differ, so what a strategy averages is checked by the parameters ending
        # equal on every rank.  Scaled down so the parameters stay small over many steps.
        value = g.detach().sum() * (1e-3 / (1 + ctx.index % 7))
        grads = [torch.empty(shape, dtype=dtype, device=device).fill_(value.to(dtype))
                 for shape, dtype, device in ctx.shapes]
        return (g, None, None, *grads)


class ProfileLayer(nn.Module):
    """One layer of a profile: its parameters, under their names ('.' becomes '_')."""

    def __init__(self, index: int, layer, clock: Clock):
        super().__init__()
        self.index, self.clock, self.names = index, clock, []
        for name, shape in layer.params:
            safe = name.replace(".", "_")
            self.register_parameter(safe, nn.Parameter(torch.empty(shape).normal_(0.0, 0.01)))
            self.names.append(safe)

    def forward(self, h):
        params = [getattr(self, n) for n in self.names]
        if not torch.is_grad_enabled():        # evaluation: no emulated time, no gradients
            return h
        return _Emulated.apply(h, self.clock, self.index, *params)


class ProfileModel(nn.Module):
    """The profile's parameters, its compute emulated (see the module).  The input is folded
    to one number per sample, carried through the layers and spread over `classes` logits,
    so that the loss (cross-entropy) and its gradient depend on the batch."""

    def __init__(self, profile: Profile, classes: int):
        super().__init__()
        self.profile = profile
        self.clock = self.emulation_clock = Clock(profile)
        self.layers = nn.ModuleList(ProfileLayer(i, layer, self.clock) for i, layer in enumerate(profile.layers))
        self.register_buffer("spread", torch.linspace(-1.0, 1.0, max(2, classes)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            self.clock.start_forward(x.shape[0])
        h = x.reshape(x.shape[0], -1).float().mean(1, keepdim=True)
        for layer in self.layers:
            h = layer(h)
        out = h * self.spread
        if out.requires_grad:        # the backward starts when the loss's gradient reaches here
            out.register_hook(lambda g: self.clock.start_backward())
        return out


def time_model(model: nn.Module, profile: Profile) -> Clock:
    """Hold `model`'s forward end and each parameter's gradient back to `profile`'s times,
    its arithmetic untouched (see the module).  The profile must list the model's trainable
    parameters, in order and shape (a profile recorded from the same --model does:
    psrt/train/recording.py).  Returns the Clock."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    listed = [(f"{layer.name}.{n}", shape, i) for i, layer in enumerate(profile.layers) for n, shape in layer.params]
    if [tuple(p.shape) for _, p in params] != [tuple(s) for _, s, _ in listed]:
        mine = ", ".join(f"{n}{list(p.shape)}" for n, p in params[:4])
        theirs = ", ".join(f"{n}{list(s)}" for n, s, _ in listed[:4])
        raise PsrtError(f"--real-arithmetic: profile {profile.name} lists {len(listed)} parameter tensors "
                        f"({theirs}, ...), the model has {len(params)} ({mine}, ...); record a profile of this "
                        "model (python -m psrt.train.recording) or drop --real-arithmetic", everywhere=True)
    clock = Clock(profile)

    def pre(module, args):
        if torch.is_grad_enabled() and args and torch.is_tensor(args[0]):
            clock.start_forward(args[0].shape[0])

    def post(module, args, output):
        if not torch.is_grad_enabled() or clock.fwd_t0 is None:
            return
        clock.wait_forward(len(profile.layers) - 1)
        if torch.is_tensor(output) and output.requires_grad:
            output.register_hook(lambda g: clock.start_backward())

    model.emulation_clock = clock            # where the bench and the tests read its log
    model.register_forward_pre_hook(pre)
    model.register_forward_hook(post)
    for (_, p), (_, _, layer) in zip(params, listed):
        # A tensor hook runs before the gradient is accumulated, so every hook a strategy put
        # after accumulation (register_post_accumulate_grad_hook) sees it at the profile's time.
        p.register_hook(lambda grad, layer=layer: clock.wait_backward(layer))
    return clock


def build_model(cfg, dataset) -> nn.Module:
    """The model of a run: --model's own, or with --profile the profile's emulated model (or
    --model timed by the profile, with --real-arithmetic)."""
    from psrt.train import imported
    from psrt.train.profile import load
    if cfg.profile is None:
        return imported.make_model(cfg, dataset)
    profile = load(cfg.profile)
    if (cfg.time_dilation, cfg.byte_divisor) != (1.0, 1.0):
        profile = profile.dilated(cfg.time_dilation, cfg.byte_divisor)
    if cfg.real_arithmetic:
        model = imported.make_model(cfg, dataset)
        time_model(model, profile)
        return model
    return ProfileModel(profile, dataset.classes)
