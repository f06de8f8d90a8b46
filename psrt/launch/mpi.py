"""The machine's MPI: which mpirun, which flavour, and running a launcher in the foreground."""
from __future__ import annotations

import os
import shutil
import signal
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


def find_mpirun(explicit: str | None = None) -> str:
    """The mpirun to use: --mpirun, else mpirun, else mpiexec on PATH."""
    for name in ([explicit] if explicit else ["mpirun", "mpiexec"]):
        path = shutil.which(name)
        if path:
            return path
    if explicit:
        raise PsrtError(f"--mpirun {explicit}: not found or not executable")
    raise PsrtError("no MPI found: neither mpirun nor mpiexec is on PATH (install Open MPI, "
                    "e.g. apt install openmpi-bin, or MPICH; inside Slurm, srun is used)")


def run_job(argv, env) -> int:
    """Run a launcher in the foreground and return its exit code (128 + N for signal N).

    On Ctrl-C or SIGTERM the launcher is given the signal and a few seconds to stop its
    ranks (remote ones included) before it is killed: killing mpirun outright would leave
    them behind.
    """
    proc = subprocess.Popen(argv, env=env)
    try:
        code = proc.wait()
    except BaseException as err:
        proc.send_signal(signal.SIGINT if isinstance(err, KeyboardInterrupt) else signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    return 128 - code if code < 0 else code


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
