"""psrt.dp.driver in one process: micro-batch cutting, the worker's shard, what step() does on
a worker and on a server, and the one-line errors of data_parallel (all before any rank
communicates).  Strategies are stood in for by a recording fake on a one-rank group."""
from collections import namedtuple

import pytest
import torch

from psrt.dp import driver
from psrt.dp.base import DataParallel, StepStats
from psrt.dp.driver import Driver, data_parallel, split_batch
from psrt.errors import PsrtError


def test_split_batch_cuts_every_tensor_along_the_first_dimension():
    x, y = torch.arange(12.).view(6, 2), torch.arange(6)
    parts = split_batch([x, y], 3)
    assert len(parts) == 3 and all(isinstance(p, list) for p in parts)
    assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(parts[2][1], torch.tensor([4, 5]))
    Pair = namedtuple("Pair", "x y")
    assert split_batch(Pair(x, y), 2)[1].y.tolist() == [3, 4, 5]
    d = split_batch({"x": x, "tag": "same"}, 2)
    assert d[0]["tag"] == d[1]["tag"] == "same" and d[1]["x"].shape == (3, 2)
    assert split_batch(x, 1) == [x]


def test_split_batch_refuses_unequal_micro_batches():
    with pytest.raises(PsrtError, match="a batch of 5 samples does not split into 2 equal micro-batches"):
        split_batch((torch.zeros(5, 3), torch.zeros(5)), 2)


class Fake(DataParallel):
    """Records what the driver asks of a strategy; a dedicated server when worker=False."""

    name = "fake"
    worker = True
    workers, rank = 3, 1

    def __init__(self, model, make_optimizer, group, **options):
        super().__init__(model, make_optimizer, group, **options)
        self.is_worker = self.worker
        self.calls = []

    @property
    def num_workers(self):
        return self.workers

    @property
    def worker_rank(self):
        return self.rank if self.is_worker else -1

    def step(self, loss_fn, microbatches):
        self.calls.append(("step", [loss_fn(mb) for mb in microbatches]))
        return StepStats(loss=1.0, bytes_sent=10)

    def serve(self, rounds=None):
        self.calls.append(("serve", rounds))
        return False

    def finish(self):
        self.calls.append(("finish",))


class OneRank:
    size, rank = 1, 0


def fake_driver(monkeypatch, worker=True, **kw) -> Driver:
    cls = type("F", (Fake,), {"worker": worker})
    monkeypatch.setattr(driver, "strategy_class", lambda name: cls)
    return Driver(torch.nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.1), "fake", OneRank(), **kw)


def test_shard_is_every_wth_sample_the_same_length_on_every_worker(monkeypatch):
    dp = fake_driver(monkeypatch)              # worker 1 of 3
    assert list(dp.shard(list(range(11)))) == [1, 4, 7]   # 11 // 3 = 3 each; sample 10 left out
    server = fake_driver(monkeypatch, worker=False)
    assert server.is_server and server.worker_rank == -1 and len(server.shard(list(range(11)))) == 0
    with pytest.raises(PsrtError, match="map-style data set"):
        dp.shard(iter(range(3)))


def test_step_on_a_worker_cuts_the_batch_and_keeps_the_stats(monkeypatch):
    dp = fake_driver(monkeypatch, accum=2)
    batch = (torch.arange(4.), torch.arange(4))
    stats = dp.step(lambda mb: mb[0].sum().item(), batch)
    assert dp.strategy.calls == [("step", [1.0, 5.0])]
    dp.step(lambda mb: len(mb[0]), batch, accum=4)
    dp.step(lambda mb: mb, microbatches=["a", "b", "c"])
    assert dp.strategy.calls[1:] == [("step", [1, 1, 1, 1]), ("step", ["a", "b", "c"])]
    assert dp.stats[0] is stats and dp.totals.steps == 3 and dp.bytes_sent == 30
    with pytest.raises(PsrtError, match="either a batch"):
        dp.step(len, batch, microbatches=[batch])
    with pytest.raises(PsrtError, match="give a batch"):
        dp.step(len)
    dp.finish()
    dp.finish()                                # once only
    assert dp.strategy.calls[-1] == ("finish",) and dp.strategy.calls.count(("finish",)) == 1
    with pytest.raises(PsrtError, match="step\\(\\) after finish\\(\\)"):
        dp.step(len, batch)


def test_step_on_a_server_serves_one_update(monkeypatch):
    dp = fake_driver(monkeypatch, worker=False)
    stats = dp.step(None, None)
    assert dp.strategy.calls == [("serve", 1)] and stats.extra["served"]
    assert dp.serve() is False and dp.strategy.calls[-1] == ("serve", None)
    assert fake_driver(monkeypatch).serve() is True      # a worker has nothing to serve


@pytest.mark.parametrize("call,words", [
    (dict(strategy="rign"), "unknown data-parallel strategy 'rign'; choose one of ps, ps-sharded"),
    (dict(strategy="ring", bucket_m=1), "psrt.data_parallel(strategy='ring'): unknown option bucket_m "
                                        "(it accepts bucket_mb, overlap, compress, algorithm)"),
    (dict(strategy="ps", staleness=1, servers=0, shards=2), "unknown option shards (it accepts servers"),
    (dict(strategy="ring", accum=0), "accum must be a whole number >= 1, got 0"),
    (dict(strategy="ring", make_optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1)),
     "make_optimizer must be a function params -> optimizer"),
    (dict(strategy="ring", model="net"), "model must be a torch.nn.Module, got str"),
    (dict(strategy="ring", world=object()), "give world= or group=, not both"),
])
def test_bad_arguments_are_one_line_before_anything_is_sent(call, words):
    kw = dict(model=torch.nn.Linear(2, 2), make_optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    kw.update(call)
    with pytest.raises(PsrtError) as err:
        data_parallel(kw.pop("model"), kw.pop("make_optimizer"), group=object(), **kw)   # never used
    assert words in str(err.value) and "\n" not in str(err.value)
