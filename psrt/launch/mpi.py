"""The machine's MPI: which mpirun, which flavour, and running a launcher in the foreground."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading

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
    """How to call the mpirun to use (--mpirun, else mpirun, else mpiexec on PATH).

    By its bare name whenever PATH finds it under that name: Open MPI takes an mpirun called
    by its absolute path as --prefix and puts that bin directory first on every rank's PATH,
    so `python3` on the ranks would become /usr/bin/python3 instead of the user's.
    """
    for name in ([explicit] if explicit else ["mpirun", "mpiexec"]):
        path = shutil.which(name)
        if path:
            bare = os.path.basename(path)
            return bare if shutil.which(bare) == path else path
    if explicit:
        raise PsrtError(f"--mpirun {explicit}: not found or not executable")
    raise PsrtError("no MPI found: neither mpirun nor mpiexec is on PATH (install Open MPI, "
                    "e.g. apt install openmpi-bin, or MPICH; inside Slurm, srun is used)")


# Open MPI's notices that ranks exited with a non-zero code.  psrt's ranks have already said
# why in one line; these blocks only repeat that something failed.  Notices of a rank killed
# by a signal, or of MPI_Abort, are kept.
EXIT_BANNERS = ("Primary job  terminated normally, but", "Primary job terminated normally, but",
                "mpirun detected that one or more processes exited with non-zero status")
_RULE = "-" * 74   # Open MPI frames each notice between two such lines


def drop_exit_banners(lines, write) -> None:
    """Copy `lines` to `write`, leaving out every framed notice that is an EXIT_BANNER."""
    block = None
    for line in lines:
        if block is None:
            if line.rstrip("\n") == _RULE:
                block = [line]
            else:
                write(line)
            continue
        block.append(line)
        if line.rstrip("\n") == _RULE and len(block) > 1:
            text = "".join(block)
            if not any(b in text for b in EXIT_BANNERS):
                write(text)
            block = None
    if block:
        write("".join(block))


def run_job(argv, env, quiet_exit: bool = False) -> int:
    """Run a launcher in the foreground and return its exit code (128 + N for signal N).

    On Ctrl-C or SIGTERM the launcher is given the signal and a few seconds to stop its
    ranks (remote ones included) before it is killed: killing mpirun outright would leave
    them behind.  `quiet_exit` (Open MPI's mpirun) leaves its non-zero-exit notices out of
    stderr, so an error every rank agreed on stays the one line psrt printed.
    """
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE if quiet_exit else None,
                            text=True, errors="replace")
    copier = None
    if quiet_exit:
        def copy():
            drop_exit_banners(proc.stderr, lambda text: (sys.stderr.write(text), sys.stderr.flush()))
        copier = threading.Thread(target=copy, name="psrt-stderr", daemon=True)
        copier.start()
    try:
        code = proc.wait()
        if copier is not None:
            copier.join()
    except BaseException as err:
        proc.send_signal(signal.SIGINT if isinstance(err, KeyboardInterrupt) else signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    return 128 - code if code < 0 else code


def local_mpirun_prefix(np_: int, mpirun: str = "mpirun", yield_when_idle: bool = True) -> list[str]:
    """mpirun argv for N ranks on this host, oversubscribing when N exceeds the cores.

    Ranks that busy-poll on an oversubscribed host starve each other, so they are told to
    yield when idle (Open MPI's mpi_yield_when_idle); yield_when_idle=False leaves the choice
    to the ranks (PSRT_YIELD).
    """
    flavour = mpi_flavour(mpirun)
    argv = [find_mpirun(mpirun), "-np", str(np_)]
    if flavour.startswith("openmpi"):
        if os.geteuid() == 0:
            argv.append("--allow-run-as-root")
        if np_ > (os.cpu_count() or 1):
            argv.append("--oversubscribe")
        argv += (["--mca", "mpi_yield_when_idle", "1"] if yield_when_idle else []) + ["--bind-to", "none"]
    return argv


def resolve_program(command: tuple[str, ...]) -> tuple[str, ...]:
    """The command with its program as an absolute path when PATH finds a bare name, so a
    launcher that changes the ranks' PATH (Open MPI's --prefix) still runs the program the
    user meant: `python3` stays the python3 of the user's PATH."""
    if command and "/" not in command[0]:
        path = shutil.which(command[0])
        if path:
            return (path,) + tuple(command[1:])
    return tuple(command)
