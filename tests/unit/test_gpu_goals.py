"""scripts/gpu_check.sh's table (psrt/bench/gpu_goals.py), read from files written here the
way the check's steps write them: each goal met or missed from its figures, and a missing
figure named with the step that did not leave it."""
import json
from pathlib import Path

from psrt.bench import gpu_goals

MIB = 1 << 20


def junit(path: Path, failed: int = 0, losses: dict | None = None) -> None:
    props = ""
    if losses is not None:
        value = json.dumps(losses).replace('"', "&quot;")
        props = f'<properties><property name="losses" value="{value}"/></properties>'
    cases = f'<testcase name="test_the_cli_on_cuda_reaches_the_cpu_losses[dp]">{props}</testcase>'
    path.write_text(f'<testsuites><testsuite tests="5" failures="{failed}" errors="0" skipped="1">{cases}'
                    "</testsuite></testsuites>")


def row(coll, algo, n, ms, **extra):
    return dict(collective=coll, algorithm=algo, nbytes=n, time_us=ms * 1e3, **extra)


def by_text(goals, start):
    (found,) = [g for g in goals if g.text.startswith(start)]
    return found


def test_the_goals_read_back(tmp_path):
    junit(tmp_path / "tests.openmpi.xml", losses={"ring": {"cpu": 2.0, "gpu": 2.0001, "rtol": 1e-4},
                                                  "ps": {"cpu": 2.0, "gpu": 2.01, "rtol": 1e-4}})
    junit(tmp_path / "tests.impi.xml", failed=2)
    staged = [row("allreduce", "ring", n, t, model_us=m * 1e3, vs_model=t / m)
              for n, t, m in ((MIB, 0.5, 0.45), (16 * MIB, 6.0, 5.0), (64 * MIB, 20.0, 30.0))]
    staged += [row("allreduce", "torch", n, t) for n, t in ((MIB, 1.0), (16 * MIB, 10.0), (64 * MIB, 25.0))]
    staged += [row("allreduce", "auto", n, t) for n, t in ((MIB, 0.6), (16 * MIB, 6.0), (64 * MIB, 20.0))]
    (tmp_path / "collectives.openmpi.json").write_text(json.dumps({"meta": {"cuda_direct": False}, "rows": staged}))
    direct = [row("allreduce", "native", 16 * MIB, 1.0), row("allreduce", "staged:native", 16 * MIB, 5.0, differ=0),
              row("allgather", "ring", 64 * MIB, 2.0), row("allgather", "staged:ring", 64 * MIB, 1.0, differ=3)]
    (tmp_path / "collectives.impi.json").write_text(json.dumps({"meta": {"cuda_direct": True}, "rows": direct}))
    (tmp_path / "info.impi.txt").write_text("[rank 0@vm] CUDA tensors go straight to MPI: the library is "
                                            "CUDA-aware (MPIX_Query_cuda_support() = 1)\n")
    (tmp_path / "c10d.impi.json").write_text(json.dumps({"goals": [
        {"goal": "N=2, CUDA: DDP on psrt at most 0.9x the step of DDP on gloo", "measured": "ddp/psrt-ring",
         "ratio": 0.3}]}))
    (tmp_path / "steps.txt").write_text("c10d.host 124 120\nc10d.gpu 1 30\npingpong.host 0 5\n")
    goals = gpu_goals.goals(tmp_path)

    assert by_text(goals, "CUDA tests under the machine's").ok is True
    impi_tests = by_text(goals, "CUDA tests under Intel MPI")
    assert impi_tests.ok is False and impi_tests.value.startswith("2 failed (2 passed, 2 failed, 1 skipped)")
    assert by_text(goals, "train dp --dp ring").ok is True
    assert by_text(goals, "train dp --dp ps").ok is False
    assert by_text(goals, "staged all-reduce, host sums, 1 MiB").ok is True            # 0.5x
    assert by_text(goals, "staged all-reduce, host sums, 16 MiB").ok is True           # 0.6x
    assert by_text(goals, "staged all-reduce, host sums, 64 MiB").ok is False          # 0.8x > 0.7x
    assert by_text(goals, "staged all-reduce 1 MiB: within").ok is True                # +11%
    assert by_text(goals, "staged all-reduce 16 MiB: within").ok is True               # +20%
    assert by_text(goals, "staged all-reduce 64 MiB: within").ok is False              # -33%
    assert by_text(goals, "staged all-reduce, auto's").value == "worst 0.80x"
    assert by_text(goals, "Intel MPI: MPIX_Query").ok is True
    assert by_text(goals, "Intel MPI: direct results").value.startswith("3 elements differ")
    assert by_text(goals, "Intel MPI allreduce 16 MiB").ok is True                     # 0.2x the staged
    assert by_text(goals, "Intel MPI allgather 64 MiB").ok is False                    # 2x the staged
    assert by_text(goals, "DDP on psrt (Intel MPI)").ok is True
    assert by_text(goals, "DDP on psrt (staged, host sums)").value == \
        "not measured: step c10d.host ran out of time (120 s; gpu_check.log)"
    assert by_text(goals, "DDP on psrt (staged, GPU sums)").value == \
        "not measured: step c10d.gpu exited 1 after 30 s (gpu_check.log)"
    assert by_text(goals, "pipeline sends of CUDA tensors (staged)").value == \
        "not measured: step pingpong.host left no figure"


def test_an_empty_folder_gives_a_reason_on_every_row(tmp_path):
    (tmp_path / "steps.txt").write_text("info.impi 200 0\ncollectives.impi 200 0\n")
    goals = gpu_goals.goals(tmp_path)
    assert goals and all(g.ok is None for g in goals)
    assert all(g.value.startswith(("not measured", "not run")) for g in goals), [g.value for g in goals]
    assert by_text(goals, "Intel MPI: MPIX_Query").value.startswith("not run: no Intel MPI bundle")
    assert gpu_goals.main([str(tmp_path)]) == 0
    assert json.loads((tmp_path / "goals.json").read_text())["goals"]
