"""--dp ring, native, torch and zero1/2/3 on N = 1, 2, 3, 4 ranks leave the same parameters after
k steps as one process on the whole global batch (tests/mpi/ranks/dp_equivalence.py; one launch
of 4 ranks runs every size on sub-communicators), with SGD and, for the sharded ones, Adam with
the optimizer on the parameters' own device and offloaded to the host.  The
test model has 553 parameters in 4 layers, so no N above 1 divides every unit evenly.

Tolerance (fp32): the runs differ from the reference only in the order in which per-sample
gradients are summed (per worker and per micro-batch means, then averaged over ranks, by
ring / MPI / gloo in their own order) - a few ulps per step.  Three steps of SGD with
momentum do not amplify that noticeably (measured: 3e-8 on parameters of size ~0.3), so
|got - ref| <= 1e-6 + 1e-5 |ref| holds, while any real mistake (a sum instead of an
average, a lost micro-batch, a rank that kept its own initial parameters) moves parameters
by 1e-2 or more.  The reduced loss must match the reference's loss at every step as well.

With fp16 compression every gradient is rounded to 11 significant bits (relative error
<= 2**-11 = 4.9e-4) before it is averaged; three SGD steps of lr 0.1 on gradients of size
< 1 move parameters by at most ~3 * 0.1 * 5e-4 ~ 1.5e-4 from the fp32 run, so atol 1e-3.
"""
from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict

import pytest
from conftest import MPI_SCRIPTS, ROOT, RankRun, mpirun_argv

STRATEGIES = ("ring", "native", "torch", "zero", "zero2", "zero3")
SHARDED = ("zero1", "zero2", "zero3")
SIZES = (1, 2, 3, 4)


def launch(np_: int, *args: str, timeout: float = 400) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = mpirun_argv(np_) + [sys.executable, str(MPI_SCRIPTS / "dp_equivalence.py"), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=subprocess.DEVNULL)
    return RankRun(proc).check().records()


def by_strategy_and_size(*args: str) -> dict:
    """One launch of 4 ranks over every size: {(dp, n): one record per rank}."""
    by = defaultdict(list)
    for r in launch(4, *args, "--sizes", "1,2,3,4", "--accum", "2", "--unused", "--steps", "3"):
        by[(r["dp"], r["size"])].append(r)
    return by


@pytest.fixture(scope="module")
def fp32_records():
    return by_strategy_and_size("--dp", ",".join(STRATEGIES), "--optimizer", "sgd", "--momentum", "0.9")


@pytest.mark.mpi
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dp", STRATEGIES)
def test_n_ranks_equal_one_process(fp32_records, dp, n):
    check(fp32_records[(dp, n)], n)


def check(recs: list, n: int) -> None:
    assert len(recs) == n, f"expected one record per rank, got {recs}"
    for r in recs:
        assert r["ok"], f"rank {r['rank']}: parameters {r['bad_params']} differ (max {r['max_abs']})"
        assert r["loss_ok"], (r["losses"], r["ref_losses"])


@pytest.fixture(scope="module")
def adam_records():
    # Each sharded stage twice in one launch: its optimizer over views of the flat parameters,
    # and offloaded (its masters and state in separate host tensors, copied down and up each step).
    return by_strategy_and_size("--dp", ",".join(SHARDED + tuple(f"{dp}/offload" for dp in SHARDED)),
                                "--optimizer", "adam", "--lr", "0.01")


@pytest.mark.mpi
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("offload", ("", "/offload"))
@pytest.mark.parametrize("dp", SHARDED)
def test_sharded_with_adam_equal_one_process(adam_records, dp, offload, n):
    check(adam_records[(dp + offload, n)], n)


@pytest.mark.mpi
def test_fp16_gradients_on_three_ranks():
    recs = launch(3, "--dp", "ring,zero,zero2,zero3", "--optimizer", "sgd", "--momentum", "0",
                  "--compress", "fp16", "--rtol", "0", "--atol", "1e-3", "--accum", "2")
    assert {r["dp"] for r in recs} == {"ring", "zero", "zero2", "zero3"} and len(recs) == 12
    for r in recs:
        assert r["ok"], r
