"""Building launcher command lines (mpirun / srun).  See `mpi_launch`."""
from __future__ import annotations

import os
import shutil
import subprocess

from psrt.errors import PsrtError


def mpi_flavour(mpirun: str = "mpirun") -> str:
    """'openmpi4', 'openmpi5', 'mpich' or 'unknown', from `mpirun --version`."""
    path = shutil.which(mpirun)
    if path is None:
        raise PsrtError(f"no {mpirun} on PATH: install an MPI (see README, 'Install')")
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    text = out.stdout + out.stderr
    if "Open MPI" in text or "OpenRTE" in text:
        for line in text.splitlines():
            if ")" in line and any(ch.isdigit() for ch in line):
                version = line.rsplit(" ", 1)[-1]
                return "openmpi" + version.split(".")[0]
        return "openmpi"
    if "HYDRA" in text or "MPICH" in text:
        return "mpich"
    return "unknown"


def local_mpirun_prefix(np_: int, mpirun: str = "mpirun") -> list[str]:
    """mpirun argv for N ranks on this host, oversubscribing when N exceeds the cores.

    Ranks that busy-poll on an oversubscribed host starve each other, so they are told to
    yield when idle (Open MPI's mpi_yield_when_idle).
    """
    flavour = mpi_flavour(mpirun)
    argv = [shutil.which(mpirun), "-np", str(np_)]
    if flavour.startswith("openmpi"):
        if os.geteuid() == 0:
            argv.append("--allow-run-as-root")
        if np_ > (os.cpu_count() or 1):
            argv.append("--oversubscribe")
        argv += ["--mca", "mpi_yield_when_idle", "1", "--bind-to", "none"]
    return argv
