"""Run a benchmark's rank side as an MPI job, on this host or on an emulated cluster, and
read back the JSON it wrote.  The suite (psrt.bench suite, network, training) is a driver
outside MPI: it starts one job per world size and placement."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from psrt.errors import PsrtError


def _bench(args: list[str], out: str) -> list[str]:
    return [sys.executable, "-m", "psrt.bench"] + list(args) + ["--json", out]


def rank_env() -> dict:
    # One thread per rank, as mpi_launch sets it: torch's intra-op threads would fight the
    # other ranks for the cores and skew every comparison.
    return dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))


def read_result(code: int, out: str, what: str) -> dict:
    """The JSON a job (`what`) wrote to `out`, or a one-line error saying it failed."""
    if code != 0 or not os.path.exists(out):
        raise PsrtError(f"{what} failed (exit {code}); its output is above")
    with open(out) as f:
        return json.load(f)


def local(np_: int, args: list[str], timeout_s: float | None = None, env: dict | None = None) -> dict:
    """`mpirun -np N python -m psrt.bench ARGS --json F` on this host, with `env` added to
    this process's environment (a PSRT_YIELD there decides yielding, not mpirun); F's content."""
    from psrt.launch.mpi import local_mpirun_prefix
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        cmd = local_mpirun_prefix(np_, yield_when_idle="PSRT_YIELD" not in (env or {})) + _bench(args, out)
        try:
            code = subprocess.run(cmd, stdin=subprocess.DEVNULL, env={**rank_env(), **(env or {})},
                                  timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            raise PsrtError(f"`{' '.join(args[:1])}` on {np_} ranks took more than {timeout_s:.0f} s") from None
        return read_result(code, out, f"psrt.bench {args[0]} on {np_} local ranks")


def on_cluster(cluster, ranks_per_host: list[tuple[str, int]], args: list[str]) -> dict:
    """The same on a running emulated cluster (psrt.cluster.running), `ranks_per_host` being
    [(host, ranks)] in rank order; mpirun starts on the first host."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        code = run_on_cluster(cluster, ranks_per_host, _bench(args, out))
        layout = "+".join(str(n) for _, n in ranks_per_host)
        return read_result(code, out, f"psrt.bench {args[0]} on emulated hosts ({layout} ranks)")


def run_on_cluster(cluster, ranks_per_host: list[tuple[str, int]], argv: list[str]) -> int:
    """Any command `argv` as an MPI job on a running emulated cluster (as on_cluster); its
    exit code."""
    from psrt.launch import cluster as C
    from psrt.launch.hostfile import Host
    from psrt.launch.mpi import find_mpirun, mpi_flavour, run_job
    from psrt.launch.plan import Request, plan_mpirun

    mpirun = find_mpirun()
    flavour = mpi_flavour(mpirun)
    req = Request(command=tuple(argv), hosts=tuple(Host(h, n) for h, n in ranks_per_host),
                  np=sum(n for _, n in ranks_per_host), emulated=True, threads=1)
    env = C.job_env(cluster, flavour, rank_env())
    plan = plan_mpirun(req, flavour, mpirun, env, os.cpu_count() or 1, emulation=C.mpi_flags(cluster, flavour))
    return run_job(C.exec_argv(cluster.hosts[0], plan.argv), {**env, **plan.env})
