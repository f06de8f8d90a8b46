"""The benchmark suite: the alpha-beta model, the training and ping-pong benchmarks, the
network-bound regime on shaped emulated hosts, and `suite --quick` end to end."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# --- rank side, under mpirun ------------------------------------------------------------------

@pytest.mark.mpi
def test_training_benchmark_rows(run_ranks, tmp_path):
    """Every strategy (and torch's own DDP) takes timed steps in one job; the ratio to torch
    DDP is computed from the same run."""
    out, trace = tmp_path / "train.json", tmp_path / "trace.json"
    dps = "ps,ps-sharded,ring,native,torch,torch-ddp"
    run_ranks(2, "-m", "psrt.bench", "training", "--dp", dps, "--width", "64", "--steps", "1",
              "--rounds", "1", "--quiet", "--json", str(out), "--trace", str(trace), timeout=300).check()
    rows = json.loads(out.read_text())["rows"]
    # --trace: the ring again, recording a timeline, right after the ring (its overhead row)
    assert [r["dp"] for r in rows] == ["ps", "ps-sharded", "ring", "ring+trace", "native", "torch", "torch-ddp"]
    traced = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in traced} == {0, 1} and {"forward", "backward", "allreduce"} <= {e["name"] for e in traced}
    peer = rows[-1]["step_s"]
    for r in rows:
        assert r["ranks"] == 2 and r["workers"] == 2 and r["global_batch"] == 64
        assert r["step_s"] > 0 and r["step_min_s"] <= r["step_s"]
        assert r["samples_per_s"] == pytest.approx(64 / r["step_s"])
        assert r["vs_torch_ddp"] == pytest.approx(peer / r["step_s"])
        # each rank trained on its own samples: only averaged gradients end in one place
        assert r["max_param_diff"] < 1e-5, r


@pytest.mark.mpi
@pytest.mark.parametrize("device", [None, "cpu"])
def test_pingpong_fit(run_ranks, tmp_path, device):
    """The ping-pong's points and fit: of NumPy buffers through MPI, and (--device) of tensors
    through the pipeline's sends, 16 MiB of them in four 4 MiB pieces."""
    out = tmp_path / "pp.json"
    # 1 and 16 MiB: far enough apart that a busy host still shows the larger one slower
    run_ranks(2, "-m", "psrt.bench", "pingpong", "--sizes", "8,64KiB,1MiB,16MiB", "--repeats", "2",
              "--quiet", "--json", str(out), *(["--device", device] if device else []), timeout=120).check()
    got = json.loads(out.read_text())
    assert ("pipeline's sends of tensors on cpu" if device else "MPI_Send") in got["meta"]["through"]
    assert [p["nbytes"] for p in got["points"]] == [8, 65536, 1 << 20, 16 << 20]
    assert all(p["min_s"] <= p["one_way_s"] <= p["max_s"] for p in got["points"])
    assert got["fit"]["beta_s_per_byte"] > 0 and got["fit"]["alpha_s"] > 0


# --- the emulated network and the whole suite ------------------------------------------------


def _bench(*args, timeout=400):
    return subprocess.run([sys.executable, "-m", "psrt.bench", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, cwd=ROOT)


@pytest.mark.mpi
def test_suite_quick_writes_the_report(tmp_path):
    """`suite --quick` (collectives and training; the network part has its own test) writes
    report.md with the goals, and JSON, CSV and PNG files that agree with it."""
    proc = _bench("suite", "--quick", "--quiet", "--parts", "collectives,training", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = (tmp_path / "report.md").read_text()
    for name in ("collectives.json", "collectives.csv", "allreduce_np2.png", "training.json",
                 "training.csv", "training.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert "## Goals, as measured in this run" in report and "ring DDP step <= torch DDP" in report
    rows = json.loads((tmp_path / "training.json").read_text())["rows"]
    assert {r["ranks"] for r in rows} == {1, 2}
    two = [r for r in rows if r["ranks"] == 2]
    assert all(0 < r["efficiency"] for r in two)
    coll = json.loads((tmp_path / "collectives.json").read_text())["rows"]
    assert {"ps", "ring", "native"} <= {r["algorithm"] for r in coll}
    assert sum(r["wrong"] for r in coll) == 0
    assert proc.stdout.startswith("# psrt benchmark report")
    # per call: psrt's algorithms called four ways beside their bare mpi4py floor, one goal each way
    calls = json.loads((tmp_path / "per_call.json").read_text())["rows"]
    assert sum(r["wrong"] for r in calls) == 0
    floor = {(r["algorithm"], r["nbytes"]): r["time_us"] for r in calls if r["algorithm"].startswith("mpi4py-")}
    judged = [r for r in calls if not r["algorithm"].startswith("mpi4py-")]
    assert len(judged) == 4 * 4 * 2             # ring, halving-doubling, tree, ps x 4 calls x 4 B, 1 KiB
    for r in judged:
        assert r["vs_floor"] == pytest.approx(r["time_us"] / floor[("mpi4py-" + r["algorithm"], r["nbytes"])])
    for call in ("into a held result", "in place", "into a fresh result", "non-blocking"):
        assert f"N=2, {call}" in report and "within 2x of the same schedule in bare mpi4py" in report
    assert "## Per call" in report
    # tracing's overhead on the ring DDP step, from the ring+trace row of the same run
    assert "N=2: ring DDP step with psrt.trace recording < 1.05x the step without" in report


@pytest.mark.mpi
def test_pipeline_bench_matches_its_theory(run_ranks, tmp_path):
    """`python -m psrt.bench pipeline` on 4 ranks: the bubble within 0.1 of (p-1)/(vm+p-1),
    1F1B holding at most p - r micro-batches on rank r, and Megatron's TP byte count."""
    out = tmp_path / "pipeline.json"
    run_ranks(4, "-m", "psrt.bench", "pipeline", "--microbatches", "4", "--t-forward", "0.03",
              "--json", str(out), timeout=300).check()
    res = json.loads(out.read_text())
    assert {r["schedule"] for r in res["bubble"]} == {"gpipe", "1f1b", "interleaved"}
    for row in res["bubble"]:
        assert abs(row["measured"] - row["theory"]) < 0.1, row
    one_f = next(r for r in res["memory"] if r["schedule"] == "1f1b")
    assert one_f["peak_microbatches"] == one_f["theory_microbatches"] == [4, 3, 2, 1]
    tp = res["tp"]
    assert tp["forward_bytes"] == tp["megatron_forward_bytes"] and tp["backward_bytes"] == tp["megatron_backward_bytes"]


@pytest.mark.mpi
def test_oversubscription_bench_turns_yielding_off_and_on(tmp_path):
    """4 ranks on this host's cores with PSRT_YIELD=0 and 1: the poll rows' MPI really polled and
    the yield rows' MPI really yielded (mpi_yield_when_idle as each rank's library reports it,
    although mpirun is told to oversubscribe), and each pair of rounds gives a poll/yield ratio."""
    out = tmp_path / "o.json"
    proc = _bench("oversubscription", "--np", "4", "--steps", "3", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {(r["yield"], r["dp"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("0", "ring"), ("1", "ring"), ("0", "ps"), ("1", "ps")}
    for (yield_, dp), row in rows.items():
        assert row["ranks_yield_when_idle"] == [yield_ == "1"] * 4, (dp, row)
        assert row["mpi_yields"] == ("4/4" if yield_ == "1" else "0/4")
        assert row["poll_over_yield"] == rows[("0", dp)]["step_ms"] / rows[("1", dp)]["step_ms"]
