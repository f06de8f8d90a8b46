"""`python` for the tests (tests/forkserver.py): hands its argv, environment, directory and
standard streams to the fork server, forwards signals to the forked process and exits as it
did; or, where a fork would not be the same thing (the server says why), becomes plain python.
Standard library only, run with `python -S`: it starts in milliseconds.

    python -S rank_stub.py SOCKET EXECUTABLE ARGS...    # what EXECUTABLE (`python`) ARGS runs
"""
import array
import json
import os
import signal
import socket
import struct
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT,
             signal.SIGQUIT)


def cold(args: list[str]) -> None:
    """Start as plain `python ARGS` would: this interpreter, run again without -S."""
    os.execv(sys.executable, [sys.executable, *args])


def forward(group: int, sig: int) -> None:
    """To the forked process and what it started (it leads a process group of its own)."""
    try:
        os.killpg(group, sig)
    except ProcessLookupError:         # it has just ended: its status is on its way
        pass


def main() -> None:
    path, executable, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    # -u (torchrun starts its workers so) asks what PYTHONUNBUFFERED asks, which the fork mends
    unbuffered = args[:1] == ["-u"]
    program = args[1:] if unbuffered else args
    if not program or not (program[0] == "-m" or program[0].endswith(".py")):
        cold(args)                     # other interpreter flags, -c, a REPL: not what a fork can be
    body = json.dumps({"argv": program, "env": dict(os.environ), "cwd": os.getcwd(), "executable": executable,
                       "unbuffered": unbuffered}).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        cold(args)                     # no server (it ended, or another mount namespace)
    # its streams, then its namespaces (an emulated host's), which the forked process enters
    spaces = [os.open(f"/proc/self/ns/{name}", os.O_RDONLY) for name in ("net", "uts", "mnt")]
    fds = array.array("i", [0, 1, 2, *spaces])
    conn.sendmsg([struct.pack("!I", len(body))], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    conn.sendall(body)
    reply = conn.makefile("rb")
    first = reply.readline().strip()
    if first in (b"cold", b""):
        conn.close()
        cold(args)
    pid = int(first)
    for sig in FORWARDED:
        signal.signal(sig, lambda n, _f: forward(pid, n))
    line = reply.readline()
    if not line:                       # the server went away: the rank with it
        sys.exit(1)
    status = int(line)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    sys.exit(os.waitstatus_to_exitcode(status))


main()
