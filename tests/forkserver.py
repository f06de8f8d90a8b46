"""Rank processes for the tests, forked from one process that has already imported torch.

A rank that trains even a few steps spends most of its CPU before its first line of psrt runs:
importing torch (~2.4 s of CPU here) and torch._dynamo, which torch.optim imports at an
optimizer's first step (torch/optim/optimizer.py, `_use_grad_for_differentiable`; ~2 s more).
On 2 cores with up to 8 ranks a launch, that was most of the suite's time.  Python's
multiprocessing has the same answer for the same cost (its "forkserver" start method): import
once, then fork a copy per process.

How a rank starts here instead of `python ARGS`:
- mpirun starts `python -S tests/rank_stub.py SOCKET ARGS` (a few ms): the stub is the process
  mpirun knows, so exit codes, signals and Open MPI's bookkeeping go through it as usual
  (`python -u ARGS`, as torchrun starts its workers, is ARGS with unbuffered streams);
- the stub sends this server its argv, environment, working directory and its stdin, stdout
  and stderr (SCM_RIGHTS, unix(7));
- the server forks; the child takes the stub's descriptors, environment and directory, and runs
  ARGS as `python ARGS` would (`-m module`, `-c code` or a script), MPI_Init included (the
  server never imports mpi4py.MPI, so each child starts MPI itself from the stub's OMPI_*
  variables);
- the server sends the child's pid, then its wait status, back to the stub, which exits the same
  way (the same code, or killed by the same signal).  The child leads a session of its own; the
  stub forwards the signals it gets to that process group, and when the stub dies (SIGKILL from
  mpirun, say) the group is killed.

What differs from a fresh interpreter, and is mended in the child: the random generators of
`random` and NumPy (reseeded from the OS, as a new process seeds them), sys.path (rebuilt from
the stub's PYTHONPATH) and the standard streams' buffering (PYTHONUNBUFFERED).  At its end the
child does what the interpreter's shutdown does (threads, atexit handlers, open files,
MPI_Finalize) but leaves its modules uncleared: clearing them would copy the server's pages
into it.  Tests that signal ranks from outside by pid (SIGSTOP, say) start cold:
`launch_ranks(..., warm=False)`.
"""
from __future__ import annotations

import array
import gc
import io
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

STUB = Path(__file__).with_name("rank_stub.py")
HEADER = struct.Struct("!I")


# --- the server ---------------------------------------------------------------------------------
def _preload() -> None:
    """What every rank would import first: torch, torch._dynamo (an optimizer step imports it),
    NumPy.  Nothing that starts MPI."""
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch.nn  # noqa: F401
    import torch.optim  # noqa: F401
    import mpi4py  # noqa: F401  (the package only: mpi4py.MPI would start MPI here)
    # What is imported now stays shared with every child as long as nobody writes to it: keep
    # the collector from walking (and so touching) it in the children, at their exit too, which
    # otherwise copied most of the server's pages into each (seconds a rank; the gc module's
    # advice for a process that forks workers: gc.freeze()).
    gc.freeze()


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    data, ancdata, _, _ = conn.recvmsg(HEADER.size, socket.CMSG_LEN((3 + len(NAMESPACES)) * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    while len(data) < HEADER.size:
        data += conn.recv(HEADER.size - len(data))
    (size,) = HEADER.unpack(data)
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ConnectionError("the stub left before its request was read")
        body += chunk
    return json.loads(body), list(fds)


def serve(path: str, session: int) -> tuple[socket.socket, dict] | None:
    """Accept stubs until the test session (pid `session`) goes away.  Returns, in a forked
    child only, the connection and request it is to run."""
    # Out of the session's tree (the parent that started it exits at once): launcher code that
    # tests run inside pytest ends every process below pytest, and this one must outlive them.
    if os.fork():
        os._exit(0)
    os.setsid()
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(128)
    print(f"ready {os.getpid()}", flush=True)
    children: dict[int, socket.socket] = {}
    while os.path.exists(f"/proc/{session}"):
        ready, _, _ = select.select([listener], [], [], 0.05)
        if ready:
            conn, _ = listener.accept()
            try:
                request, fds = _receive(conn)
            except (OSError, ValueError, ConnectionError):
                conn.close()
                continue
            why = _cold_reason(request)
            if why:
                conn.sendall(b"cold\n")
                conn.close()
                for fd in fds:
                    os.close(fd)
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in children.values():
                    other.close()
                _take_over(fds, request)
                return conn, request
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"{status}\n".encode())
                except OSError:
                    pass
                conn.close()
    for pid in children:
        os.kill(pid, signal.SIGKILL)
    return None


# What this server loaded at its start that a rank's environment could have asked otherwise: the
# dynamic loader reads its variables once, the BLAS libraries their thread counts, mpi4py its MPI
# library.  (OMP_NUM_THREADS, which most ranks set, torch.set_num_threads applies in the child.)
FIXED_AT_START = ("LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONHOME", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def _cold_reason(request: dict) -> str | None:
    """Why this rank must start as a fresh interpreter, or None when a fork is the same thing."""
    env = request["env"]
    for name in FIXED_AT_START:
        if env.get(name) != os.environ.get(name):
            return name
    threads = env.get("OMP_NUM_THREADS")
    if threads != os.environ.get("OMP_NUM_THREADS") and not (threads or "").isdigit():
        return "OMP_NUM_THREADS"    # unset where the server had it, or not a count
    if any(k.startswith("MPI4PY_") for k in env):
        return "MPI4PY_*"
    if "SLURM_STEP_ID" in env:      # slurmstepd tracks a step's processes itself
        return "srun"
    return None


# --- the child: become `python ARGS`
# The stub's namespaces, which an emulated host gives its processes (`ip netns exec`: network,
# mount; psrt's launch agent: UTS), sent as /proc/self/ns descriptors in this order.
NAMESPACES = ("net", "uts", "mnt")


def _join(namespaces: list[int]) -> None:
    """Enter the stub's namespaces where they are not this process's own (setns(2); a mount
    namespace only lets a single-threaded process in, which a child just forked is)."""
    import ctypes
    libc = None
    for name, fd in zip(NAMESPACES, namespaces):
        if os.fstat(fd).st_ino != os.stat(f"/proc/self/ns/{name}").st_ino:
            libc = libc or ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, 0) != 0:
                raise OSError(ctypes.get_errno(), f"setns into the stub's {name} namespace")
        os.close(fd)


def _take_over(fds: list[int], request: dict) -> None:
    # A session and process group of its own, as a command started with start_new_session has:
    # a signal the stub passes on, and a killpg of the process's own, reach all it started.
    os.setsid()
    _join(fds[3:])
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    sys.executable = request["executable"]      # what started it: python again, for its own children
    request["server_threads"] = os.environ.get("OMP_NUM_THREADS")
    os.environ.clear()
    os.environ.update(request["env"])
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads != request["server_threads"]:
        import torch
        torch.set_num_threads(int(threads))     # what libgomp would have read at the start
    if os.environ.get("PYTHONUNBUFFERED") or request.get("unbuffered"):
        for name in ("stdout", "stderr"):
            getattr(sys, name).reconfigure(write_through=True, line_buffering=True)
    import random
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _die_with_stub(conn: socket.socket) -> None:
    """The stub holds the other end: when it is gone (killed by mpirun, say), so is this
    process, with the processes it started (its group)."""
    try:
        while conn.recv(1):
            pass
    except OSError:
        pass
    os.killpg(0, signal.SIGKILL)


def run(conn: socket.socket, request: dict) -> None:
    """Run ARGS and end this process as `python ARGS` would end: anything ARGS raises but
    sys.exit(code) through the interpreter's own shutdown (a traceback or message, exit 1);
    a run that returns or exits with a code as well, ended early by _Leave."""
    threading.Thread(target=_die_with_stub, args=(conn,), daemon=True).start()
    code = 0
    try:
        names = _run_args(request["argv"])
    except SystemExit as stop:
        if stop.code is not None and not isinstance(stop.code, int):
            raise                       # sys.exit('message'): printed, exit 1
        code, names = stop.code or 0, stop     # its traceback holds the program's names
    # The shutdown's first step past its garbage collection sets sys.ps1 (unused by a program
    # that is not interactive) to None: this object's finalizer then ends the process.  It
    # keeps the program's names until then, as a __main__ module would.
    sys.ps1 = _Leave(code, names)
    sys.exit(code)


class _Leave:
    """Cuts the interpreter's shutdown short once it has done what a program sees of it
    (Py_FinalizeEx: the other threads waited for, the atexit handlers run, the standard streams
    flushed, the daemon threads stopped, the garbage collected), where it goes on to clear
    every module: in a forked process that writes to, and so copies, most of the pages it
    shares with the server (about 0.3 s of CPU a process here, more than a short rank's run).
    What the clearing would still do that is seen outside is done here: the files left open
    are closed, and mpi4py's exit handler (registered with Py_AtExit, so run after the
    clearing) calls MPI_Finalize."""

    def __init__(self, code: int, names):
        self.code, self.names = code, names

    def __del__(self) -> None:
        if not sys.is_finalizing():
            return                      # sys.ps1 replaced by the program: the whole shutdown runs
        code = self.code
        try:
            sys.stdout.flush()
        except Exception:               # noqa: BLE001 - the interpreter's exit status then
            code = code or 120
        standard = {id(s) for s in (sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__)}
        # The files still open (gc.get_objects leaves out the server's, frozen), the outer
        # layers first: closing a text file flushes it into its buffer, a buffer into its file.
        files = [o for o in gc.get_objects() if isinstance(o, io.IOBase) and id(o) not in standard]
        for f in sorted(files, key=lambda o: 0 if isinstance(o, io.TextIOBase) else 1 if isinstance(o, io.BufferedIOBase) else 2):
            try:
                if not f.closed:
                    f.close()
            except Exception:           # noqa: BLE001 - as a file closed by its finalizer
                pass
        mpi, rc = sys.modules.get("mpi4py.MPI"), getattr(sys.modules.get("mpi4py"), "rc", None)
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            if (rc.initialize if rc.finalize is None else rc.finalize) in (True, "yes"):
                mpi.Finalize()
        os._exit(code)


def _run_args(argv: list[str]) -> dict:
    """Run ARGS as `python ARGS` would; the names the program left (its __main__'s)."""
    here = sys.path[1:]
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    import runpy
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[:] = [os.getcwd(), *extra, *[p for p in here if p not in extra]]
        return runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[:] = ["", *extra, *[p for p in here if p not in extra]]
        names = {"__name__": "__main__", "__builtins__": __builtins__}
        exec(compile(argv[1], "<string>", "exec"), names)
        return names
    else:
        sys.argv = list(argv)
        sys.path[:] = [os.path.dirname(os.path.abspath(argv[0])), *extra, *[p for p in here if p not in extra]]
        return runpy.run_path(argv[0], run_name="__main__")


# --- the pytest side ------------------------------------------------------------------------------
class ForkServer:
    """One server per test session, started at the first warm launch."""

    def __init__(self, root: Path):
        # not under /tmp: an emulated Slurm host mounts a /tmp of its own over it
        self.dir = tempfile.mkdtemp(prefix="psrt-ranks-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
        self.path = os.path.join(self.dir, "server.sock")
        env = dict(os.environ, PYTHONPATH=str(root))
        # It imports while the session collects the tests (wait_ready).
        self.proc = subprocess.Popen([sys.executable, __file__, self.path, str(os.getpid())], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=root)
        self.python = os.path.join(self.dir, "bin", "python3")
        # `python` and `python3` for every command the tests start (PATH): mpi_launch's ranks,
        # the docs' commands, a bench's jobs that name python by PATH.
        self.bin = os.path.join(self.dir, "bin")
        os.mkdir(self.bin)
        for name in ("python", "python3"):
            shim = os.path.join(self.bin, name)
            with open(shim, "w") as f:
                f.write(f'#!/bin/sh\nexec "{sys.executable}" -S "{STUB}" "{self.path}" "{shim}" "$@"\n')
            os.chmod(shim, 0o755)
        # torchrun is `python -m torch.distributed.run` (its console script calls the same
        # main), and its workers are `python -u SCRIPT` of the python that runs it: warm both.
        torchrun = os.path.join(self.bin, "torchrun")
        with open(torchrun, "w") as f:
            f.write(f'#!/bin/sh\nexec "{self.python}" -m torch.distributed.run "$@"\n')
        os.chmod(torchrun, 0o755)

    def wait_ready(self) -> None:
        """Until it listens (a stub that comes earlier starts cold, which is only slower)."""
        word, _, pid = self.proc.stdout.readline().decode().partition(" ")
        if word != "ready":
            raise RuntimeError(f"the rank fork server did not start (exit {self.proc.wait()})")
        self.pid = int(pid)

    def argv(self, args: list[str]) -> list[str]:
        """`python ARGS` as a rank of this server; ARGS as a plain rank would take them."""
        return [self.python, *args]

    def close(self) -> None:
        self.proc.wait()                 # the parent that started the server, long gone
        if getattr(self, "pid", None):
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)


if __name__ == "__main__":
    job = serve(sys.argv[1], int(sys.argv[2]))
    if job is not None:
        run(*job)
