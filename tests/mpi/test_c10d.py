"""The psrt torch.distributed backend, with PyTorch's own code as the reference.

tests/mpi/ranks/c10d_consumers.py runs DDP (comm hook, find_unused_parameters, no_sync), FSDP2
(reshard after forward on and off), DCP save then load, DTensor tensor parallel on a 2-D
(dp x tp) mesh at N = 4, pipelining (GPipe, 1F1B) and the object collectives, once on gloo
and once on psrt, at N = 2, 3 and 4; every loss and final parameter must agree.  On psrt it also
runs DDP once per psrt algorithm, each on its own group, against gloo's DDP, with a small
model and (at N = 2 and 3) with one whose bucket takes each algorithm's full-size path, and
checks from the group's own record that every all-reduce ran the algorithm asked for.

Tolerance: both backends sum fp32 gradients of 2-4 ranks in different orders (a few ulps per
step, three steps), so rtol 1e-5 / atol 1e-6 holds while a lost, doubled or unaveraged
gradient moves a parameter by 1e-2 or more.  The fp16 comm hook rounds each gradient to 11
significant bits before summing, in a different order per backend: atol 1e-3 (see
test_ddp_equivalence for the bound).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
from conftest import MPI_SCRIPTS, ROOT, RankRun

torch = pytest.importorskip("torch")

SIZES = (2, 3, 4)
EXAMPLE = ROOT / "examples" / "torch_ddp.py"
ALGORITHMS = ("ring", "ps", "halving-doubling", "tree", "doubling", "native")


@pytest.fixture(scope="module")
def consumers(tmp_path_factory):
    """{(backend, N): results} for every size, each run once for the module."""
    from conftest import mpirun_argv
    out = {}
    base = tmp_path_factory.mktemp("c10d")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for n in SIZES:
        for backend in ("gloo", "psrt"):
            path, ckpt = base / f"{backend}{n}.pt", base / f"ckpt-{backend}{n}"
            cmd = mpirun_argv(n) + [sys.executable, str(MPI_SCRIPTS / "c10d_consumers.py"), backend,
                                    str(path), str(ckpt)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env,
                                  stdin=subprocess.DEVNULL)
            RankRun(proc).check()
            out[backend, n] = torch.load(path, weights_only=False)
    return out


def assert_same(got, want, path: str, atol: float = 1e-6):
    if isinstance(want, dict):
        assert set(got) == set(want), f"{path}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{path}.{k}", atol)
    elif isinstance(want, torch.Tensor):
        assert got.shape == want.shape, f"{path}: shape {got.shape} != {want.shape}"
        err = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
        assert torch.allclose(got, want, rtol=1e-5, atol=atol), f"{path}: max difference {err}"
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


CONSUMERS = ("ddp", "ddp-hook", "ddp-unused", "ddp-no_sync", "fsdp-reshard", "fsdp-keep",
             "dcp", "tp", "pipeline-gpipe", "pipeline-1f1b", "objects")
BIG = (2, 3)     # the sizes that also run DDP of BigNet, whose bucket is above the small-message path


@pytest.mark.parametrize("n", BIG)
def test_ddp_of_a_large_bucket_on_psrt_equals_gloo(consumers, n):
    assert_same(consumers["psrt", n]["ddp-big"], consumers["gloo", n]["ddp-big"], f"ddp of BigNet N={n}")


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", CONSUMERS)
def test_pytorch_code_on_psrt_equals_gloo(consumers, name, n):
    psrt_run, gloo_run = consumers["psrt", n], consumers["gloo", n]
    assert_same(psrt_run[name], gloo_run[name], f"{name} N={n}", atol=1e-3 if name == "ddp-hook" else 1e-6)


@pytest.mark.parametrize("n", SIZES)
def test_training_moves_the_parameters(consumers, n):
    """Guards the comparison: had no step changed anything, equal results would prove little."""
    run = consumers["psrt", n]
    checked = [("ddp", "init"), ("fsdp-reshard", "init"), ("tp", "init")] + ([("ddp-big", "init-big")] if n in BIG else [])
    for name, init in checked:
        moved = max((run[name]["params"][k] - v).abs().max().item() for k, v in run[init].items())
        assert moved > 1e-2, f"{name}: parameters moved by {moved} only"
    # The model loaded into differed from the saved one in every parameter and optimizer state
    # before the load, and equals it after.
    assert run["dcp"]["differed"] == ["params", "optim"], run["dcp"]["differed"]
    assert run["dcp"]["same"], "DCP load did not restore the saved FSDP2 parameters and Adam state"
    assert {k.rsplit(".", 1)[1] for k in run["dcp"]["optim"]} == {"step", "exp_avg", "exp_avg_sq"}
    assert run["objects"]["all_gather"] == [{"rank": r, "word": "x" * (r + 1)} for r in range(n)]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_ddp_on_every_psrt_algorithm_equals_gloo(consumers, algorithm, n):
    from psrt.collectives import small
    run = consumers["psrt", n]
    assert_same(run[f"ddp-{algorithm}"], consumers["gloo", n]["ddp"], f"ddp on {algorithm} N={n}")
    ran = run["ran"][algorithm]
    assert ran["algorithms"] == [algorithm], f"asked for {algorithm}, the group's all-reduces ran {ran}"
    if n in BIG:
        assert_same(run[f"ddp-big-{algorithm}"], consumers["gloo", n]["ddp-big"], f"ddp of BigNet on {algorithm} N={n}")
        assert not small.takes(algorithm, ran["max_bytes"]), f"no bucket took {algorithm}'s full-size path: {ran}"


@pytest.mark.parametrize("n,algorithm", ((3, "halving-doubling"), (5, None)))
def test_every_call_and_error(run_ranks, n, algorithm):
    """Each collective against its definition (all ReduceOps, dtypes, uneven all-to-all, p2p,
    p2p futures, odd subgroups, a reversed group; odd N, where folds and uneven splits show,
    and N = 1 below), each group running the algorithm PSRT_ALGORITHM or its pg_options ask
    for, then a mismatched call, and a failing all-reduce seen by DDP's backward, the future
    and Work.wait (tests/mpi/ranks/c10d_ops.py)."""
    env = {"PSRT_ALGORITHM": algorithm} if algorithm else {}
    run = run_ranks(n, "c10d_ops.py", timeout=200, env=env).check()
    assert run.stdout.count("c10d ops ok") == n


def test_one_plain_process():
    """No launcher, no MASTER_ADDR: a process of its own is a world of one."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_", "MASTER_", "RANK", "WORLD_SIZE"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(MPI_SCRIPTS / "c10d_ops.py")], capture_output=True,
                          text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
    RankRun(proc).check()
    assert "rank 0: c10d ops ok" in proc.stdout


@pytest.mark.parametrize("after", ("stays", "raises"))
def test_a_failure_on_one_rank_is_named(run_ranks, after):
    """Rank 1's all-reduces fail there alone: its Work.wait(), future and DDP backward raise,
    and the ranks waiting for it get an error naming it within the timeout instead of a hang:
    from the watchdog when rank 1 catches the error and goes on with its own code (stays), from
    rank 1 itself when the error is not caught (raises)."""
    t0 = time.monotonic()
    run = run_ranks(3, "c10d_stall.py", "1", after, timeout=90, env={"PSRT_TIMEOUT": "2"})
    assert run.returncode != 0 and "finished" not in run.stdout, run.stdout[-2000:]
    [record] = run.records()
    seen = ("wait", "future") + (("backward",) if after == "stays" else ())
    assert record["rank"] == 1 and set(record["errors"]) == set(seen), record
    assert all("injected failure on rank 1" in record["errors"][k] for k in seen), record
    err = run.stderr
    if after == "stays":
        assert "psrt: watchdog: no progress for 2 s" in err, err[-3000:]
        assert "rank 1 (" in err and "has not reached call" in err, err[-3000:]
    else:
        assert "[rank 1] psrt: error:" in err and "injected failure on rank 1" in err, err[-3000:]
    assert time.monotonic() - t0 < 60


# ------------------------------------------------------------------ the example, three launchers

def _epochs(text: str) -> list[str]:
    """The example's per-epoch loss and accuracy (a sum of two fp32 values is the same in any
    order, so at N = 2 every backend prints the same digits)."""
    return re.findall(r"epoch \d+: loss [\d.]+  accuracy [\d.]+", text)


@pytest.fixture(scope="module")
def gloo_example():
    """examples/torch_ddp.py under torchrun: PyTorch's own launcher and gloo."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           str(EXAMPLE)], capture_output=True, text=True, timeout=120, env=env,
                          stdin=subprocess.DEVNULL, cwd=ROOT)
    RankRun(proc).check()
    assert "DDP on gloo: 2 ranks" in proc.stdout
    return _epochs(proc.stdout)


@pytest.mark.parametrize("algorithm", ("ps",))
def test_example_under_mpirun_equals_torchrun(run_ranks, gloo_example, algorithm):
    run = run_ranks(2, str(EXAMPLE), timeout=120, env={"PSRT_ALGORITHM": algorithm}).check()
    assert "DDP on psrt: 2 ranks" in run.stdout
    assert len(gloo_example) == 3 and _epochs(run.stdout) == gloo_example, (run.stdout, gloo_example)


def test_example_under_horovodrun(gloo_example):
    from conftest import horovodrun
    proc = horovodrun("-np", "2", sys.executable, str(EXAMPLE))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "DDP on psrt: 2 ranks" in proc.stdout
    assert _epochs(proc.stdout) == gloo_example


def test_every_wait_ends_within_the_group_timeout(run_ranks):
    """Calls no peer answers (receives from a rank, from any rank, an irecv waited on, an
    all-reduce, a barrier with a per-call timeout) each raise after the timeout of their group
    (3 s; 1 s for the barrier's own), not PSRT_TIMEOUT's 300 s, naming the call, the group and
    the ranks waited for (tests/mpi/ranks/c10d_timeouts.py)."""
    run = run_ranks(2, "c10d_timeouts.py", timeout=120, env={"PSRT_TIMEOUT": "300"}).check()
    [record] = run.records()
    want = {
        "recv": ("recv from rank 1 (tag 9) on group 0 (global ranks [0, 1])", 3, "global rank 1"),
        "recv-any": ("recv from any rank (tag 8) on group 0 (global ranks [0, 1])", 3, "any of global ranks [1]"),
        "irecv-wait": ("recv from rank 1 (tag 7) on group 0 (global ranks [0, 1])", 3, "global rank 1"),
        "all_reduce": ("allreduce on group 1 (global ranks [0, 1])", 3, "global ranks [1]"),
        "barrier-call-timeout": ("barrier on group 2 (global ranks [0, 1])", 1, "global ranks [1]"),
    }
    assert set(record) == set(want), record
    for name, (call, seconds, peers) in want.items():
        got = record[name]
        assert got["error"] == (f"TimeoutError: psrt backend: {call}: Timed out after {seconds} s waiting for "
                                f"{peers} (the timeout= of the group, or of the call)"), (name, got)
        # never before the timeout; the margin is for a loaded 2-core machine
        assert seconds - 0.05 <= got["seconds"] < seconds + 3, (name, got)
    assert run.stdout.count(": done") == 2


def test_bench_c10d(tmp_path):
    """The bench part runs one job per N and prints every row with its ratios and the goals."""
    out = tmp_path / "c10d.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_", "PMIX_", "PMI_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "psrt.bench", "c10d", "--np", "2", "--grad-mb", "1",
                           "--steps", "1", "--rounds", "1", "--json", str(out)], capture_output=True,
                          text=True, timeout=300, env=env, stdin=subprocess.DEVNULL, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json
    payload = json.loads(out.read_text())
    ways = {r["way"] for r in payload["rows"]}
    assert ways == {"ddp/psrt-ring", "ddp/psrt-auto", "ddp/psrt-ps", "ddp/gloo", "psrt --dp ring",
                    "fsdp2/psrt-ring", "fsdp2/psrt-auto", "fsdp2/psrt-ps", "fsdp2/gloo",
                    "all-reduce/psrt-auto", "all-reduce/gloo"}
    assert all(r["step_s"] > 0 and r["vs_gloo"] > 0 for r in payload["rows"])
    assert len(payload["goals"]) == 3 and proc.stdout.count("goal ") == 3
    assert "x same on gloo" in proc.stdout


def test_one_call_shortcut():
    """psrt.init_process_group() is init_process_group(backend='psrt') in one call."""
    code = ("import psrt, torch, torch.distributed as dist; pg = psrt.init_process_group(); "
            "t = torch.ones(2); dist.all_reduce(t); print(dist.get_backend(), type(pg).__name__, t.tolist())")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_", "MASTER_"))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=dict(env, PYTHONPATH=str(ROOT)), stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "psrt ProcessGroupPsrt [1.0, 1.0]" in proc.stdout
