"""CUDA tensors through the collectives: staged through pinned host memory, or handed to a
CUDA-aware MPI directly.  Needs a GPU; skipped (not faked) without one."""
import json

import pytest
import torch

pytestmark = [pytest.mark.mpi, pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def skip_unless_aware(records: list[dict]) -> list[dict]:
    """The ranks' records; a skip where they found the MPI not CUDA-aware (PSRT_CUDA_AWARE=1
    on an MPI that is not: they ask the library, which the pytest process cannot)."""
    skips = {r["skip"] for r in records if "skip" in r}
    if skips:
        pytest.skip("; ".join(sorted(skips)))
    return records


@pytest.mark.parametrize("aware", ["0", "1"])
def test_cuda_collectives(run_ranks, aware):
    run = run_ranks(2, "cuda_check.py", env={"PSRT_CUDA_AWARE": aware}, timeout=300).check()
    for rec in skip_unless_aware(run.records()):
        assert rec["failures"] == [], rec
        assert rec["checked"] >= 20


@pytest.mark.parametrize("aware", ["0", "1"])
def test_cuda_on_the_torch_backend(run_ranks, aware):
    """The psrt torch.distributed backend on CUDA tensors: dtypes, stream order of collectives
    and of sends and receives (batch_isend_irecv, blocking, futures), DDP."""
    run = run_ranks(2, "c10d_cuda.py", env={"PSRT_CUDA_AWARE": aware}, timeout=300).check()
    for rec in skip_unless_aware(run.records()):
        assert rec["failures"] == [], rec
        assert rec["checked"] >= 12


def test_sharded_stages_on_cuda(run_ranks):
    """zero1/2/3 with the model on the GPU, N = 2 sharing the device, equal one process there:
    with every buffer of theirs (flat parameters, gradient buckets and shard, zero3's gathered
    units, prefetched on a side stream) on the device, and with the optimizer offloaded to the
    host (pinned copies down and up each step)."""
    names = ("zero1", "zero2", "zero3")
    recs = run_ranks(2, "dp_equivalence.py", "--dp", ",".join(names + tuple(f"{n}/offload" for n in names)),
                     "--device", "cuda", "--accum", "2", "--optimizer", "adam", "--lr", "0.01", "--rtol", "1e-4",
                     "--atol", "1e-5", timeout=300).check().records()
    assert len(recs) == 12
    for r in recs:
        assert r["ok"] and r["loss_ok"], r
        assert r["devices"] == ["cuda"], r
    side = [r for r in recs if r["dp"] == "zero3"]
    assert all(r["extra"]["prefetch_stream"] == "side" for r in side), side


def _summaries(run_ranks, np_, *args):
    """Each strategy's --metrics summary of a psrt.train run."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        run_ranks(np_, "-m", "psrt.train", "--steps", "4", "--quiet", "--metrics", f"{tmp}/m.jsonl", *args,
                  timeout=300).check()
        import glob
        out = {}
        for path in glob.glob(f"{tmp}/m*.jsonl"):
            rows = [json.loads(line) for line in open(path)]
            summary = next(r for r in rows if r.get("summary"))
            out[summary["dp"]] = summary
        return out


@pytest.mark.parametrize("layout,dps,rtol", [
    ([], "ps,ring,zero3", 1e-4),
    (["--model", "transformer", "--pp", "2"], "ps,ring,zero1", 1e-4),
    (["--model", "moe", "--experts", "4", "--ep", "2"], "ps,ring,zero1", 1e-4),
    (["--model", "transformer", "--tp", "2", "--sequence-parallel"], "ring,zero1", 1e-4),
    (["--precision", "bf16"], "ps,ring,zero3", 2e-2),      # bf16 kernels differ between devices
    (["--precision", "fp16"], "ring,zero1", 1e-2),
], ids=["dp", "pp2", "moe-ep2", "tp2-sp", "bf16", "fp16"])
def test_the_cli_on_cuda_reaches_the_cpu_losses(run_ranks, layout, dps, rtol, record_property):
    """psrt.train --device cuda trains what --device cpu trains (fp32 tolerance; looser in
    16-bit), data-parallel, on a pipeline, with experts, tensor- and sequence-parallel, and
    under autocast; the memory ledger shows the CUDA allocator's count beside the model
    states."""
    cpu = _summaries(run_ranks, 2, *layout, "--dp", dps, "--device", "cpu")
    gpu = _summaries(run_ranks, 2, *layout, "--dp", dps, "--device", "cuda")
    assert cpu.keys() == gpu.keys() and len(cpu) == len(dps.split(","))
    # the figures, for scripts/gpu_check.sh's table (pytest --junitxml keeps them)
    record_property("losses", json.dumps({dp: {"cpu": cpu[dp]["train_loss"], "gpu": gpu[dp]["train_loss"],
                                               "rtol": rtol} for dp in cpu}))
    for dp in cpu:
        a, b = cpu[dp]["train_loss"], gpu[dp]["train_loss"]
        assert abs(a - b) <= rtol * max(1.0, abs(a)), (dp, a, b)
        # the memory ledger's CUDA columns: the allocator's count now and at its peak
        assert "mem_cuda_allocated" not in cpu[dp], cpu[dp]
        assert gpu[dp]["mem_cuda_peak"] >= gpu[dp]["mem_cuda_allocated"] > 0, gpu[dp]
