"""`python -m psrt.bench oversubscription`: the ring's and the server's training step with ranks
that busy-poll while they wait in MPI and with ranks that yield the core (PSRT_YIELD=0 / 1),
under mpirun on this host and under srun on two emulated Slurm nodes (`--srun`, root).

With more ranks than cores a polling rank keeps its core for its whole time slice, while the
rank it waits for may be the one that needs the core: every sequential step of a collective
can then cost a scheduler time slice instead of microseconds.  Open MPI's
mpi_yield_when_idle makes a waiting rank call sched_yield() between polls, which psrt turns
on before MPI starts when the launcher says a host has more ranks than cores (psrt.world).
The ring pays this 2(N-1) times per all-reduce, the parameter server twice.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

from psrt.bench import jobs

HELP = "ring and PS step with PSRT_YIELD=0 and 1, under mpirun here and srun on emulated Slurm nodes"
ROOT = Path(__file__).resolve().parents[2]


def add_arguments(p) -> None:
    p.add_argument("--np", type=int, default=8, help="ranks (default: 8, on this host or 4 per Slurm node)")
    p.add_argument("--srun", action="store_true", help="also under srun on 2 emulated Slurm nodes (root)")
    p.add_argument("--steps", type=int, default=20, help="steps per timed round (default: 20)")
    p.add_argument("--json", help="write the rows as JSON")


def training_args(args) -> list[str]:
    return ["training", "--dp", "ring,ps", "--model", "mlp", "--width", "128", "--layers", "1",
            "--steps", str(args.steps), "--rounds", "3", "--quiet"]


def under_srun(args, yield_: str) -> dict:
    """The training bench as one srun job over 2 emulated Slurm nodes (a cluster made and
    removed here)."""
    from psrt.launch import cluster as C
    tag = zlib.crc32(f"{os.getpid()}:oversub".encode())
    per_node = -(-args.np // 2)      # Slurm CPUs (slots) each node offers: the ranks fit
    cluster = C.Cluster((f"o{tag % 10**7:07d}a", f"o{tag % 10**7:07d}b"), f"198.19.{tag % 256}.0/24", slurm=True,
                        slots=(per_node, per_node))
    with C.running(cluster):
        # each slurmd has a /tmp of its own: the result goes where every node sees it
        with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
            out = os.path.join(tmp, "out.json")
            argv = ["srun", "-N", "2", "-n", str(args.np), "--mpi=pmix", sys.executable, "-m", "psrt.bench",
                    *training_args(args), "--json", out]
            env = C.job_env(cluster, "openmpi4", dict(jobs.rank_env(), PSRT_YIELD=yield_))
            code = subprocess.run(C.exec_argv(cluster.hosts[0], argv), env=env, cwd=ROOT,
                                  stdin=subprocess.DEVNULL).returncode
            return jobs.read_result(code, out, f"srun -n {args.np} psrt.bench training (PSRT_YIELD={yield_})")


def mpi_yields(seen: list) -> str:
    """'8/8': how many ranks' MPI said it yields ('?' where a library could not say)."""
    if any(v is None for v in seen):
        return "?"
    return f"{sum(map(bool, seen))}/{len(seen)}"


def command(args) -> int:
    from psrt.bench import report
    from psrt.bench.report import need
    from psrt.bench.suite import netns_ok
    need(args.np >= 2, f"--np {args.np}: needs at least 2 ranks")
    need(args.steps >= 1, f"--steps {args.steps}: must be at least 1")
    if args.srun:
        missing = netns_ok()
        need(missing is None, f"--srun: {missing}")
    rows = []
    launchers = ["mpirun"] + (["srun"] if args.srun else [])
    for launcher in launchers:
        for yield_ in ("0", "1"):
            print(f"psrt bench: {launcher} -n {args.np}, PSRT_YIELD={yield_}", file=sys.stderr, flush=True)
            if launcher == "mpirun":
                out = jobs.local(args.np, training_args(args), env={"PSRT_YIELD": yield_})
            else:
                out = under_srun(args, yield_)
            seen = out["meta"]["yield_when_idle"]
            if any(v is not None and v != (yield_ == "1") for v in seen):
                print(f"psrt bench: warning: PSRT_YIELD={yield_}, yet MPI yields on {mpi_yields(seen)} ranks: "
                      "these rows do not compare what they say", file=sys.stderr, flush=True)
            rows += [{"launcher": launcher, "yield": yield_, "dp": r["dp"], "step_ms": r["step_s"] * 1e3,
                      "ranks_yield_when_idle": seen, "mpi_yields": mpi_yields(seen)} for r in out["rows"]]
    step = {(r["launcher"], r["yield"], r["dp"]): r["step_ms"] for r in rows}
    for r in rows:
        r["poll_over_yield"] = step[(r["launcher"], "0", r["dp"])] / step[(r["launcher"], "1", r["dp"])]
    print(f"# training step, {args.np} ranks on {os.cpu_count()} cores (mlp 128x1, 32 samples per rank); "
          "poll/yield = step with PSRT_YIELD=0 over the step with PSRT_YIELD=1; MPI yields = ranks whose "
          "MPI library reported mpi_yield_when_idle on")
    report.table(rows, [("launcher", "launcher", ""), ("yield", "PSRT_YIELD", ""), ("dp", "strategy", ""),
                        ("mpi_yields", "MPI yields", ""), ("step_ms", "step (ms)", ".2f"),
                        ("poll_over_yield", "poll/yield", ".2f")])
    if args.json:
        report.write_json(args.json, {"rows": rows})
    return 0
