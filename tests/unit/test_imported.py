"""--model/--data as import paths (psrt/train/imported.py), in one process: what a user's
callables may return, how it becomes psrt's Dataset, and the one-line errors."""
import itertools
import textwrap

import pytest
import torch

from psrt.errors import PsrtError
from psrt.train import imported
from psrt.train.config import parse_args
from psrt.train.data import Dataset

_names = itertools.count()

USER = """
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

class Pairs(Dataset):
    def __init__(self, n):
        self.n = n
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        return [float(i), 2.0 * i], i % 3

def pairs():
    return Pairs(9), Pairs(3)

def tensors():
    return (torch.zeros(8, 2, 5), torch.zeros(8, 2, dtype=torch.long)), TensorDataset(torch.ones(4, 2, 5), torch.ones(4, 2, dtype=torch.long))

def regression():
    return (torch.zeros(8, 3), torch.zeros(8, 1)), (torch.zeros(2, 3), torch.zeros(2, 1))

def bad_samples():
    return Pairs(3), [1, 2, 3]

def three():
    return Pairs(3), Pairs(3), Pairs(3)

def sized(dataset):
    return nn.Linear(dataset.input_shape.numel(), dataset.classes)

class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 3)

def broken():
    raise ValueError("no weights file")

def not_a_module():
    return {"fc": 1}

class Nested:
    build = staticmethod(lambda: nn.Linear(1, 1))

number = 42
"""


@pytest.fixture
def user(tmp_path, monkeypatch):
    """A fresh module of USER (and extra source) importable under a name of its own."""
    def make(extra: str = "") -> str:
        name = f"psrt_user_mod_{next(_names)}"
        (tmp_path / f"{name}.py").write_text(USER + textwrap.dedent(extra))
        monkeypatch.syspath_prepend(str(tmp_path))
        return name
    return make


def cfg_for(model="mlp", data="digits"):
    return parse_args(["--model", model, "--data", data])


def test_a_pair_of_torch_datasets_is_stacked_into_psrt_s_dataset(user):
    mod = user()
    ds = imported.load_data(f"{mod}:pairs")
    assert isinstance(ds, Dataset) and ds.task == "classify" and ds.classes == 3 and len(ds) == 9
    assert ds.train_x.shape == (9, 2) and ds.train_x.dtype == torch.float32 and ds.test_y.tolist() == [0, 1, 2]
    model = imported.make_model(cfg_for(f"{mod}:sized", f"{mod}:pairs"), ds)   # given the data set
    assert (model.in_features, model.out_features) == (2, 3)
    assert isinstance(imported.make_model(cfg_for(f"{mod}:Plain"), ds), torch.nn.Module)   # no argument
    assert isinstance(imported.make_model(cfg_for(f"{mod}:Nested.build"), ds), torch.nn.Linear)


def test_sequence_targets_are_a_language_model_task_and_float_targets_need_a_loss(user):
    mod = user()
    seq = imported.load_data(f"{mod}:tensors")
    assert (seq.task, seq.classes, seq.input_shape) == ("lm", 2, torch.Size([2, 5]))
    reg = imported.load_data(f"{mod}:regression")
    assert reg.task == "other"
    with pytest.raises(PsrtError, match="float32 targets; cross-entropy needs class indices: define loss"):
        imported.loss_of(cfg_for("mlp", f"{mod}:regression"), reg)
    with_loss = user("\ndef loss(output, target):\n    return ((output - target) ** 2).mean()\n")
    assert imported.loss_of(cfg_for(f"{with_loss}:Plain", f"{mod}:regression"), reg).__name__ == "loss"
    assert imported.loss_of(cfg_for("mlp", f"{mod}:tensors"), seq) is None     # cross-entropy


@pytest.mark.parametrize("flag,path,words", [
    ("--model", "psrt_no_such_module_anywhere:build", "cannot import psrt_no_such_module_anywhere "
     "(ModuleNotFoundError: No module named 'psrt_no_such_module_anywhere')"),
    ("--model", "{mod}:nothing", "module {mod} has no attribute 'nothing'"),
    ("--model", "{mod}:number", "number is not callable (type int)"),
    ("--model", "{mod}:not_a_module", "{mod}:not_a_module returned a dict; expected a torch.nn.Module"),
    ("--model", "{mod}:broken", "{mod}:broken failed: ValueError: no weights file ("),
    ("--data", "{mod}:Plain", "{mod}:Plain returned a Plain; expected a psrt.train.data.Dataset, or a pair"),
    ("--data", "{mod}:three", "returned a tuple; expected"),
    ("--data", "{mod}:bad_samples", "returned a test set of a list; expected"),
])
def test_every_mistake_is_one_line_on_every_rank_alike(user, flag, path, words):
    mod = user()
    path, words = path.format(mod=mod), words.format(mod=mod)
    with pytest.raises(PsrtError) as err:
        if flag == "--model":
            imported.make_model(cfg_for(path), imported.load_data("synthetic"))
        else:
            imported.load_data(path)
    assert words in str(err.value) and "\n" not in str(err.value)
    assert err.value.everywhere


def test_a_module_that_fails_to_import_is_named(user):
    mod = user("\nraise RuntimeError('needs a GPU')\n")
    with pytest.raises(PsrtError, match=f"--data {mod}:pairs: cannot import {mod} \\(RuntimeError: needs a GPU"):
        imported.load_data(f"{mod}:pairs")
