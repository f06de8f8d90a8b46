"""CUDA tensors through the collectives: staged through pinned host memory, or handed to a
CUDA-aware MPI directly.  Needs a GPU; skipped (not faked) without one."""
import pytest
import torch

pytestmark = [pytest.mark.mpi, pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("aware", ["0", "1"])
def test_cuda_collectives(run_ranks, aware):
    from psrt.transport import _library_cuda_aware
    if aware == "1" and not _library_cuda_aware():
        pytest.skip("this MPI library is not CUDA-aware")
    run = run_ranks(2, "cuda_check.py", env={"PSRT_CUDA_AWARE": aware}, timeout=300).check()
    for rec in run.records():
        assert rec["failures"] == [], rec
        assert rec["checked"] >= 20


@pytest.mark.parametrize("aware", ["0", "1"])
def test_cuda_on_the_torch_backend(run_ranks, aware):
    """The psrt torch.distributed backend on CUDA tensors: dtypes, stream order of collectives
    and of sends and receives (batch_isend_irecv, blocking, futures), DDP."""
    from psrt.transport import _library_cuda_aware
    if aware == "1" and not _library_cuda_aware():
        pytest.skip("this MPI library is not CUDA-aware")
    run = run_ranks(2, "c10d_cuda.py", env={"PSRT_CUDA_AWARE": aware}, timeout=300).check()
    for rec in run.records():
        assert rec["failures"] == [], rec
        assert rec["checked"] >= 12
