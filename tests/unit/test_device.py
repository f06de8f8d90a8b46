"""--device and data_parallel(device=): each rank's device, and batches moved there."""
import collections

import pytest
import torch

from psrt.dp.device import pick, to
from psrt.errors import PsrtError


def test_cpu_and_auto_without_a_gpu_are_the_cpu():
    assert pick("cpu", 3) == torch.device("cpu")
    if not torch.cuda.is_available():
        assert pick("auto", 0) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_cuda_without_a_gpu_is_one_line():
    with pytest.raises(PsrtError, match="--device cuda: no CUDA device is visible") as err:
        pick("cuda", 0)
    assert "\n" not in str(err.value)


def test_an_unknown_device_is_one_line():
    with pytest.raises(PsrtError, match="--device 'tpu': choose one of cpu, cuda, auto"):
        pick("tpu", 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_each_local_rank_takes_a_gpu_round_robin():
    n = torch.cuda.device_count()
    assert pick("cuda", n + 1) == torch.device("cuda", 1 % n)


def test_a_batch_of_any_shape_moves_whole():
    Pair = collections.namedtuple("Pair", "x y")
    batch = {"a": (torch.ones(2), [torch.zeros(1), 3]), "b": Pair(torch.ones(1), "label")}
    moved = to(batch, torch.device("cpu"))
    assert isinstance(moved["b"], Pair) and moved["b"].y == "label" and moved["a"][1][1] == 3
    assert torch.equal(moved["a"][0], torch.ones(2))


def test_nccl_only_where_each_rank_has_a_gpu_of_its_own():
    from psrt.world import torch_backend_for
    assert torch_backend_for(None, cuda=False, local_size=2, gpus=0, nccl=True) == "gloo"
    assert torch_backend_for(None, cuda=True, local_size=4, gpus=4, nccl=True) == "nccl"
    assert torch_backend_for(None, cuda=True, local_size=2, gpus=1, nccl=True) == "gloo"
    assert torch_backend_for(None, cuda=True, local_size=1, gpus=1, nccl=False) == "gloo"
    assert torch_backend_for("gloo", cuda=True, local_size=1, gpus=1, nccl=True) == "gloo"
    with pytest.raises(PsrtError, match="backend nccl: 2 ranks on this host share 1 GPU") as err:
        torch_backend_for("nccl", cuda=True, local_size=2, gpus=1, nccl=True)
    assert "\n" not in str(err.value)


def test_the_nccl_algorithm_names_two_ranks_on_one_gpu():
    from psrt.collectives.nccl import sharing
    assert sharing([("a", 0), ("a", 1), ("b", 0), ("b", 1)]) is None
    assert sharing([("a", 0), ("b", 0), ("a", 1), ("b", 0)]) == (1, 3)
    assert sharing([]) is None
