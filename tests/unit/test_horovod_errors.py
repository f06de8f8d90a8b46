"""Horovod interop without horovod or MPI: a missing horovod and a bad compression are one
clear error, and the collectives bench offers horovod for allreduce only."""
from __future__ import annotations

import sys

import pytest
import torch

from psrt.bench.collectives import algorithms_for
from psrt.dp.horovod import INSTALL_HINT, HorovodStrategy
from psrt.errors import PsrtError

# ------------------------------------------------------------------ without horovod or MPI

def test_missing_horovod_is_one_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "horovod", None)       # `import horovod.torch` -> ImportError
    monkeypatch.setitem(sys.modules, "horovod.torch", None)
    with pytest.raises(PsrtError) as err:
        HorovodStrategy(torch.nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.1), group=None)
    assert str(err.value).startswith(INSTALL_HINT) and "\n" not in str(err.value)


def test_unsupported_compression_is_refused():
    with pytest.raises(PsrtError, match=r"--compress 'bf16': horovod offers none, fp16"):
        HorovodStrategy(torch.nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.1), group=None, compress="bf16")


def test_bench_offers_horovod_for_allreduce_only():
    assert algorithms_for("allreduce", ["ring", "horovod", "native"], False) == ["native", "ring", "horovod"]
    assert "horovod" not in algorithms_for("allgather", ["ring", "horovod"], False)
    assert "horovod" not in algorithms_for("allreduce", None, False)   # only when asked for


# ------------------------------------------------------------------ under mpirun


# ------------------------------------------------------------------ under horovodrun




# ------------------------------------------------------------------ reading Horovod's timeline

def test_merged_phases_counts_each_fused_call_once(tmp_path):
    """Two tensors fused into one MPI_Allreduce show the same interval on both rows (one
    call); the next call starting the microsecond the last one ended is a second call; an
    interval overlapping another is merged into it; rows of other tensors are left out."""
    from psrt.bench.horovod import merged_phases

    def row(pid, name, spans):
        meta = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}]
        return meta + [e for lo, hi in spans for e in ({"ph": "B", "name": "MPI_ALLREDUCE", "pid": pid, "ts": lo},
                                                        {"ph": "E", "name": "MPI_ALLREDUCE", "pid": pid, "ts": hi})]
    events = (row(1, "allreduce.grad.0", [(0, 10), (10, 20), (30, 40)])
              + row(2, "allreduce.grad.1", [(0, 10), (10, 20), (35, 45)])
              + row(3, "allreduce.other", [(100, 200)]))
    path = tmp_path / "timeline.json"
    import json
    path.write_text("[\n" + ",\n".join(json.dumps(e) for e in events) + ",\n")     # as Horovod leaves it
    assert merged_phases(path, "grad.") == {"MPI_ALLREDUCE": (35.0, 3)}
