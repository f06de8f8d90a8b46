"""The names a command line is checked against (kept free of torch) are the names the
implementations answer to."""
import pytest

from psrt.collectives.algorithms import ALGORITHMS
from psrt.dp import COMPRESSIONS
from psrt.train.config import DATASETS, MODELS


def test_every_collective_algorithm_has_an_implementation_and_no_other():
    from psrt.collectives.implementations import IMPLEMENTATIONS as _IMPLEMENTATIONS
    assert {c: tuple(impl) for c, impl in _IMPLEMENTATIONS.items()} == ALGORITHMS


def test_every_compression_has_a_dtype():
    from psrt.dp.common import COMPRESS
    assert tuple(COMPRESS) == COMPRESSIONS


@pytest.mark.parametrize("name", MODELS)
def test_every_model_builds(name):
    from psrt.train.data import load
    from psrt.train.models import build_model
    data = load("text" if name in ("transformer", "moe") else "synthetic", 16)
    assert sum(p.numel() for p in build_model(name, data, 8, 1).parameters()) > 0


@pytest.mark.parametrize("name", DATASETS)
def test_every_data_set_loads(name):
    from psrt.train.data import load
    assert len(load(name, 16)) > 0
