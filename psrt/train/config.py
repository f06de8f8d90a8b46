"""Training configuration: one validated dataclass, from which the command line is generated.

Each field carries its help text, flag group and choices in `metadata`, so `--help`, the
parser and the checks never drift apart (the torchtitan habit: a docstring per field).
Validation happens in `__post_init__`, so a bad value is refused however the config was
built, with a one-line message that names the flag.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from dataclasses import dataclass, field

from psrt.collectives import ALL_ALGORITHMS
from psrt.dp import STRATEGIES
from psrt.dp.common import COMPRESS, DEFAULT_LR, OPTIMIZERS
from psrt.errors import ArgumentParser, PsrtError
from psrt.train.data import DATASETS
from psrt.train.models import MODELS

# Fields that are options of the data-parallel strategies (psrt.dp: each strategy's Options).
STRATEGY_FLAGS = ("algorithm", "bucket_mb", "overlap", "compress", "servers", "staleness")


def opt(default, help: str, group: str, choices=None, metavar=None, flag=None):
    """A field with its command-line help; `flag` when the flag is not --field-name."""
    return field(default=default, metadata={"help": help, "group": group, "choices": choices,
                                            "metavar": metavar, "flag": flag})


@dataclass
class TrainConfig:
    # --- strategy
    dp: str = opt("ring", "data-parallel strategy, or a comma list (e.g. ps,ring) trained in turn "
                  "and compared side by side; one of " + ", ".join(STRATEGIES), "strategy", metavar="NAME[,NAME]")
    algorithm: str | None = opt(None, "collective algorithm of the gradient reducer (default: the "
                                "strategy's own, e.g. ring for --dp ring)", "strategy", ALL_ALGORITHMS)
    bucket_mb: float = opt(25.0, "gradient bucket size in MiB (ring, native, torch); 25 as in PyTorch DDP",
                           "strategy", metavar="MB")
    overlap: bool = opt(True, "all-reduce each bucket during backward, as soon as it is ready "
                        "(--no-overlap: after backward)", "strategy")
    compress: str = opt("none", "dtype communicated gradients travel in", "strategy", tuple(COMPRESS))
    servers: int | None = opt(None, "dedicated parameter-server ranks (ps, ps-sharded, ps-async; "
                              "0: rank 0 serves and trains).  Default: the strategy's own (0 for ps "
                              "and ps-sharded, 1 for ps-async)", "strategy", metavar="S")
    staleness: int | None = opt(None, "bounded staleness of ps-async: how many steps a worker may run "
                                "ahead of the slowest (default 0)", "strategy", metavar="S")
    pp: int = opt(1, "pipeline-parallel degree: the transformer cut into N stages (1F1B schedule, "
                  "--accum micro-batches); needs --model transformer", "strategy", metavar="N")
    tp: int = opt(1, "tensor-parallel degree: each stage's layers split over N ranks (Megatron-style)",
                  "strategy", metavar="N")
    # --- model and data
    model: str = opt("mlp", "model to train", "model", MODELS)
    data: str | None = opt(None, "data set (default: digits, or text for --model transformer)",
                           "model", DATASETS)
    width: int = opt(0, "hidden units (mlp), 8 x channels (cnn) or model dimension (transformer); "
                     "0: the model's default (128, 128, 64)", "model", metavar="N")
    layers: int = opt(0, "hidden layers (mlp) or blocks (transformer); 0: default (1, 2)", "model", metavar="N")
    seq_len: int = opt(64, "characters per training window (--data text)", "model", metavar="N")
    # --- optimisation
    steps: int = opt(0, "optimizer steps to run (overrides --epochs when > 0)", "training", metavar="N")
    epochs: int = opt(3, "passes over the training set (used when --steps is 0)", "training", metavar="N")
    batch_size: int = opt(64, "GLOBAL batch size: samples per optimizer step over all workers; it "
                          "means the same for any number of ranks", "training", metavar="B")
    lr: float | None = opt(None, "learning rate for the global batch, not scaled by the number of "
                           "ranks (default: 0.1 for sgd, 0.003 for adam)", "training", metavar="LR")
    optimizer: str = opt("sgd", "optimizer", "training", OPTIMIZERS)
    momentum: float = opt(0.9, "SGD momentum", "training", metavar="M")
    weight_decay: float = opt(0.0, "L2 weight decay", "training", metavar="WD")
    accum: int = opt(1, "micro-batches per step on each worker (gradient accumulation)", "training", metavar="K")
    seed: int = opt(0, "seed for initialisation and sample order", "training", metavar="N")
    timeout_s: float | None = opt(None, "seconds a collective may wait (or a rank stay silent) before the "
                                "watchdog names the stuck ranks and ends the job (default: PSRT_TIMEOUT, "
                                "else 300)", "training", metavar="S", flag="--timeout")
    # --- output
    metrics: str | None = opt(None, "write JSONL metrics here: one line per step and a summary", "output", metavar="FILE")
    save: str | None = opt(None, "save the final parameters (a state_dict) here", "output", metavar="FILE")
    checkpoint: str | None = opt(None, "checkpoint file (written atomically)", "output", metavar="FILE")
    checkpoint_every: int = opt(0, "write --checkpoint every K steps (0: only at the end)", "output", metavar="K")
    resume: bool = opt(False, "continue from --checkpoint", "output")
    quiet: bool = opt(False, "no progress output, only the summary", "output")

    def __post_init__(self):
        self.dp_list = [d.strip() for d in self.dp.split(",")]
        for d in self.dp_list:
            if d not in STRATEGIES:
                raise PsrtError(f"--dp {d!r}: choose from {', '.join(STRATEGIES)} (or a comma list)",
                                everywhere=True)
        if len(set(self.dp_list)) != len(self.dp_list):
            raise PsrtError(f"--dp {self.dp}: a strategy is listed twice", everywhere=True)
        for name, meta in _fields():
            value, choices = getattr(self, name), meta.metadata["choices"]
            if choices and value is not None and value not in choices:
                raise PsrtError(f"{flag(name)} {value!r}: choose one of {', '.join(choices)}", everywhere=True)
        positive = ("batch_size", "accum", "seq_len", "pp", "tp", "epochs")
        non_negative = ("steps", "width", "layers", "staleness", "checkpoint_every", "momentum", "weight_decay")
        for name in positive:
            if getattr(self, name) < 1:
                raise PsrtError(f"{flag(name)} {getattr(self, name)}: must be at least 1", everywhere=True)
        for name in non_negative + ("servers",):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise PsrtError(f"{flag(name)} {getattr(self, name)}: must not be negative", everywhere=True)
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise PsrtError(f"--timeout {self.timeout_s}: must be a positive number of seconds", everywhere=True)
        if self.bucket_mb <= 0:
            raise PsrtError(f"--bucket-mb {self.bucket_mb}: must be positive", everywhere=True)
        if self.lr is None:
            self.lr = DEFAULT_LR[self.optimizer]
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise PsrtError(f"--lr {self.lr}: must be a positive finite number", everywhere=True)
        for name in ("momentum", "weight_decay", "bucket_mb"):
            if not math.isfinite(getattr(self, name)):
                raise PsrtError(f"{flag(name)} {getattr(self, name)}: must be finite", everywhere=True)
        if self.data is None:
            self.data = "text" if self.model == "transformer" else "digits"
        if (self.model == "transformer") != (self.data == "text"):
            raise PsrtError(f"--model {self.model} cannot train on --data {self.data}: the transformer "
                            "needs --data text, and text needs --model transformer", everywhere=True)
        if self.resume and not self.checkpoint:
            raise PsrtError("--resume needs --checkpoint FILE (the checkpoint to continue from)",
                            everywhere=True)
        if self.checkpoint_every and not self.checkpoint:
            raise PsrtError("--checkpoint-every needs --checkpoint FILE", everywhere=True)

    def path_for(self, path: str | None, dp: str) -> str | None:
        """`path` for strategy `dp`: with several strategies, FILE.ext becomes FILE.<dp>.ext."""
        if path is None or len(self.dp_list) == 1:
            return path
        stem, dot, ext = path.rpartition(".")
        return f"{stem}.{dp}.{ext}" if dot and "/" not in ext else f"{path}.{dp}"

    def given(self, name: str) -> bool:
        """Whether field `name` differs from its default (the user set it)."""
        return getattr(self, name) != _DEFAULTS[name]

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name, _ in _fields()}


def _fields():
    return [(f.name, f) for f in dataclasses.fields(TrainConfig)]


_DEFAULTS = {name: f.default for name, f in _fields()}
_FLAGS = {name: f.metadata["flag"] for name, f in _fields() if f.metadata["flag"]}


def flag(name: str) -> str:
    """The command-line flag of field `name`."""
    meta = _FLAGS.get(name)
    return meta or "--" + name.replace("_", "-")


def _base_type(hint):
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def build_parser(prog: str = "python -m psrt.train") -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=prog, description="Train a model with data parallelism over MPI ranks "
                     "(run it under mpirun; one process works too).",
                     epilog="example: mpirun -np 4 python -m psrt.train --dp ps,ring --model cnn")
    hints = typing.get_type_hints(TrainConfig)
    groups = {}
    for name, f in _fields():
        meta = f.metadata
        group = groups.setdefault(meta["group"], parser.add_argument_group(meta["group"]))
        kind = _base_type(hints[name])
        kwargs = {"default": f.default, "help": meta["help"] + (
            f" (default: {f.default})" if f.default not in (None, False, True) else "")}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
            if f.default:
                kwargs["help"] = meta["help"]
        else:
            kwargs["type"] = kind
            if meta["choices"]:
                kwargs["choices"] = meta["choices"]
            if meta["metavar"]:
                kwargs["metavar"] = meta["metavar"]
        group.add_argument(flag(name), dest=name, **kwargs)
    return parser


def parse_args(argv=None) -> TrainConfig:
    ns = build_parser().parse_args(argv)
    return TrainConfig(**vars(ns))
