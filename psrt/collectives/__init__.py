"""Collectives over torch tensors with psrt's own algorithms (see communicator.py)."""
from psrt.collectives.communicator import ALGORITHMS, ALL_ALGORITHMS, Communicator
from psrt.collectives.executor import Handle
from psrt.collectives.layout import even_counts

__all__ = ["Communicator", "Handle", "ALGORITHMS", "ALL_ALGORITHMS", "even_counts"]
