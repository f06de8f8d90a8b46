"""The machine's MPI: which mpirun, which flavour, and running a launcher in the foreground."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

from psrt.errors import IN_JOB_DONE, PsrtError
from psrt.launch.logs import JobLogs, keeping_logs
from psrt.launch.plan import in_job_flags



def mpi_flavour(mpirun: str = "mpirun") -> str:
    """'openmpi4', 'openmpi5', 'mpich' (MPICH or Intel MPI) or 'unknown', from `mpirun --version`."""
    path = shutil.which(mpirun)
    if path is None:
        raise PsrtError(f"no {mpirun} on PATH: install an MPI (make install: README, 'Quick start')")
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    text = out.stdout + out.stderr
    if "Open MPI" in text or "OpenRTE" in text:
        for line in text.splitlines():
            if ")" in line and any(ch.isdigit() for ch in line):
                version = line.rsplit(" ", 1)[-1]
                return "openmpi" + version.split(".")[0]
        return "openmpi"
    # Intel MPI is built on MPICH and starts jobs with the same Hydra launcher and flags
    if "HYDRA" in text or "MPICH" in text or "Intel(R) MPI" in text:
        return "mpich"
    return "unknown"


def check_ulfm(mpirun: str, flavour: str) -> None:
    """A PsrtError unless this mpirun's Open MPI was built with ULFM (`ompi_info`: "FT MPI
    support: yes"); the refusal for other MPIs comes from plan.in_job_flags."""
    in_job_flags(flavour, ())
    info = os.path.join(os.path.dirname(shutil.which(mpirun) or mpirun), "ompi_info")
    try:
        out = subprocess.run([info], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    if not re.search(r"FT MPI support:\s*yes", out):
        raise PsrtError(f"--in-job-recovery: {info} does not report 'FT MPI support: yes' (Open MPI built "
                        "without ULFM): use --restarts N to continue on the survivors from the last checkpoint")


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


# Open MPI's notices that repeat what psrt's ranks have already said in one line: that ranks
# exited with a non-zero code, that a rank called MPI_Abort (psrt's one way to end a job:
# psrt.errors.abort), and the daemons' error lines that follow an abort.  Notices of a rank
# killed by a signal are kept.  Under ULFM (--in-job-recovery) Open MPI's non-blocking
# collectives say each schedule a lost rank cut short ("NBC_Progress: an error 75 ..."): psrt's
# recovery line names the lost ranks instead.
EXIT_BANNERS = ("Primary job  terminated normally, but", "Primary job terminated normally, but",
                "mpirun detected that one or more processes exited with non-zero status",
                "MPI_ABORT was invoked on rank")
NOISE = ("ORTE_ERROR_LOG", "more processes have sent help message", "more process has sent help message",
         "to 0 to see all help / error messages", "NBC_Progress: an error", "plm:ssh: Warning: setpgid(")
_RULE = "-" * 74   # Open MPI frames each notice between two such lines


def drop_exit_banners(lines, write, keep=None) -> None:
    """Copy `lines` to `write`, leaving out every framed notice that is an EXIT_BANNER and
    every line of NOISE; what is left out goes to `keep` (when given)."""
    keep = keep or (lambda text: None)
    block = None
    for line in lines:
        if block is None:
            if line.rstrip("\n") == _RULE:
                block = [line]
            elif any(n in line for n in NOISE):
                keep(line)
            else:
                write(line)
            continue
        block.append(line)
        if line.rstrip("\n") == _RULE and len(block) > 1:
            text = "".join(block)
            (keep if any(b in text for b in EXIT_BANNERS) else write)(text)
            block = None
    if block:
        write("".join(block))


# Notices after which the job is over whatever mpirun does next: a rank called MPI_Abort, or
# mpirun lost a host's daemon.  Open MPI's mpirun can stay in "abort is already in progress"
# for ever when a host it would tell is gone, so ABORT_GRACE_S after such a notice whatever
# is left of the job is killed, and the launcher returns the abort's error code.
# A psrt watchdog's report is followed by its MPI_Abort (code 3), whose notice may never come.
# Open MPI 5's runtime (PRRTE 3.0) ends the whole job when it loses a host's daemon, and then
# exits 0: its notice is a failure whatever the exit code says.  Under ULFM, when it does not
# see the loss, it waits at the job's end for that daemon for ever: the survivors of an in-job
# recovery say when they have all finished (psrt.train.in_job.leave), and the job is over.
ENDINGS = {"MPI_ABORT was invoked on rank": 1, "ORTE has lost communication with a remote daemon": 1,
           "PRTE has lost communication with a remote daemon": 1,
           "A daemon failed to report back after being spawned": 1,
           "abort is already in progress": 1, "psrt: watchdog: ": 3, IN_JOB_DONE: 0}
ABORT_GRACE_S = 5.0
# A rank's one-line error (psrt.errors / psrt.faults): the rank aborts the job right after it.
# Seen on its own, the job is ending too: Open MPI 4.1 has lost its MPI_ABORT notice itself
# ("ORTE_ERROR_LOG: Data unpack would read past end of buffer ... show_help.c") and then waited
# for ever for the daemon of a host that was gone.
RANK_ERROR = re.compile(r"^\[rank \d+\] [\w.]+: error: ", re.M)


class Ending:
    """When (monotonic) the job was seen ending, and with which code (None: not yet)."""

    def __init__(self):
        self.at: float | None = None
        self.code = 1
        self.error_at: float | None = None     # a rank's error line, no notice (yet)

    def see(self, text: str) -> None:
        if self.at is None:
            for marker, code in ENDINGS.items():
                if marker in text:
                    self.at = time.monotonic()
                    found = re.search(r"errorcode (\d+)", text)
                    self.code = int(found.group(1)) if found else code
                    return
            if self.error_at is None and RANK_ERROR.search(text):
                self.error_at = time.monotonic()

    def overdue(self) -> bool:
        """ABORT_GRACE_S after an abort notice; three times as long after a rank's error line
        alone, which a launcher ending by itself (every rank refusing a usage error) leaves
        time to exit with its own code."""
        now = time.monotonic()
        return ((self.at is not None and now - self.at > ABORT_GRACE_S)
                or (self.error_at is not None and now - self.error_at > 3 * ABORT_GRACE_S))


# Signals a launcher passes on to its job: what Ctrl-C, `kill`, `timeout` and batch
# schedulers send (Slurm's scancel and a job's time limit: SIGTERM; a closed terminal: SIGHUP).
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
GRACE_S = 3.0     # from the signal to SIGKILL of whatever of the job is left


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # the command name (field 2) may hold spaces and parentheses: split after it
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _adopt_orphans() -> None:
    """Make this process the reaper of its orphaned descendants (Linux prctl
    PR_SET_CHILD_SUBREAPER): a rank whose mpirun died stays below this process, where
    `descendants` finds it, instead of moving to PID 1."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def kill(pids) -> None:
    """SIGKILL each of `pids` that is still there."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _reap(pids) -> None:
    """Collect the exit status of adopted orphans among `pids`, so they do not stay as
    zombies (only these: another child's status belongs to whoever started it)."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


def run_job(argv, env, quiet_exit: bool = False, logs: JobLogs | None = None) -> int:
    """Run a launcher in the foreground and return its exit code (128 + N for signal N).

    SIGINT, SIGTERM and SIGHUP sent to this process are passed to the launcher, which stops
    its ranks (remote ones included); whatever of the job is still alive GRACE_S later is
    killed (SIGKILL), every process below this one, and the code is 128 + the signal.
    `quiet_exit` (Open MPI's mpirun) leaves its notices of non-zero exits and MPI_Abort out
    of stderr, so a failure stays the one line psrt's rank printed; they are kept in a file
    of the job's log directory (`logs`, psrt/launch/logs.py; without it this run is the
    whole job), which the ranks are told of (PSRT_MPI_LOG).
    """
    if quiet_exit and logs is None:
        return keeping_logs(lambda own: run_job(argv, env, True, own),
                            say=lambda line: print(f"psrt: {line}", file=sys.stderr, flush=True), environ=env)
    _adopt_orphans()
    log = None
    if quiet_exit:
        # The notices left out are kept in a file the ranks' error lines name (PSRT_MPI_LOG).
        log = logs.new_file()
        env = {**env, "PSRT_MPI_LOG": log}
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE if quiet_exit else None,
                            text=True, errors="replace")
    copier, ending = None, Ending()
    if quiet_exit:
        def shown(text):
            ending.see(text)
            if RANK_ERROR.search(text):
                logs.said_by_rank = True     # the failure's one line, which names the log itself
            sys.stderr.write(text)
            sys.stderr.flush()

        def copy():
            with open(log, "a") as kept:
                drop_exit_banners(proc.stderr, shown,
                                  lambda text: (ending.see(text), kept.write(text), kept.flush()))
        copier = threading.Thread(target=copy, name="psrt-stderr", daemon=True)
        copier.start()
    return _supervise(proc, copier, ending)


def _supervise(proc, copier, ending: Ending) -> int:
    """Wait for the launcher `proc`, passing FORWARDED signals on (see run_job); end what is
    left of a job that aborted but does not exit (Ending)."""
    caught: list[int] = []
    job: set[int] = set()
    deadline = [0.0]

    def forward(signum, frame):
        if not caught:
            job.update(descendants(os.getpid()))
            deadline[0] = time.monotonic() + GRACE_S
        caught.append(signum)
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass
    main = threading.current_thread() is threading.main_thread()
    # A signal the caller ignores stays ignored (a job started in the background of a
    # non-interactive shell must not end on the terminal's Ctrl-C).
    old = {s: signal.signal(s, forward) for s in FORWARDED
           if main and signal.getsignal(s) is not signal.SIG_IGN}
    try:
        while True:
            try:     # polled: a signal's handler runs, and the grace is counted, while it waits
                code = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if caught and time.monotonic() > deadline[0]:
                    kill(job | descendants(os.getpid()) | {proc.pid})
                elif not caught and ending.overdue():
                    kill(descendants(os.getpid()) | {proc.pid})
                    proc.wait()
                    _reap(descendants(os.getpid()))
                    if copier is not None:
                        copier.join(timeout=5)
                    return ending.code
        if caught:
            # The launcher is gone; its ranks may not be (a rank that ignores SIGTERM, or one
            # the launcher lost): what is left of the job gets SIGKILL after the grace.
            while time.monotonic() < deadline[0] and any(_alive(p) for p in job | descendants(os.getpid())):
                _reap(job)
                time.sleep(0.05)
            kill(job | descendants(os.getpid()))
            _reap(job)
        if copier is not None:
            copier.join(timeout=5)
    except BaseException:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            kill(descendants(os.getpid()) | {proc.pid})
            proc.wait()
        raise
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    if caught:
        # The job is over; a caller that had a handler of its own for the signal (an emulated
        # cluster's `running`, which takes its hosts down) gets it now, instead of carrying on
        # to its next job as if this one had merely failed.
        handler = old.get(caught[0])
        if callable(handler) and handler is not signal.default_int_handler:
            handler(caught[0], None)
        return 128 + caught[0]
    if ending.at is not None and 0 in (code, ending.code):
        # a job seen to end badly did not succeed; one whose survivors all finished did, whatever
        # the runtime says of the daemon it lost (a host that came back tells it on the way out)
        return ending.code
    return 128 - code if code < 0 else code


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


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
