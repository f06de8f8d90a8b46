"""The user's own model and data set for `python -m psrt.train`, named by import path.

    python -m psrt.train --model mypkg.models:build_model --data mypkg.data:build_dataset

The contract (docs/how-to/training.md, "Your own model and data"):

- `--model module:callable`: `callable(dataset)` or `callable()` returns a torch.nn.Module
  (the data set is passed when the callable takes an argument: a psrt.train.data.Dataset, so
  `dataset.input_shape` and `dataset.classes` can size the model).  Every rank calls it after
  seeding torch with --seed; rank 0's parameters are given to every rank anyway.
- `--data module:callable`: `callable()` returns a psrt.train.data.Dataset, or a pair
  (train, test) whose parts are each a map-style torch Dataset of (input, target) samples
  or an (inputs, targets) pair of tensors.  Samples are stacked into tensors once.
- The loss is cross-entropy (targets: class indices, one per sample, or one per position
  for sequences), unless the module of --model defines `loss(output, target)` returning the
  batch's mean loss as a scalar tensor.  Accuracy is reported where targets are class
  indices shaped like the output without its last dimension.

Either may be one of psrt's own names instead (models.py, data.py).  Everything that can
go wrong with a path, an import or a return value is one line, exit 2, on every rank alike.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Callable

import torch

from psrt.errors import PsrtError
from psrt.faults import describe
from psrt.train import data, models
from psrt.train.config import TrainConfig, is_import_path

DATA_CONTRACT = ("a psrt.train.data.Dataset, or a pair (train, test) of map-style torch Datasets "
                 "of (input, target) samples or of (inputs, targets) tensor pairs")


def resolve(flag: str, path: str) -> Callable:
    """The callable `module:name` names (`name` may be dotted), or a one-line PsrtError."""
    module_name, _, attr = path.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except Exception as err:   # noqa: BLE001 - whatever the module raised, one line naming it
        why = f"{type(err).__name__}: {err}" if isinstance(err, (ImportError, SyntaxError)) else describe(err)
        raise PsrtError(f"{flag} {path}: cannot import {module_name} ({why})", everywhere=True) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PsrtError(f"{flag} {path}: module {module_name} has no attribute {attr!r}",
                            everywhere=True)
        obj = getattr(obj, part)
    if not callable(obj):
        raise PsrtError(f"{flag} {path}: {attr} is not callable (type {type(obj).__name__})", everywhere=True)
    return obj


def _call(flag: str, path: str, fn: Callable, *args):
    try:
        return fn(*args)
    except PsrtError:
        raise
    except Exception as err:   # noqa: BLE001 - the user's code failed: say where, in one line
        raise PsrtError(f"{flag} {path} failed: {describe(err)}", everywhere=True) from None


def check(cfg: TrainConfig) -> None:
    """Import what --model and --data name before any data is loaded (every rank alike)."""
    if is_import_path(cfg.model):
        resolve("--model", cfg.model)
    if is_import_path(cfg.data):
        resolve("--data", cfg.data)


def load_data(name: str, seq_len: int = 64) -> data.Dataset:
    """psrt's data set `name`, or the one `module:callable` returns (see the module doc)."""
    if not is_import_path(name):
        return data.load(name, seq_len)
    got = _call("--data", name, resolve("--data", name))
    if isinstance(got, data.Dataset):
        return got
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        raise PsrtError(f"--data {name} returned {_kind(got)}; expected {DATA_CONTRACT}", everywhere=True)
    (train_x, train_y), (test_x, test_y) = (_tensors(name, part, which) for part, which in zip(got, ("train", "test")))
    if len(train_x) == 0:
        raise PsrtError(f"--data {name}: the training set is empty", everywhere=True)
    if train_x.shape[1:] != test_x.shape[1:] and len(test_x):
        raise PsrtError(f"--data {name}: train inputs are shaped {tuple(train_x.shape[1:])}, test inputs "
                        f"{tuple(test_x.shape[1:])}", everywhere=True)
    if train_y.is_floating_point() or train_y.dtype == torch.bool:
        task, classes = "other", 0
    else:
        task = "classify" if train_y.dim() == 1 else "lm"
        classes = int(max(train_y.max(), test_y.max() if len(test_y) else 0)) + 1
    return data.Dataset(name, task, train_x, train_y, test_x, test_y, classes=classes)


def _tensors(name: str, part, which: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of one part of a user's data set, stacked."""
    if isinstance(part, (tuple, list)) and len(part) == 2 and all(torch.is_tensor(t) for t in part):
        x, y = part
    elif isinstance(part, torch.utils.data.TensorDataset) and len(part.tensors) == 2:
        x, y = part.tensors
    elif isinstance(part, torch.utils.data.Dataset) and hasattr(part, "__len__"):
        samples = [part[i] for i in range(len(part))]
        if not all(isinstance(s, (tuple, list)) and len(s) == 2 for s in samples):
            raise PsrtError(f"--data {name}: the {which} set's samples must be (input, target) pairs",
                            everywhere=True)
        try:
            x = torch.stack([torch.as_tensor(s[0]) for s in samples]) if samples else torch.empty(0)
            y = torch.stack([torch.as_tensor(s[1]) for s in samples]) if samples else torch.empty(0, dtype=torch.long)
        except (RuntimeError, TypeError, ValueError) as err:
            raise PsrtError(f"--data {name}: the {which} set's samples do not stack into tensors "
                            f"({describe(err)})", everywhere=True) from None
    else:
        raise PsrtError(f"--data {name} returned a {which} set of {_kind(part)}; expected {DATA_CONTRACT}",
                        everywhere=True)
    if len(x) != len(y):
        raise PsrtError(f"--data {name}: the {which} set has {len(x)} inputs but {len(y)} targets",
                        everywhere=True)
    return x, y


def make_model(cfg: TrainConfig, dataset: data.Dataset) -> torch.nn.Module:
    """psrt's model --model names, or the one `module:callable` builds."""
    if not is_import_path(cfg.model):
        return models.build_model(cfg.model, dataset, cfg.width, cfg.layers, cfg.recompute)
    build = resolve("--model", cfg.model)
    try:
        inspect.signature(build).bind(dataset)
        args = (dataset,)
    except (TypeError, ValueError):    # takes no argument (or has no signature to read)
        args = ()
    model = _call("--model", cfg.model, build, *args)
    if not isinstance(model, torch.nn.Module):
        raise PsrtError(f"--model {cfg.model} returned {_kind(model)}; expected a torch.nn.Module",
                        everywhere=True)
    return model


def loss_of(cfg: TrainConfig, dataset: data.Dataset) -> Callable | None:
    """`loss(output, target)` of the module of --model, or None for cross-entropy."""
    loss = None
    if is_import_path(cfg.model):
        module = importlib.import_module(cfg.model.partition(":")[0])
        loss = getattr(module, "loss", None)
        if loss is not None and not callable(loss):
            raise PsrtError(f"--model {cfg.model}: the module's `loss` is not a function loss(output, "
                            f"target) (type {type(loss).__name__})", everywhere=True)
    if loss is None and dataset.task == "other":
        raise PsrtError(f"--data {cfg.data} has {dataset.train_y.dtype} targets; cross-entropy needs class "
                        "indices: define loss(output, target) in the module of --model", everywhere=True)
    return loss


def _kind(obj) -> str:
    return "None" if obj is None else f"a {type(obj).__name__}"
