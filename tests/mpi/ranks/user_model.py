"""A model and a data set written the way a user writes them, outside psrt: for

    python -m psrt.train --model tests.mpi.ranks.user_model:build_model \\
                         --data tests.mpi.ranks.user_model:build_dataset

and for the data_parallel rank script (dp_api.py).  The model has a buffer (a fixed input
scale), so starting every rank from rank 0's buffers is checked as well as its parameters;
no dropout or batch norm, so N ranks and one process must agree.  The other names are wrong
on purpose, for the bad-input tests.
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

FEATURES, CLASSES = 12, 4


class Tagger(nn.Module):
    def __init__(self, features: int = FEATURES, classes: int = CLASSES):
        super().__init__()
        self.embed = nn.Linear(features, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, classes)
        self.register_buffer("scale", torch.rand(features) + 0.5)

    def forward(self, x):
        return self.head(torch.tanh(self.mix(torch.tanh(self.embed(x * self.scale)))))


class Points(Dataset):
    """Map-style: (features, class) pairs labelled by a fixed random linear teacher."""

    def __init__(self, size: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, FEATURES, generator=g)
        teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(99))
        self.y = (self.x @ teacher).argmax(1)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def build_model(dataset):
    """--model: sized from the data set psrt passes in."""
    return Tagger(dataset.input_shape.numel(), dataset.classes)


def build_dataset():
    """--data: (train, test), a torch Dataset and an (inputs, targets) pair."""
    test = Points(60, seed=2)
    return Points(240, seed=1), (test.x, test.y)


def loss(output, target):
    """Replaces cross-entropy in python -m psrt.train (label smoothing: a loss of our own)."""
    return F.cross_entropy(output, target, label_smoothing=0.1)


def not_a_model():
    return [nn.Linear(2, 2)]


def not_a_dataset():
    return "data.csv"


not_callable = 42
