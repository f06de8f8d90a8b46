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
import os
import re
import tempfile
import typing
from dataclasses import dataclass, field

from psrt.collectives.algorithms import ALGORITHMS
from psrt.dp import COMPRESSIONS, DEFAULT_LR, OPTIMIZERS, OPTION_TAKERS, STRATEGIES
from psrt.errors import ArgumentParser, PsrtError

DEFAULT_BATCH = 64

# The models and data sets psrt.train offers (models.py and data.py build them by these names).
# --model and --data also take the user's own as an import path, `module:callable` (custom.py).
MODELS = ("mlp", "cnn", "transformer", "moe")
MOE_DISPATCH = ("variable", "padded")
DATASETS = ("digits", "text", "synthetic")
IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")

# Fields that are options of the data-parallel strategies (psrt.dp: each strategy's Options).
STRATEGY_FLAGS = tuple(OPTION_TAKERS)


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
                                "strategy's own, e.g. ring for --dp ring)", "strategy",
                                ("auto",) + ALGORITHMS["allreduce"])
    bucket_mb: float | None = opt(None, "gradient bucket size in MiB (default: 25 as in PyTorch DDP; zero2: "
                                  "25 or an eighth of the gradient, whichever is smaller)",
                           "strategy", metavar="MB")
    overlap: bool = opt(True, "all-reduce each bucket during backward, as soon as it is ready; zero3: "
                        "prefetch the next unit's parameters (--no-overlap: neither)", "strategy")
    compress: str = opt("none", "dtype communicated gradients travel in", "strategy", COMPRESSIONS)
    servers: int | None = opt(None, "dedicated parameter-server ranks (0: rank 0 serves and trains).  "
                              "Default: the strategy's own (0 for ps and ps-sharded, 1 for ps-async)",
                              "strategy", metavar="S")
    local_aggregation: bool = opt(False, "ps: each host's ranks sum their gradients on its first rank, "
                                  "which alone talks to the server (BytePS's local aggregation)", "strategy")
    backup_workers: int = opt(0, "ps: each step the server takes the first N-1-B other workers' gradients "
                              "and leaves out the B slowest (Chen et al. 2016)", "strategy", metavar="B")
    offload_optimizer: bool | None = opt(None, "keep the optimizer state and the fp32 master copy "
                                         "of this rank's parameters in host memory and update there "
                                         "(ZeRO-Offload; for CUDA models)", "strategy")
    staleness: int | None = opt(None, "bounded staleness of ps-async: how many steps a worker may run "
                                "ahead of the slowest (default 0)", "strategy", metavar="S")
    pp: int = opt(1, "pipeline-parallel degree: the transformer cut into N stages (1F1B schedule, "
                  "--accum micro-batches); needs --model transformer", "strategy", metavar="N")
    tp: int = opt(1, "tensor-parallel degree: each stage's layers split over N ranks (Megatron-style)",
                  "strategy", metavar="N")
    sequence_parallel: bool = opt(False, "with --tp: keep the activations between the tensor-parallel "
                                  "layers split along the sequence (Megatron-LM's sequence parallelism)",
                                  "strategy")
    ep: int = opt(1, "expert-parallel degree (--model moe): the experts spread over N ranks, carved out of "
                  "the data-parallel ranks", "strategy", metavar="N")
    # --- model and data
    model: str = opt("mlp", "model to train: " + ", ".join(MODELS) + ", or your own as module:callable "
                     "returning an nn.Module (see docs/how-to/training.md)", "model", metavar="NAME")
    data: str | None = opt(None, "data set: " + ", ".join(DATASETS) + ", or your own as module:callable "
                           "(default: digits, or text for --model transformer)", "model", metavar="NAME")
    width: int = opt(0, "hidden units (mlp), 8 x channels (cnn) or model dimension (transformer); "
                     "0: the model's default (128, 128, 64)", "model", metavar="N")
    layers: int = opt(0, "hidden layers (mlp) or blocks (transformer); 0: default (1, 2)", "model", metavar="N")
    recompute: bool = opt(False, "activation recomputation: keep only each transformer block's input and "
                          "run the block again in backward (transformer, moe)", "model")
    profile: str | None = opt(None, "emulate an accelerator's compute from a model profile (a shipped "
                              "name: resnet50, vgg16, gpt2-small, bert-base; or a .json file): its real parameters, "
                              "timed waits instead of arithmetic, each gradient when its backward would produce "
                              "it (see docs/explanation/scaling.md)", "model", metavar="NAME|FILE")
    time_dilation: float = opt(1.0, "with --profile: multiply every compute time by D, so that a slow "
                               "emulated link keeps a faster real cluster's ratio of compute to communication "
                               "(D = real link rate / (K x emulated link rate); latency is not dilated)", "model",
                               metavar="D")
    byte_divisor: float = opt(1.0, "with --profile: divide every gradient tensor's size by K (memory and "
                              "link time shrink together; see --time-dilation)", "model", metavar="K")
    real_arithmetic: bool = opt(False, "with --profile: run --model's real forward and backward, timed by "
                                "the profile (it must list the model's parameters: a recorded one)", "model")
    seq_len: int = opt(64, "characters per training window (--data text)", "model", metavar="N")
    experts: int = opt(0, "experts per MoE layer (--model moe; 0: 4)", "model", metavar="E")
    top_k: int = opt(1, "experts per token (--model moe): 1 (Switch) or 2 (GShard)", "model", metavar="K")
    capacity_factor: float = opt(1.25, "expert capacity = factor x tokens x top-k / experts, per rank; "
                                 "tokens over it are dropped and counted (--model moe)", "model", metavar="C")
    aux_weight: float = opt(0.01, "weight alpha of the load-balancing loss alpha E sum f_i P_i (--model moe)",
                            "model", metavar="A")
    moe_dispatch: str = opt("variable", "all-to-all shape of --model moe: variable (counts first, then "
                            "the rows) or padded (every expert's full capacity)", "model", MOE_DISPATCH)
    # --- optimisation
    steps: int = opt(0, "optimizer steps to run (overrides --epochs when > 0)", "training", metavar="N")
    epochs: int = opt(3, "passes over the training set (used when --steps is 0)", "training", metavar="N")
    batch_size: int | None = opt(None, "GLOBAL batch size: samples per optimizer step over all workers; "
                                 "it means the same for any number of ranks (default: 64, rounded up to a "
                                 "multiple of workers x --accum)", "training", metavar="B")
    lr: float | None = opt(None, "learning rate for the global batch, not scaled by the number of "
                           "ranks (default: 0.1 for sgd, 0.003 for adam)", "training", metavar="LR")
    optimizer: str = opt("sgd", "optimizer", "training", OPTIMIZERS)
    device: str = opt("cpu", "where each rank's model and batches live: cpu, cuda (GPU local rank modulo "
                      "the GPUs visible), auto (cuda where a GPU is visible)", "training", ("cpu", "cuda", "auto"))
    precision: str = opt("fp32", "compute dtype: bf16 or fp16 run the forward under autocast with fp32 master "
                         "weights; fp16 scales the loss dynamically (GradScaler's rules), every rank skipping "
                         "the same overflowing steps", "training", ("fp32", "bf16", "fp16"))
    momentum: float = opt(0.9, "SGD momentum", "training", metavar="M")
    weight_decay: float = opt(0.0, "L2 weight decay", "training", metavar="WD")
    accum: int = opt(1, "micro-batches per step on each worker (gradient accumulation)", "training", metavar="K")
    seed: int = opt(0, "seed for initialisation and sample order", "training", metavar="N")
    timeout_s: float | None = opt(None, "seconds a collective may wait (or a rank stay silent) before the "
                                "watchdog names the stuck ranks and ends the job (default: PSRT_TIMEOUT, "
                                "else 300)", "training", metavar="S", flag="--timeout")
    # --- output
    metrics: str | None = opt(None, "write JSONL metrics here: one line per step and a summary", "output", metavar="FILE")
    trace: str | None = opt(None, "write a Chrome-trace timeline of every rank here (chrome://tracing, "
                            "ui.perfetto.dev; python -m psrt.trace FILE --png OUT draws it)", "output", metavar="FILE")
    save: str | None = opt(None, "save the final parameters (a state_dict) here", "output", metavar="FILE")
    checkpoint: str | None = opt(None, "checkpoint file (written atomically)", "output", metavar="FILE")
    checkpoint_every: int = opt(0, "write --checkpoint every K steps (0: only at the end)", "output", metavar="K")
    resume: bool = opt(False, "continue from --checkpoint", "output")
    quiet: bool = opt(False, "no progress output and no column legend: the summary table and the notes "
                             "under it (the memory ledger; with several --dp, the alpha-beta model's view)", "output")
    tensorboard: str | None = opt(None, "write a TensorBoard log here, a run directory per strategy (DIR/<dp>): "
                                  "loss, throughput, compute and communication time, bytes per axis, loss "
                                  "scale per step, and the hyper-parameters (needs the tensorboard package)",
                                  "output", metavar="DIR")
    callback: str | None = opt(None, "your own components of the training loop, as module:Class (a comma "
                               "list for several): subclasses of psrt.train.events.Callback, made with no "
                               "arguments on every rank (see docs/how-to/training.md)", "output", metavar="MOD:CLASS")

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
        non_negative = ("steps", "width", "layers", "staleness", "checkpoint_every", "backup_workers", "momentum", "weight_decay")
        # A batch the user gave must split evenly; the default adapts (plan_batch).
        self.batch_size_given = self.batch_size is not None
        if self.batch_size is None:
            self.batch_size = DEFAULT_BATCH
        for name in positive:
            if getattr(self, name) < 1:
                raise PsrtError(f"{flag(name)} {getattr(self, name)}: must be at least 1", everywhere=True)
        for name in non_negative + ("servers",):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise PsrtError(f"{flag(name)} {getattr(self, name)}: must not be negative", everywhere=True)
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise PsrtError(f"--timeout {self.timeout_s}: must be a positive number of seconds", everywhere=True)
        if self.bucket_mb is not None and not self.bucket_mb > 0:
            raise PsrtError(f"--bucket-mb {self.bucket_mb}: must be positive", everywhere=True)
        self.lr = DEFAULT_LR[self.optimizer] if self.lr is None else self.lr
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise PsrtError(f"--lr {self.lr}: must be a positive finite number", everywhere=True)
        for name in ("momentum", "weight_decay", "bucket_mb"):
            if getattr(self, name) is not None and not math.isfinite(getattr(self, name)):
                raise PsrtError(f"{flag(name)} {getattr(self, name)}: must be finite", everywhere=True)
        check_name("model", self.model, MODELS)
        if self.data is None:
            self.data = "text" if self.model in ("transformer", "moe") else "digits"
        check_name("data", self.data, DATASETS)
        own = is_import_path(self.model) or is_import_path(self.data)   # checked when built
        for name in ("width", "layers"):
            if is_import_path(self.model) and getattr(self, name):
                raise PsrtError(f"{flag(name)} shapes psrt's own models; --model {self.model} builds "
                                "its own", everywhere=True)
        if not own and (self.model in ("transformer", "moe")) != (self.data == "text"):
            raise PsrtError(f"--model {self.model} cannot train on --data {self.data}: the transformers "
                            "(transformer, moe) need --data text, and text needs one of them", everywhere=True)
        self.check_moe(own)
        self.check_profile()
        if self.sequence_parallel and self.tp == 1:
            raise PsrtError("--sequence-parallel splits the sequence over the tensor-parallel ranks: "
                            "it needs --tp 2 or more", everywhere=True)
        if self.recompute and self.model not in ("transformer", "moe"):
            raise PsrtError(f"--recompute recomputes transformer blocks; --model {self.model} has none "
                            "(use --model transformer or moe)", everywhere=True)
        if self.pp * self.tp != 1 and self.model not in ("transformer", "moe"):
            raise PsrtError(f"--pp {self.pp} --tp {self.tp}: model parallelism splits the transformer; "
                            f"use --model transformer or moe (got --model {self.model})", everywhere=True)
        self.check_outputs()

    def check_profile(self) -> None:
        """--profile and the flags it needs or excludes, each a one-line error."""
        if self.profile is None:
            for name in ("real_arithmetic", "time_dilation", "byte_divisor"):
                if self.given(name):
                    raise PsrtError(f"{flag(name)} changes a profile's emulated compute: it needs --profile",
                                    everywhere=True)
            return
        if not (self.time_dilation > 0 and math.isfinite(self.time_dilation)):
            raise PsrtError(f"--time-dilation {self.time_dilation}: must be a positive finite number", everywhere=True)
        if not (self.byte_divisor >= 1 and math.isfinite(self.byte_divisor)):
            raise PsrtError(f"--byte-divisor {self.byte_divisor}: must be a finite number of at least 1",
                            everywhere=True)
        if self.real_arithmetic and self.byte_divisor != 1:
            raise PsrtError("--byte-divisor resizes a profile's tensors; --real-arithmetic keeps the model's own "
                            "(use --time-dilation alone)", everywhere=True)
        if self.pp * self.tp != 1 or self.model == "moe":
            raise PsrtError("--profile emulates the whole model on every rank; with --pp, --tp or --model moe "
                            "the layers are split over ranks, which a profile does not describe", everywhere=True)
        if not self.real_arithmetic and self.data == "text":
            raise PsrtError("--profile without --real-arithmetic emulates a classifier's loss: use --data "
                            "digits or synthetic (the data only seeds the gradients)", everywhere=True)
        for name in ("width", "layers", "recompute"):
            if self.given(name) and not self.real_arithmetic:
                raise PsrtError(f"{flag(name)} shapes --model; --profile {self.profile} without --real-arithmetic "
                                "takes its shapes from the profile", everywhere=True)
        from psrt.train.profile import load
        load(self.profile)                     # a bad name or file: one line now, not on every rank later

    def check_outputs(self) -> None:
        """The output flags that need one another, and --callback's names (imported later)."""
        if self.resume and not self.checkpoint:
            raise PsrtError("--resume needs --checkpoint FILE (the checkpoint to continue from)",
                            everywhere=True)
        if self.checkpoint_every and not self.checkpoint:
            raise PsrtError("--checkpoint-every needs --checkpoint FILE", everywhere=True)
        for name in self.callback.split(",") if self.callback is not None else ():
            if not IMPORT_PATH.fullmatch(name.strip()):
                raise PsrtError(f"--callback {name.strip()!r}: expected module:Class with a dotted module "
                                "name and a class's name (e.g. mypkg.hooks:StepCounter)", everywhere=True)

    def check_moe(self, own: bool) -> None:
        """--model moe and its flags: each a one-line error, before anything starts."""
        moe_flags = [n for n in ("experts", "top_k", "capacity_factor", "aux_weight", "moe_dispatch", "ep")
                     if self.given(n)]
        if self.model != "moe":
            if moe_flags:
                raise PsrtError(f"{', '.join(flag(n) for n in moe_flags)}: for --model moe only", everywhere=True)
            return
        self.experts = self.experts or 4
        if self.top_k < 1 or self.top_k > self.experts:
            raise PsrtError(f"--top-k {self.top_k}: must be between 1 and --experts {self.experts}", everywhere=True)
        if not (self.capacity_factor > 0 and math.isfinite(self.capacity_factor)):
            raise PsrtError(f"--capacity-factor {self.capacity_factor}: must be a positive number", everywhere=True)
        if not (self.aux_weight >= 0 and math.isfinite(self.aux_weight)):
            raise PsrtError(f"--aux-weight {self.aux_weight}: must be a non-negative number", everywhere=True)
        if self.ep < 1:
            raise PsrtError(f"--ep {self.ep}: must be a positive whole number", everywhere=True)
        if self.sequence_parallel:
            raise PsrtError("--sequence-parallel with --model moe: the MoE layers take whole sequences "
                            "(every TP rank routes the same tokens)", everywhere=True)
        if self.algorithm in ("torch", "nccl"):
            raise PsrtError(f"--algorithm {self.algorithm} with --model moe: the gradients reduce over psrt's own groups "
                            "(dp, edp); choose one of psrt's algorithms", everywhere=True)

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


def is_import_path(name: str) -> bool:
    """Whether --model/--data `name` names the user's own, as `module:callable`."""
    return ":" in name


def check_name(field_name: str, value: str, builtin: tuple[str, ...]) -> None:
    """A built-in name, or a well-formed `module:callable` (imported later: no torch here)."""
    example = {"model": "mypkg.models:build_model", "data": "mypkg.data:build_dataset"}[field_name]
    if value in builtin:
        return
    if not is_import_path(value):
        raise PsrtError(f"--{field_name} {value!r}: choose one of {', '.join(builtin)}, or name your "
                        f"own as module:callable (e.g. {example})", everywhere=True)
    if not IMPORT_PATH.fullmatch(value):
        raise PsrtError(f"--{field_name} {value!r}: expected module:callable with a dotted module "
                        f"name and a callable's name (e.g. {example})", everywhere=True)


def check_paths(cfg: TrainConfig) -> None:
    """Fail before training, not after it, when an output cannot be written: its directory
    (made if missing) must take a new file (a read-only one, or one on a read-only file system, is
    refused now rather than at the first checkpoint or the final save)."""
    for name in ("metrics", "trace", "save", "checkpoint", "tensorboard"):
        path = getattr(cfg, name)
        if not path:
            continue
        directory = os.path.dirname(os.path.abspath(path))
        if name == "tensorboard":                  # a directory, made if need be
            if os.path.exists(path) and not os.path.isdir(path):
                raise PsrtError(f"--tensorboard {path}: is a file, expected a directory", everywhere=True)
            directory = path if os.path.isdir(path) else directory
        if not os.path.isdir(directory):
            # made as `mkdir -p` would (a fresh checkout has no out/), before the first step
            try:
                os.makedirs(directory, exist_ok=True)
            except OSError as err:
                raise PsrtError(f"{flag(name)} {path}: cannot make directory {directory} "
                                f"({err.strerror or err})", everywhere=True) from None
        if name != "tensorboard" and os.path.isdir(path):
            raise PsrtError(f"{flag(name)} {path}: is a directory, expected a file name", everywhere=True)
        why = unwritable(directory)
        if why:
            raise PsrtError(f"{flag(name)} {path}: cannot write in {directory} ({why})", everywhere=True)


def unwritable(directory: str) -> str | None:
    """Why no file can be made in `directory`, or None: a real attempt, since permission bits
    say nothing of a read-only file system, nor of root."""
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".psrt-probe-")
    except OSError as err:
        return err.strerror or str(err)
    os.close(fd)
    os.unlink(probe)
    return None


def plan_batch(cfg: TrainConfig, world_size: int) -> str | None:
    """Fit the global batch to the workers of every strategy of --dp before any of them trains
    (no torch needed).  A --batch-size that does not split evenly over a strategy's workers x
    --accum is a one-line error naming the strategy; the default batch is rounded up to a
    multiple of all of them, the same for every strategy so their rows compare.  Returns what
    to tell the user, or None."""
    from psrt.dp.roles import num_workers
    from psrt.grid import check_ep, infer_dp
    if cfg.pp * cfg.tp != 1:
        try:
            dp = infer_dp(world_size, cfg.pp, cfg.tp)
        except PsrtError as err:
            raise PsrtError(f"--pp {cfg.pp} --tp {cfg.tp}: {err}", everywhere=True) from None
        workers = {f"{d} on dp={dp}": dp for d in cfg.dp_list}
        grid = f"{world_size} ranks / (--pp {cfg.pp} x --tp {cfg.tp})"
    elif cfg.model == "moe":          # every rank trains: dp is the world
        dp, grid = world_size, f"{world_size} ranks"
        workers = {d: dp for d in cfg.dp_list}
    else:
        workers = {d: num_workers(d, world_size, cfg.servers) for d in cfg.dp_list}
    if cfg.model == "moe":
        try:
            check_ep(cfg.ep, dp)
        except PsrtError as err:
            raise PsrtError(f"{err} (here {grid})", everywhere=True) from None
        # after the ranks: --ep 8 on 4 ranks is about the ranks, whatever the experts
        if cfg.experts % cfg.ep:
            raise PsrtError(f"--experts {cfg.experts} does not split over --ep {cfg.ep}: every rank of an "
                            "expert-parallel group holds experts/ep experts", everywhere=True)
    unit = math.lcm(*(w * cfg.accum for w in workers.values()))
    mb = f"{cfg.accum} micro-batch{'es' * (cfg.accum != 1)} (--accum)"
    if cfg.batch_size_given:
        for d, w in workers.items():
            if cfg.batch_size % (w * cfg.accum):
                raise PsrtError(f"--batch-size {cfg.batch_size} does not split evenly over the {w} "
                                f"worker{'s' * (w != 1)} of --dp {d} x {mb}: use a multiple of {unit}",
                                everywhere=True)
        return None
    cfg.batch_size = -(-DEFAULT_BATCH // unit) * unit
    if cfg.batch_size == DEFAULT_BATCH:
        return None
    counts = ", ".join(sorted({str(w) for w in workers.values()}))
    return (f"global batch {cfg.batch_size}: the default {DEFAULT_BATCH} rounded up to split over "
            f"{counts} worker{'s' * (counts != '1')} x {mb}; --batch-size sets it")


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
                     epilog="example: ./mpi_launch -np 4 python -m psrt.train --dp ps,ring --model cnn")
    hints = typing.get_type_hints(TrainConfig)
    groups = {}
    for name, f in _fields():
        meta = f.metadata
        group = groups.setdefault(meta["group"], parser.add_argument_group(meta["group"]))
        kind = _base_type(hints[name])
        # a strategy option names the strategies that take it, in every layout they train in
        takers = [d for d in OPTION_TAKERS.get(name, ()) if d != "zero"]
        text = meta["help"] + (f"; --dp {', '.join(takers)}" if takers else "")
        kwargs = {"default": f.default, "help": text + (
            f" (default: {f.default})" if f.default not in (None, False, True) else "")}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
            if f.default:
                kwargs["help"] = text
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
