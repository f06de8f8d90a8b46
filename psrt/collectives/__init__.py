"""Collectives over torch tensors with psrt's own algorithms (see communicator.py).

The algorithm names (algorithms.py) and the layout helpers import no torch; Communicator and
Handle are imported on first use (PEP 562), so a command line can be checked without torch.
"""
import importlib

from psrt.collectives.algorithms import ALGORITHMS, ALL_ALGORITHMS
from psrt.collectives.layout import even_counts

_LAZY = {"Communicator": "psrt.collectives.communicator", "Handle": "psrt.collectives.executor"}

__all__ = ["Communicator", "Handle", "ALGORITHMS", "ALL_ALGORITHMS", "even_counts"]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'psrt.collectives' has no attribute {name!r}")
