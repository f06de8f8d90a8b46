"""Shared fixtures: run a script on N ranks under mpirun and collect what each rank reports."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# The pytest process only launches ranks; it must never become an MPI process itself (a
# module that imports mpi4py.MPI at collection would make it an Open MPI singleton whose
# OMPI_* variables then leak into the mpirun it starts and wedge that job).
import mpi4py

mpi4py.rc.initialize = False
mpi4py.rc.finalize = False

ROOT = Path(__file__).resolve().parent.parent


# --- make test-quick: the unit tests and one launch per area (tests/quick.txt) ---------------
def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true",
                     help="the unit tests and the multi-rank tests tests/quick.txt names (one launch per area)")
    parser.addoption("--cold", action="store_true",
                     help="start every rank as a fresh interpreter, not forked from one that imported torch "
                          "(tests/forkserver.py)")


# --- where ranks come from: forked from one warm interpreter, unless --cold -------------------------
_FORK_SERVER: list = []     # the session's server, started once; empty under --cold
PYTHON = sys.executable     # the interpreter itself, for a rank that must start cold


def pytest_configure(config):
    # Under pytest-xdist the workers launch the ranks; the process that hands them tests does not.
    distributing = getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput")
    if not config.getoption("--cold") and not distributing:
        from forkserver import ForkServer
        server = ForkServer(ROOT)
        _FORK_SERVER.append(server)
        os.environ["PATH"] = os.pathsep.join([server.bin, os.environ.get("PATH", "")])
        sys.executable = server.python      # what the tests start as `sys.executable ARGS` too


def pytest_collection_finish(session):
    for server in _FORK_SERVER:
        server.wait_ready()


def pytest_unconfigure(config):
    while _LOCKS:
        shutil.rmtree(_LOCKS.pop(), ignore_errors=True)
    while _FORK_SERVER:
        _FORK_SERVER.pop().close()


def rank_argv(args: list[str], warm: bool = True) -> list[str]:
    """The rank program for `python ARGS`: the warm stub where the session has a server."""
    if warm and _FORK_SERVER:
        return _FORK_SERVER[0].argv(args)
    return [PYTHON, *args]


# --- tests side by side (pytest-xdist, scripts/test.sh) -------------------------------------------
# The tests that make emulated hosts (network namespaces, mounts, Slurm daemons) or look at the
# whole machine's namespaces run one after another in one group, on one worker: another test's
# hosts would collide with theirs (hostfiles name the same hosts) or show up in their checks.
# The Slurm tests are a second such group beside it: their hosts' names are their own (a tag of
# the process, tests/netns/test_slurm.py), an emulated cluster has no interface, address or
# route in the root namespace (psrt/launch/cluster.py), and the checks of the first group look
# only at hosts of their own names; most of their time is spent waiting for Slurm's daemons.
ONE_AT_A_TIME = ("tests/netns/",)
BESIDE_THEM = {"tests/netns/test_slurm.py": "slurm", "tests/netns/test_slurm_restart.py": "slurm"}
EMULATING = ("--emulate", "psrt.cluster", "psrt.bench network", "psrt.bench recovery", "psrt.bench chaos")


def _emulates(commands: str) -> bool:
    """Whether documented commands make emulated hosts (`psrt.bench scaling` does unless it
    only predicts)."""
    return any(word in line or ("psrt.bench scaling" in line and "--predict" not in line)
               for line in commands.splitlines() for word in EMULATING)


def _group(item) -> str:
    path = item.nodeid.partition("::")[0]
    if path.startswith(ONE_AT_A_TIME):
        return BESIDE_THEM.get(path, "hosts")
    block = getattr(getattr(item, "callspec", None), "params", {}).get("block")
    if path == "tests/mpi/test_docs.py" and block is not None:
        # a documented block: with the hosts when it emulates any, else its page's group (a
        # block may use what an earlier block of its page made)
        if _emulates(block.body):
            return "hosts"
        return f"{path}:{block.where.rsplit(':', 1)[0]}"
    return path


def _group_for_workers(config, items) -> None:
    """Every other file is a group of its own: its module-scoped launches are shared by its tests
    only where they run in one process."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_group(item)))


_LOCKS: list[str] = []     # the folder of the workers' locks, made by the process that starts them


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    if not _LOCKS:
        _LOCKS.append(tempfile.mkdtemp(prefix="psrt-tests-"))
    node.workerinput["psrt_locks"] = _LOCKS[0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test marked `alone` (timings of emulated links) has the machine to itself: it waits for
    the other workers' tests to end, and they wait for it (an exclusive flock(2) against the
    shared one every other test holds; a turnstile keeps a waiting `alone` test from starving)."""
    folder = getattr(item.config, "workerinput", {}).get("psrt_locks")
    if folder is None:
        yield
        return
    base = os.path.join(folder, "machine")
    alone = item.get_closest_marker("alone") is not None
    with open(base + ".turnstile", "a") as gate, open(base + ".lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.hookimpl(tryfirst=True)     # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    _group_for_workers(config, items)
    if not config.getoption("--quick"):
        return
    lines = (ROOT / "tests" / "quick.txt").read_text().splitlines()
    chosen = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    unit = ROOT / "tests" / "unit"
    keep = [i for i in items if unit in Path(str(i.path)).parents or i.nodeid.startswith(tuple(chosen))]
    unmatched = [c for c in chosen if not any(i.nodeid.startswith(c) for i in items)]
    if unmatched:
        raise pytest.UsageError(f"tests/quick.txt names no test: {', '.join(unmatched)}")
    kept = set(map(id, keep))
    config.hook.pytest_deselected(items=[i for i in items if id(i) not in kept])
    items[:] = keep
MPI_SCRIPTS = Path(__file__).resolve().parent / "mpi" / "ranks"


def mpirun_argv(np_: int) -> list[str]:
    """The mpirun prefix for N local ranks on this (possibly small) machine."""
    from psrt.launch.mpi import local_mpirun_prefix
    return local_mpirun_prefix(np_)


class RankRun:
    def __init__(self, proc: subprocess.CompletedProcess):
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr

    def records(self) -> list[dict]:
        """Lines a rank printed as `PSRT-RESULT {json}`."""
        # mpirun forwards every rank's stdout through one pipe, so two ranks' lines can end up
        # glued together: decode each JSON object where its marker starts.
        decoder, out, tag = json.JSONDecoder(), [], "PSRT-RESULT "
        pos = self.stdout.find(tag)
        while pos >= 0:
            obj, end = decoder.raw_decode(self.stdout, pos + len(tag))
            out.append(obj)
            pos = self.stdout.find(tag, end)
        return out

    def check(self) -> "RankRun":
        assert self.returncode == 0, f"exit {self.returncode}\nstdout:\n{self.stdout[-4000:]}\nstderr:\n{self.stderr[-4000:]}"
        return self


def launch_ranks(np_: int, *args: str, timeout: float = 300, env: dict | None = None, warm: bool = True) -> RankRun:
    """A script of tests/mpi/ranks (or python arguments) on N ranks under mpirun.  What the
    run_ranks fixture calls; a module-scoped fixture that shares one launch calls it directly.
    warm=False starts fresh interpreters even where the session forks ranks (a test that
    signals ranks by pid from outside)."""
    argv = list(args)
    if argv and argv[0].endswith(".py") and not os.path.isabs(argv[0]):
        argv[0] = str(MPI_SCRIPTS / argv[0])
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("OMPI_COMM_", "OMPI_MCA_orte_", "OMPI_MCA_ess", "PMIX_", "PMI_"))}
    full_env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **(env or {}))
    cmd = mpirun_argv(np_) + rank_argv(argv, warm)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env,
                          stdin=subprocess.DEVNULL)
    return RankRun(proc)


@pytest.fixture
def run_ranks():
    """run_ranks(np, script_or_module_args..., timeout=s, env={}) -> RankRun."""
    return launch_ranks


# --- launcher requests, shared by the unit, MPI and emulated-host tests of psrt.launch --------
LAUNCH_CMD = ("python", "-m", "psrt.info")
NOWHERE = "psrt-no-such-host.invalid"  # .invalid never resolves (RFC 6761)


def req(hosts, np_=None, **kw):
    """A launch Request for `hosts` (a host list or `--hosts` text) running LAUNCH_CMD."""
    from psrt.launch import hostfile, plan
    if isinstance(hosts, str):
        hosts = hostfile.parse_hosts(hosts)
    return plan.Request(command=LAUNCH_CMD, hosts=hosts, np=np_, **kw)


def write_hostfile(tmp_path, text, name="hosts"):
    path = tmp_path / name
    path.write_text(text)
    return path


def interruptible():
    """preexec_fn: the signals a person or a scheduler sends get their default action in the
    child, as from an interactive shell.  A suite run in the background (CI: `cmd &` from a
    non-interactive shell) has SIGINT ignored, which the child would inherit; Python then
    installs no KeyboardInterrupt, and psrt's launchers leave an ignored signal ignored."""
    import signal
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def root_flag():
    """Open MPI refuses root unless told: the planner adds this flag when run as root."""
    return ["--allow-run-as-root"] if os.geteuid() == 0 else []


# --- horovodrun, shared by the Horovod and torch.distributed backend tests ------------------
def horovodrun(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """horovodrun ARGS from the repository root (skips when horovodrun is not installed)."""
    exe = Path(sys.executable).with_name("horovodrun")
    exe = str(exe) if exe.exists() else shutil.which("horovodrun")
    if exe is None:
        pytest.skip("horovodrun is not on PATH")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_COMM_", "OMPI_MCA_orte_", "OMPI_MCA_ess", "PMIX_", "PMI_"))}
    # horovodrun's mpirun line declares `-H localhost:N` slots, so Open MPI neither lets root
    # run nor knows the cores are shared: ask by environment, and make idle ranks yield.
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1",
               OMPI_MCA_mpi_yield_when_idle="1")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=subprocess.DEVNULL, cwd=ROOT)
