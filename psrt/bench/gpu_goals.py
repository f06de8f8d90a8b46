"""`python -m psrt.bench.gpu_goals DIR`: every GPU goal, met or missed, in one table, read
from what scripts/gpu_check.sh left in DIR.

Each goal is a ratio of a measured row to a peer row of the same run (psrt.bench.goal).  A
goal whose files are missing says why in one line: which step of the check failed, with its
exit code, from DIR/steps.txt (`STEP EXIT SECONDS` per line).

Files read (MPI is `openmpi`, the machine's, or `impi`, Intel MPI's runtime from the bundle):
    tests.MPI.xml                pytest --junitxml of the CUDA tests; test_cuda.py records the
                                 CPU and GPU losses of each strategy as the property `losses`
    info.MPI.txt                 psrt.info's lines (how CUDA tensors meet that MPI)
    collectives.MPI.json         psrt.bench collectives --device cuda --json
    pingpong.host.json, pingpong.cuda.json, pingpong.cuda-impi.json
    c10d.host.json, c10d.gpu.json, c10d.impi.json   psrt.bench c10d --json (DDP vs gloo)
"""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from psrt.bench.goal import Goal

MIB = 1 << 20
ALLREDUCE_SIZES = (1 * MIB, 16 * MIB, 64 * MIB)
ZERO_SIZES = (16 * MIB, 64 * MIB)
MPIS = {"openmpi": "the machine's Open MPI", "impi": "Intel MPI"}
# Staged all-reduce against gloo (torch.distributed on two ranks sharing one GPU): at or
# under its time at every size, at most 0.7x at 16 and 64 MiB; within 1.25x of the
# three-stage pipeline's model (collectives/staged.py staged_time).
VS_GLOO = {1 * MIB: 1.0, 16 * MIB: 0.7, 64 * MIB: 0.7}
VS_MODEL = 1.25
NO_BUNDLE = 200    # scripts/gpu_check.sh's code for a step it could not run: no Intel MPI bundle


class Run:
    """The files of one run of the check and why a missing one is missing."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.steps: dict[str, tuple[int, float]] = {}
        steps = self.folder / "steps.txt"
        if steps.exists():
            for line in steps.read_text().splitlines():
                parts = line.split()
                if len(parts) == 3:
                    self.steps[parts[0]] = (int(parts[1]), float(parts[2]))

    def why(self, step: str) -> str:
        """One line on a step that left no figure."""
        if step not in self.steps:
            return f"not measured: step {step} did not run"
        code, seconds = self.steps[step]
        if code == NO_BUNDLE:
            return "not run: no Intel MPI bundle with the checkout (bash scripts/gpu_bundle.sh makes .gpu/)"
        if code in (124, 137):
            return f"not measured: step {step} ran out of time ({seconds:.0f} s; gpu_check.log)"
        if code:
            return f"not measured: step {step} exited {code} after {seconds:.0f} s (gpu_check.log)"
        return f"not measured: step {step} left no figure"

    def json(self, name: str) -> dict | None:
        path = self.folder / name
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def text(self, name: str) -> str:
        path = self.folder / name
        return path.read_text(errors="replace") if path.exists() else ""


def test_goals(run: Run) -> list[Goal]:
    """The CUDA tests under each MPI: none failed, some ran."""
    out = []
    for mpi, name in MPIS.items():
        text = f"CUDA tests under {name}: none fails"
        try:
            suite = ET.parse(run.folder / f"tests.{mpi}.xml").getroot()
        except (OSError, ET.ParseError):
            out.append(Goal(text, "failed", "tests", "<=", 0, missing=run.why(f"tests.{mpi}")))
            continue
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        n, failed = int(suite.get("tests", 0)), int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped = int(suite.get("skipped", 0))
        detail = f"({n - failed - skipped} passed, {failed} failed, {skipped} skipped)"
        out.append(Goal(text, "failed", "tests", "<=", 0, float(failed) if n - skipped else None, digits=0,
                        unit=" failed", detail=detail, missing=f"no test ran {detail}"))
    return out


def loss_goals(run: Run) -> list[Goal]:
    """psrt.train --device cuda against --device cpu, strategy by strategy: |difference|
    over max(1, |cpu loss|) within the test's tolerance (fp32: 1e-4)."""
    out = []
    try:
        suite = ET.parse(run.folder / "tests.openmpi.xml").getroot()
    except (OSError, ET.ParseError):
        return [Goal("train on cuda = on cpu (losses)", "gpu", "cpu", "<=", 1.0, missing=run.why("tests.openmpi"))]
    for case in suite.iter("testcase"):
        for prop in case.iter("property"):
            if prop.get("name") != "losses":
                continue
            layout = case.get("name", "").partition("[")[2].rstrip("]")
            for dp, f in json.loads(prop.get("value")).items():
                diff = abs(f["gpu"] - f["cpu"]) / max(1.0, abs(f["cpu"]))
                out.append(Goal(f"train {layout} --dp {dp}: cuda loss = cpu loss within {f['rtol']:g} (relative)",
                                "gpu", "cpu", "<=", f["rtol"], diff, spec=".1e", unit="",
                                detail=f"(cpu {f['cpu']:.6f}, gpu {f['gpu']:.6f})"))
    return out or [Goal("train on cuda = on cpu (losses)", "gpu", "cpu", "<=", 1.0,
                        missing="not measured: the training tests recorded no losses (tests.openmpi.xml)")]


def _rows(data: dict | None) -> dict:
    """{(collective, algorithm, nbytes): row} of a collectives JSON."""
    return {(r["collective"], r["algorithm"], r["nbytes"]): r for r in (data or {}).get("rows", [])}


def _best(rows: dict, collective: str, nbytes: int, prefix: str = "", exclude=("torch", "nccl", "auto")):
    """The fastest psrt row `prefix + ALGO` (ALGO one of psrt's own) at a size, or None."""
    found = [r for (c, a, n), r in rows.items() if c == collective and n == nbytes and a.startswith(prefix)
             and ":" not in a[len(prefix):] and a[len(prefix):] not in exclude]
    return min(found, key=lambda r: r["time_us"]) if found else None


def _size(n: int) -> str:
    return f"{n // MIB} MiB"


def staged_goals(run: Run) -> list[Goal]:
    """Under the machine's MPI (not CUDA-aware): staged psrt beside gloo and the model."""
    data = run.json("collectives.openmpi.json")
    rows = _rows(data)
    why = run.why("collectives.openmpi")
    out = []
    for n in ALLREDUCE_SIZES:
        gloo = rows.get(("allreduce", "torch", n))
        for label, prefix in (("host sums", ""), ("GPU sums", "gpu-reduce:")):
            best = _best(rows, "allreduce", n, prefix)
            ratio = best["time_us"] / gloo["time_us"] if best and gloo else None
            detail = (f"({best['algorithm']} {best['time_us'] / 1e3:.2f} ms, gloo {gloo['time_us'] / 1e3:.2f} ms)"
                      if ratio else "")
            # the goal is the default's (sums on the host); the GPU's sums are shown beside it
            text = (f"staged all-reduce, {label}, {_size(n)}: at most {VS_GLOO[n]:g}x gloo's time" if not prefix
                    else f"staged all-reduce, {label} (PSRT_STAGED_REDUCE=gpu), {_size(n)}: time over gloo's")
            out.append(Goal(text, "staged", "gloo", "<=", VS_GLOO[n], ratio, detail=detail, judged=not prefix,
                            missing=why if data is None else "not measured: no such rows"))
    for n in ALLREDUCE_SIZES:
        best = _best(rows, "allreduce", n)
        ratio = best.get("vs_model") if best else None
        out.append(Goal(f"staged all-reduce {_size(n)}: within {VS_MODEL - 1:.0%} of its pipelined model",
                        "staged", "model", "within", VS_MODEL - 1, ratio,
                        detail=f"({best['algorithm']}, model {best['model_us'] / 1e3:.2f} ms)" if ratio else "",
                        missing=why if data is None else "not measured: no model (no host row)"))
    auto = [rows.get(("allreduce", "auto", n)) for n in ALLREDUCE_SIZES]
    gloo = [rows.get(("allreduce", "torch", n)) for n in ALLREDUCE_SIZES]
    if all(auto) and all(gloo):
        worst = max(a["time_us"] / g["time_us"] for a, g in zip(auto, gloo))
        out.append(Goal("staged all-reduce, auto's choice, 1-64 MiB: at or under gloo's time", "auto", "gloo",
                        "<=", 1.0, worst, worst=True))
    for coll in ("reduce_scatter", "allgather"):
        for n in ZERO_SIZES:
            best, gloo = _best(rows, coll, n), rows.get((coll, "torch", n))
            ratio = best["time_us"] / gloo["time_us"] if best and gloo else None
            out.append(Goal(f"staged {coll.replace('_', '-')} {_size(n)}: time over gloo's (no goal set)",
                            "staged", "gloo", "<=", 1.0, ratio, judged=False,
                            detail=f"({best['algorithm']})" if ratio else "",
                            missing=why if data is None else "not measured: no such rows"))
    out.append(Goal("nccl all-reduce", "nccl", "gloo", "<=", 1.0,
                    missing="not run: NCCL needs a GPU per rank, and this machine's 2 ranks share one"))
    return out


def direct_goals(run: Run) -> list[Goal]:
    """Under Intel MPI: the library says it takes CUDA buffers, psrt hands them over, the
    results equal the staged path's, and the time beside the staged one."""
    info = run.text("info.impi.txt")
    line = next((text.split("] ", 1)[-1] for text in info.splitlines() if "CUDA tensors" in text), None)
    out = [Goal("Intel MPI: MPIX_Query_cuda_support() = 1, CUDA tensors go straight to MPI", "query", "1",
                ">=", 1, (1.0 if "go straight to MPI" in line else 0.0) if line else None, digits=0,
                unit=" (1: yes)", detail=f"({line})" if line else "",
                missing=run.why("info.impi") if not info else "not measured: psrt.info printed no CUDA line")]
    data = run.json("collectives.impi.json")
    rows = _rows(data)
    why = run.why("collectives.impi") if data is None else "not measured: no such rows"
    if data is not None and not data.get("meta", {}).get("cuda_direct", False):
        why = "not measured: Intel MPI did not take CUDA buffers here (the run was staged)"
        rows = {}
    differ = [r["differ"] for r in rows.values() if r.get("differ") is not None]
    out.append(Goal("Intel MPI: direct results = staged results, bit for bit", "direct", "staged",
                    "<=", 0, float(sum(differ)) if differ else None, digits=0, unit=" elements differ",
                    detail=f"(over {len(differ)} rows)", missing=why))
    for coll, sizes in (("allreduce", ALLREDUCE_SIZES), ("reduce_scatter", ZERO_SIZES), ("allgather", ZERO_SIZES)):
        for n in sizes:
            direct, staged = _best(rows, coll, n), _best(rows, coll, n, "staged:")
            ratio = direct["time_us"] / staged["time_us"] if direct and staged else None
            out.append(Goal(f"Intel MPI {coll.replace('_', '-')} {_size(n)}: direct at most the staged time",
                            "direct", "staged", "<=", 1.0, ratio,
                            detail=(f"({direct['algorithm']} {direct['time_us'] / 1e3:.2f} ms, staged "
                                    f"{staged['time_us'] / 1e3:.2f} ms)") if ratio else "",
                            judged=n >= 16 * MIB, missing=why))
    return out


def pingpong_goals(run: Run) -> list[Goal]:
    """The pipeline's sends of CUDA tensors beside the same bytes from host memory."""
    host = run.json("pingpong.host.json")
    out = []
    for name, label in (("cuda", "staged"), ("cuda-impi", "direct, Intel MPI")):
        data = run.json(f"pingpong.{name}.json")
        ratio, detail = None, ""
        if host and data:
            h = {p["nbytes"]: p["one_way_s"] for p in host["points"]}
            c = {p["nbytes"]: p["one_way_s"] for p in data["points"]}
            common = sorted(set(h) & set(c))
            if common:
                n = common[-1]
                ratio, detail = c[n] / h[n], f"({_size(n)}: {c[n] * 1e3:.2f} ms, host {h[n] * 1e3:.2f} ms)"
        out.append(Goal(f"pipeline sends of CUDA tensors ({label}): one-way time over host memory's (no goal set)",
                        "cuda", "host", "<=", 1.0, ratio, judged=False, detail=detail,
                        missing=run.why(f"pingpong.{name}" if host else "pingpong.host")))
    return out


def ddp_goals(run: Run) -> list[Goal]:
    """torch DDP on psrt's backend against gloo on the 25M-parameter MLP: at most 0.9x the step."""
    out = []
    for name, label in (("host", "staged, host sums"), ("gpu", "staged, GPU sums"), ("impi", "Intel MPI")):
        data = run.json(f"c10d.{name}.json")
        found = [g for g in (data or {}).get("goals", []) if "0.9x" in g["goal"]]
        if found:
            g = found[0]
            out.append(Goal(f"DDP on psrt ({label}): at most 0.9x gloo's step, 25M-parameter MLP", g["measured"],
                            "gloo", "<=", 0.9, g["ratio"], detail=f"({g['measured']})"))
        else:
            out.append(Goal(f"DDP on psrt ({label}): at most 0.9x gloo's step, 25M-parameter MLP", "ddp",
                            "gloo", "<=", 0.9, missing=run.why(f"c10d.{name}")))
    return out


def goals(folder: Path) -> list[Goal]:
    run = Run(folder)
    return (test_goals(run) + loss_goals(run) + staged_goals(run) + direct_goals(run) + pingpong_goals(run)
            + ddp_goals(run))


def main(argv: list[str] | None = None) -> int:
    from psrt.bench import goal, report
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python -m psrt.bench.gpu_goals DIR (the folder scripts/gpu_check.sh wrote)", file=sys.stderr)
        return 2
    found = goals(Path(argv[0]))
    report.table(goal.rows(found), goal.COLUMNS)
    met = sum(g.ok is True for g in found)
    missed = sum(g.ok is False for g in found)
    print(f"# {met} met, {missed} missed, {len(found) - met - missed} without a verdict, of {len(found)}")
    report.write_json(str(Path(argv[0]) / "goals.json"), {"goals": goal.rows(found)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
