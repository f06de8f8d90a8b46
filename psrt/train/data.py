"""Data sets that need no download, and the sampler that shards them over ranks.

- digits: scikit-learn's 8x8 handwritten digits (1797 real images shipped inside the
  package), as 1x8x8 float images in [0, 1]; a fixed 80/20 train/test split.
- text: characters (UTF-8 bytes, vocabulary 256) of a fixed list of this Python's own
  standard-library sources, cut into windows of `seq_len + 1`; the last 10% of windows are
  held out.  Deterministic for a given Python installation.
- synthetic: Gaussian 1x8x8 inputs labelled by a fixed random linear teacher (learnable,
  any size).

The data itself never depends on --seed (so runs with different seeds see the same test
set); --seed only decides initialisation and the order of samples.
"""
from __future__ import annotations

import gzip
import importlib.util
import os
import sysconfig
from dataclasses import dataclass

import numpy as np
import torch

from psrt.errors import PsrtError
from psrt.train.config import DATASETS

TEXT_FILES = ("textwrap.py", "string.py", "heapq.py", "bisect.py", "functools.py",
              "contextlib.py", "abc.py", "fnmatch.py", "shlex.py", "queue.py")


@dataclass(frozen=True)
class Dataset:
    name: str
    task: str                  # "classify" or "lm" (next-token prediction)
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    classes: int               # number of classes, or the vocabulary size

    @property
    def input_shape(self) -> torch.Size:
        return self.train_x.shape[1:]

    def __len__(self) -> int:
        return len(self.train_x)


def _split(x: torch.Tensor, y: torch.Tensor, test_fraction: float, seed: int = 0):
    order = torch.from_numpy(np.random.default_rng(seed).permutation(len(x)))
    n_test = int(round(len(x) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def _digits_table() -> np.ndarray:
    """scikit-learn's digits as its data file holds them: one row per image, 64 pixel values
    (0-16) and the label.  Read straight from the file: importing sklearn.datasets to load
    them takes about a second, paid by every rank of every run."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise PsrtError("--data digits needs scikit-learn (pip install scikit-learn), which ships "
                        "the images", everywhere=True)
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    try:
        with gzip.open(path, "rb") as f:
            return np.loadtxt(f, delimiter=",", dtype=np.float32)
    except OSError:              # a scikit-learn that keeps them elsewhere: its own loader
        from sklearn.datasets import load_digits
        d = load_digits()
        return np.column_stack([d.data, d.target]).astype(np.float32)


def digits() -> Dataset:
    table = _digits_table()
    x = torch.from_numpy(table[:, :-1]).view(-1, 1, 8, 8) / 16.0
    y = torch.from_numpy(table[:, -1]).to(torch.int64)
    return Dataset("digits", "classify", *_split(x, y, 0.2), classes=10)


def text(seq_len: int = 64) -> Dataset:
    root = sysconfig.get_paths()["stdlib"]
    chunks = []
    for name in TEXT_FILES:
        try:
            with open(os.path.join(root, name), "rb") as f:
                chunks.append(f.read())
        except OSError as err:
            raise PsrtError(f"--data text: cannot read {name} from the standard library at {root} "
                            f"({err.strerror})", everywhere=True) from None
    tokens = torch.frombuffer(bytearray(b"\n".join(chunks)), dtype=torch.uint8).to(torch.int64)
    windows = (len(tokens) - 1) // seq_len
    if windows < 10:
        raise PsrtError(f"--seq-len {seq_len} leaves fewer than 10 windows of text", everywhere=True)
    # Inputs and targets are the same window shifted by one character.
    x = tokens[:windows * seq_len].view(windows, seq_len)
    y = tokens[1:windows * seq_len + 1].view(windows, seq_len)
    cut = windows - max(1, windows // 10)      # held-out text is the end of the corpus
    return Dataset("text", "lm", x[:cut], y[:cut], x[cut:], y[cut:], classes=256)


def synthetic(size: int = 4096, classes: int = 10) -> Dataset:
    rng = np.random.default_rng(1234)
    x = rng.standard_normal((size, 64)).astype(np.float32)
    teacher = rng.standard_normal((64, classes)).astype(np.float32)
    y = (x @ teacher).argmax(1)
    x_t = torch.from_numpy(x).view(-1, 1, 8, 8)
    return Dataset("synthetic", "classify", *_split(x_t, torch.from_numpy(y), 0.2), classes=classes)


def load(name: str, seq_len: int = 64) -> Dataset:
    if name == "digits":
        return digits()
    if name == "text":
        return text(seq_len)
    if name == "synthetic":
        return synthetic()
    raise PsrtError(f"--data {name!r}: choose one of {', '.join(DATASETS)}", everywhere=True)


class ShardedSampler:
    """Which samples each worker trains on at each global step (DistributedSampler's idea).

    Policy:
    - Every epoch is a fresh permutation of the training set, drawn from (seed, epoch) alone,
      so every rank computes the same permutation without communicating.
    - The permutation is cut into global batches of `global_batch`; the last incomplete one
      is dropped (drop-last), so every step sees a full global batch and steps per epoch =
      len(dataset) // global_batch.  The dropped tail is a different random subset each
      epoch.  Within an epoch no sample is seen twice and, apart from that tail, every
      sample is seen exactly once across all workers.
    - Worker w of W takes the w-th contiguous slice of B/W samples of each global batch and
      cuts it into `accum` micro-batches of B/(W*accum).  B must divide by W*accum: there
      is no uneven split, because unequal shards would weight samples unequally in the
      averaged gradient.
    """

    def __init__(self, size: int, global_batch: int, workers: int, rank: int, accum: int = 1,
                 seed: int = 0, shuffle: bool = True):
        if global_batch > size:
            raise PsrtError(f"--batch-size {global_batch} is larger than the training set "
                            f"({size} samples)", everywhere=True)
        if global_batch % (workers * accum):
            raise PsrtError(
                f"--batch-size {global_batch} does not split evenly over {workers} worker"
                f"{'s' * (workers != 1)} x {accum} micro-batch{'es' * (accum != 1)} (--accum): "
                f"use a multiple of {workers * accum}", everywhere=True)
        if not 0 <= rank < workers:
            raise PsrtError(f"worker rank {rank} is outside 0..{workers - 1}")
        self.size, self.global_batch, self.workers, self.rank = size, global_batch, workers, rank
        self.accum, self.seed, self.shuffle = accum, seed, shuffle
        self.steps_per_epoch = size // global_batch
        self._epoch, self._order = None, None

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.workers

    def order(self, epoch: int) -> torch.Tensor:
        """The permutation of sample indices for `epoch`."""
        if epoch != self._epoch:
            if self.shuffle:
                # SeedSequence mixes (seed, epoch) into independent streams: no seed*K+epoch
                # collisions between neighbouring seeds.
                perm = np.random.default_rng([self.seed, epoch]).permutation(self.size)
                self._order = torch.from_numpy(perm)
            else:
                self._order = torch.arange(self.size)
            self._epoch = epoch
        return self._order

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, batch within the epoch) of global step `step` (0-based)."""
        return divmod(step, self.steps_per_epoch)

    def global_indices(self, step: int) -> torch.Tensor:
        epoch, b = self.position(step)
        return self.order(epoch)[b * self.global_batch:(b + 1) * self.global_batch]

    def indices(self, step: int) -> torch.Tensor:
        """This worker's samples of global step `step`."""
        lo = self.rank * self.local_batch
        return self.global_indices(step)[lo:lo + self.local_batch]

    def microbatches(self, step: int) -> list[torch.Tensor]:
        return list(self.indices(step).chunk(self.accum))
