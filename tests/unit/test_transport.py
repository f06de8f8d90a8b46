"""Transport and layout logic that needs no running MPI job."""
import os

import numpy as np
import pytest
import torch

from psrt import transport
from psrt.bench.tune import crossovers
from psrt.collectives.layout import even_counts, offsets, shard_range
from psrt.collectives.tuning import Tuning
from psrt.errors import PsrtError


@pytest.mark.parametrize("dtype", transport.SUPPORTED_DTYPES)
def test_np_view_shares_memory(dtype):
    t = torch.zeros(6, dtype=dtype)
    view = transport.np_view(t)
    assert view.nbytes == t.numel() * t.element_size()
    view[...] = np.frombuffer(bytes(range(1, view.nbytes + 1)), dtype=view.dtype).reshape(view.shape)
    # the tensor sees the bytes written through the view: no copy was made
    assert bytes(t.view(torch.uint8).numpy()) == bytes(range(1, view.nbytes + 1))


def test_unsupported_dtype_is_a_clear_error():
    with pytest.raises(PsrtError, match="complex64 is not supported"):
        transport.np_view(torch.zeros(2, dtype=torch.complex64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.uint8])
@pytest.mark.parametrize("op,fn", [("sum", lambda a, b: a + b), ("max", np.maximum), ("min", np.minimum),
                                   ("prod", lambda a, b: a * b)])
def test_reduce_matches_numpy(dtype, op, fn):
    a = np.array([1, 2, 3, 4, 0, 7], dtype=np.float64)
    b = np.array([4, 1, 3, 2, 5, 1], dtype=np.float64)
    acc = torch.tensor(a).to(dtype)
    transport.reduce_(acc, torch.tensor(b).to(dtype), op)
    assert acc.dtype == dtype
    assert np.array_equal(acc.double().numpy(), fn(a, b))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.int8, torch.bool])
@pytest.mark.parametrize("op,fn", [("band", np.bitwise_and), ("bor", np.bitwise_or), ("bxor", np.bitwise_xor)])
def test_bitwise_reduce_matches_numpy(dtype, op, fn):
    a = np.array([0b1100, 0b1010, 7, 0, 1, 6])
    b = np.array([0b1010, 0b0110, 7, 5, 0, 3])
    if dtype == torch.bool:
        a, b = a % 2, b % 2
    acc = torch.tensor(a).to(dtype)
    transport.reduce_(acc, torch.tensor(b).to(dtype), op)
    assert acc.dtype == dtype
    assert np.array_equal(acc.to(torch.int64).numpy(), fn(a, b))
    transport.check_op(op, dtype)


def test_bitwise_ops_need_integers():
    with pytest.raises(PsrtError, match="op 'bxor' needs an integer or bool tensor, got torch.float32"):
        transport.check_op("bxor", torch.float32)


def test_bfloat16_sum_stays_bfloat16_on_the_wire():
    # 16-bit floats travel as 16-bit words: the MPI buffer is 2 bytes per element
    t = torch.ones(5, dtype=torch.bfloat16)
    assert transport.np_view(t).itemsize == 2


def test_avg_needs_floating_point():
    with pytest.raises(PsrtError, match="avg"):
        transport.check_op("avg", torch.int64)
    with pytest.raises(PsrtError, match="unknown reduction op 'mean'"):
        transport.check_op("mean", torch.float32)


def test_staging_writes_back_into_non_contiguous_tensor():
    base = torch.zeros(4, 6)
    target = base[:, ::2]                      # not contiguous
    flat = torch.empty(12)
    flat.copy_(torch.arange(12, dtype=torch.float32))
    transport.Staging.from_mpi(flat, target)
    assert torch.equal(base[:, ::2], torch.arange(12, dtype=torch.float32).view(4, 3))
    assert torch.equal(base[:, 1::2], torch.zeros(4, 3))  # neighbours untouched


def test_cuda_aware_override(monkeypatch):
    monkeypatch.setenv("PSRT_CUDA_AWARE", "1")
    assert transport.cuda_aware() is True
    monkeypatch.setenv("PSRT_CUDA_AWARE", "0")
    assert transport.cuda_aware() is False
    monkeypatch.setenv("PSRT_CUDA_AWARE", "yes")
    with pytest.raises(PsrtError, match="PSRT_CUDA_AWARE=.yes.: expected 0 or 1"):
        transport.cuda_aware()


@pytest.mark.parametrize("total,parts", [(0, 3), (1, 4), (2, 5), (10, 3), (1 << 20, 8), (7, 7)])
def test_even_counts(total, parts):
    counts = even_counts(total, parts)
    assert len(counts) == parts and sum(counts) == total
    assert max(counts) - min(counts) <= 1 and counts == sorted(counts, reverse=True)
    assert offsets(counts)[-1] == total


def test_tuning_choose_nearest_world_size_and_limits():
    t = Tuning(tables={"allreduce": {2: [(1024, "doubling"), (1 << 62, "ring")],
                                     8: [(1 << 62, "native")]}})
    allowed = ("ring", "doubling", "native")
    assert t.choose("allreduce", 1000, 2, allowed) == "doubling"
    assert t.choose("allreduce", 4096, 3, allowed) == "ring"        # 3 is nearest to 2
    assert t.choose("allreduce", 4096, 7, allowed) == "native"      # 7 is nearest to 8
    assert t.choose("broadcast", 4096, 2, allowed) == "native"      # no table: the library's
    assert t.choose("allreduce", 1000, 2, ("ring", "native")) == "ring"  # winner not allowed


def test_tuning_file_round_trip_and_errors(tmp_path):
    t = Tuning(tables={"allreduce": {4: [(64, "doubling"), (1 << 62, "ring")]}}, source="test")
    t.save(tmp_path / "t.json")
    again = Tuning.load(tmp_path / "t.json")
    assert again.tables == t.tables
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PsrtError, match="bad.json"):
        Tuning.load(tmp_path / "bad.json")


def test_shipped_tuning_table_is_valid():
    from psrt.collectives import ALGORITHMS
    t = Tuning.load()
    for coll, per_n in t.tables.items():
        for n, rows in per_n.items():
            limits = [lim for lim, _ in rows]
            assert limits == sorted(limits), (coll, n)
            assert all(algo in ALGORITHMS[coll] for _, algo in rows), (coll, n, rows)


def test_crossovers_keep_previous_winner_on_ties():
    rows = [{"nbytes": s, "algorithm": a, "time_us": t} for s, a, t in [
        (4, "doubling", 10), (4, "ring", 30), (64, "doubling", 20), (64, "ring", 20.5),
        (1024, "doubling", 90), (1024, "ring", 40)]]
    assert crossovers(rows) == [(64, "doubling"), (1 << 62, "ring")]


@pytest.mark.parametrize("total,parts", [(0, 3), (1, 4), (10, 3), (7, 7), (1000, 8)])
def test_shard_range_is_one_part_of_even_counts(total, parts):
    off = offsets(even_counts(total, parts))
    assert [shard_range(total, parts, i) for i in range(parts)] == list(zip(off, off[1:]))


def test_cuda_support_asks_the_loaded_library():
    """In an MPI process, the answer comes from MPIX_Query_cuda_support of the libmpi mpi4py
    loaded (Debian's Open MPI here: built without CUDA, so 0), found through /proc/self/maps;
    forcing PSRT_CUDA_AWARE=1 on it is named as the crash it would be."""
    import json
    import subprocess
    import sys
    probe = ("import json; from mpi4py import MPI; from psrt import transport; "
             "print(json.dumps([transport.loaded_libmpi(), transport._mpix_query_cuda_support(), "
             "transport.cuda_support(), transport.forced_but_unsupported()]))")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env=dict(env, PSRT_CUDA_AWARE="1"), check=True).stdout
    libs, answer, support, forced = json.loads(out.strip().splitlines()[-1])
    assert libs and all("/libmpi" in p and ".so" in p for p in libs)
    assert answer == 0 and support == [False, "MPIX_Query_cuda_support() = 0"]
    assert forced == "PSRT_CUDA_AWARE=1 but the MPI library is not CUDA-aware (MPIX_Query_cuda_support() = 0)"


def test_cuda_support_falls_back_to_ompi_info(monkeypatch):
    """An MPI without the query: Open MPI's build flag decides, and the reason says so."""
    transport.cuda_support.cache_clear()
    monkeypatch.setattr(transport, "_mpix_query_cuda_support", lambda: None)
    try:
        aware, how = transport.cuda_support()
    finally:
        transport.cuda_support.cache_clear()
    assert aware is False and how.startswith("ompi_info: mpi_built_with_cuda_support:false")


def test_a_16bit_sum_by_the_mpi_library_stays_staged_on_a_cuda_aware_mpi():
    """psrt's user-defined op for float16/bfloat16 reads host memory: on a CUDA-aware MPI the
    library's own sums of such tensors still go through the staged path; float32 does not."""
    from psrt.collectives.communicator import Communicator

    class Cuda:                     # what _on_device_ok reads of a tensor
        is_cuda = True

        def __init__(self, dtype):
            self.dtype = dtype
    group = Communicator.__new__(Communicator)
    group._staging = transport.Staging(cuda_aware_mpi=True)
    for algo in ("native", "hierarchical"):
        assert not group._on_device_ok(Cuda(torch.float16), algo)
        assert not group._on_device_ok(Cuda(torch.bfloat16), algo)
        assert group._on_device_ok(Cuda(torch.float32), algo)
    assert group._on_device_ok(Cuda(torch.float16), "ring")        # psrt sums it with torch
    group._staging = transport.Staging(cuda_aware_mpi=False)
    assert not group._on_device_ok(Cuda(torch.float32), "ring")
