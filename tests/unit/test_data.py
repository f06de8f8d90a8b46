"""The sampler's policy and the offline data sets (no MPI)."""
import numpy as np
import pytest
import torch

from psrt.errors import PsrtError
from psrt.train import data
from psrt.train.data import ShardedSampler, digits, load, synthetic, text


@pytest.mark.parametrize("size,batch,workers,accum", [(100, 12, 3, 2), (97, 8, 4, 1), (64, 64, 1, 4)])
def test_each_sample_once_per_epoch_across_workers(size, batch, workers, accum):
    samplers = [ShardedSampler(size, batch, workers, w, accum, seed=5) for w in range(workers)]
    spe = size // batch
    assert all(s.steps_per_epoch == spe for s in samplers)
    for epoch in range(2):
        seen = []
        for b in range(spe):
            step = epoch * spe + b
            parts = [torch.cat(s.microbatches(step)) for s in samplers]
            assert all(len(p) == batch // workers for p in parts)
            # Workers' slices, in rank order, are exactly the global batch.
            assert torch.equal(torch.cat(parts), samplers[0].global_indices(step))
            seen.append(torch.cat(parts))
        seen = torch.cat(seen)
        assert len(set(seen.tolist())) == len(seen) == spe * batch     # nobody twice
        dropped = set(range(size)) - set(seen.tolist())
        assert len(dropped) == size - spe * batch                         # only the tail


def test_epochs_are_shuffled_differently_and_reproducibly():
    a = ShardedSampler(200, 10, 2, 0, seed=1)
    b = ShardedSampler(200, 10, 2, 0, seed=1)
    c = ShardedSampler(200, 10, 2, 0, seed=2)
    assert torch.equal(a.order(0), b.order(0))
    assert not torch.equal(a.order(0), a.order(1))
    assert not torch.equal(a.order(0), c.order(0))
    assert sorted(a.order(3).tolist()) == list(range(200))


def test_microbatches_split_the_local_batch():
    s = ShardedSampler(100, 24, 2, 1, accum=3)
    mbs = s.microbatches(0)
    assert [len(m) for m in mbs] == [4, 4, 4]
    assert torch.equal(torch.cat(mbs), s.global_indices(0)[12:24])


@pytest.mark.parametrize("batch,workers,accum,flag", [(10, 4, 1, "--batch-size 10"), (12, 2, 5, "--accum"),
                                                      (500, 1, 1, "larger than the training set")])
def test_uneven_batch_is_an_error_naming_the_flag(batch, workers, accum, flag):
    with pytest.raises(PsrtError, match=flag):
        ShardedSampler(100, batch, workers, 0, accum)


def test_digits_is_the_real_data_set_with_a_fixed_split():
    d = digits()
    assert (len(d.train_x), len(d.test_x)) == (1438, 359)
    assert d.input_shape == (1, 8, 8) and d.classes == 10
    assert float(d.train_x.min()) == 0.0 and float(d.train_x.max()) == 1.0
    assert torch.equal(d.test_y, digits().test_y)
    # the very images and labels scikit-learn's loader gives, in its order
    from sklearn.datasets import load_digits
    ref = load_digits()
    table = data._digits_table()
    assert np.array_equal(table[:, :-1], ref.data) and np.array_equal(table[:, -1], ref.target)


def test_text_windows_are_shifted_by_one_character():
    d = text(seq_len=32)
    assert d.task == "lm" and d.input_shape == (32,)
    assert torch.equal(d.train_x[0, 1:], d.train_y[0, :-1])
    assert torch.equal(d.train_x[1, 0:1], d.train_y[0, -1:])  # windows are contiguous
    assert len(d.test_x) >= 1 and int(d.train_x.max()) < 256


def test_synthetic_is_deterministic_and_learnable_sized():
    a, b = synthetic(), synthetic()
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.train_y, b.train_y)
    assert len(a.train_y.unique()) > 5


def test_unknown_data_set():
    with pytest.raises(PsrtError, match="--data 'mnist'"):
        load("mnist")
