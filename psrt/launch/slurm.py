"""Slurm on the emulated cluster: munge, slurmctld on the first host, one slurmd per host.

    python -m psrt.cluster up --slurm --hostfile hostfiles/two_nodes
    python -m psrt.cluster exec node0 -- srun -N 2 -n 8 --mpi=pmix python -m psrt.train --dp ps,ring
    python -m psrt.cluster down

What running Slurm 22.05 (Debian's packages) on network namespaces takes:
- Each daemon enters only its host's *network* namespace (nsenter), plus UTS and mount
  namespaces of its own.  `ip netns exec` would mount a fresh sysfs, and slurmd then finds no
  cgroup file system and stops.
- Each host gets its own /tmp (a bind mount in the daemon's mount namespace), or PMIx fails
  with "Cannot create client cli tmpdir ... File exists" (a checkout under /tmp is mounted
  back into it, so jobs still find psrt), and the emulated hosts file over
  /etc/hosts, which `ip netns exec` would have mounted: the tasks resolve host names with it.
- `slurmd -N HOST` names the node; spool dir, pid file and log are per node (%n in slurm.conf);
  `SlurmdParameters=config_overrides` lets a node declare more CPUs than the machine has;
  `ProctrackType=proctrack/linuxproc` and `TaskPlugin=task/none` need no cgroups;
  `KillOnBadExit=1` ends a step when one task fails (MPI ranks would wait for it otherwise).
- munge runs as the munge user on a socket of this cluster's own (AuthInfo=socket=...), so a
  system munged, if any, is left alone.
- Each node offers Slurm its hostfile slots as CPUs (this machine's cores where none is given).

Everything lives under /run/psrt-slurm/<first host>/; `stop` ends the daemons and removes it.
When Slurm fails to come up, its logs are first copied to /var/tmp/psrt-slurm-logs/<first host>/.
"""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

from psrt.errors import PsrtError
from psrt.launch.plan import ROOT

BASE = Path("/run/psrt-slurm")
KEPT_LOGS = Path("/var/tmp/psrt-slurm-logs")   # survives `down`, unlike BASE
PARTITION = "emulated"
READY_TIMEOUT_S = 60
SLURMD_TIMEOUT_S = 10   # a node that has not answered for this long is DOWN, its jobs ended
MESSAGE_TIMEOUT_S = 10  # how long slurmctld waits for one answer (Slurm's default)
KILL_WAIT_S = 5         # from a job's SIGTERM to its SIGKILL (scancel, time limit, node failure)
DAEMONS = ("slurmctld", "slurmd", "slurmstepd", "munged")


def folder(cluster) -> Path:
    return BASE / cluster.hosts[0]


def conf_path(cluster) -> Path:
    return folder(cluster) / "slurm.conf"


def munge_socket(cluster) -> Path:
    return folder(cluster) / "munge" / "munge.socket"


def cpus(cluster) -> dict:
    """{host: CPUs it offers Slurm}: its slots, else this machine's cores."""
    return {h: n or os.cpu_count() or 1 for h, n in zip(cluster.hosts, cluster.slots or [None] * len(cluster.hosts))}


def srun_hint(cluster) -> str:
    """`srun -N 2 -n 8 --mpi=pmix`: every CPU the cluster offers, one task each."""
    return f"srun -N {len(cluster.hosts)} -n {sum(cpus(cluster).values())} --mpi=pmix"


def config(cluster) -> str:
    """slurm.conf for the cluster (pure: tested without Slurm)."""
    d = folder(cluster)
    nodes = "\n".join(f"NodeName={h} NodeAddr={cluster.address(h)} CPUs={n} State=UNKNOWN"
                      for h, n in cpus(cluster).items())
    return f"""\
# written by python -m psrt.cluster up --slurm; removed by python -m psrt.cluster down
ClusterName=psrt
SlurmctldHost={cluster.hosts[0]}({cluster.address(cluster.hosts[0])})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket(cluster)}
MpiDefault=pmix
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillOnBadExit=1
SlurmdTimeout={SLURMD_TIMEOUT_S}
MessageTimeout={MESSAGE_TIMEOUT_S}
KillWait={KILL_WAIT_S}
StateSaveLocation={d}/ctld
SlurmctldPidFile={d}/ctld/slurmctld.pid
SlurmctldLogFile={d}/ctld/slurmctld.log
SlurmdSpoolDir={d}/%n/spool
SlurmdPidFile={d}/%n/slurmd.pid
SlurmdLogFile={d}/%n/slurmd.log
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
{nodes}
PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def on_host(cluster, host: str, command: str, keep: Path = ROOT) -> list[str]:
    """argv that runs a shell `command` on `host` as Slurm's daemons and tasks see it: the
    host's network namespace, its name, its hosts file and its own /tmp.  `keep` (this
    checkout) stays visible when it lies under /tmp."""
    tmp = folder(cluster) / host / "tmp"
    q = shlex.quote
    steps = [f"hostname {q(host)}", f"mount --bind /etc/netns/{host}/hosts /etc/hosts"]
    inside = Path(keep).resolve()
    if Path("/tmp") in inside.parents:
        mirror = tmp / inside.relative_to("/tmp")
        steps += [f"mkdir -p {q(str(mirror))}", f"mount --bind {q(str(inside))} {q(str(mirror))}"]
    steps += [f"mount --rbind {q(str(tmp))} /tmp", f"exec {command}"]
    setup = " && ".join(steps)
    return ["nsenter", f"--net=/run/netns/{host}", "unshare", "--uts", "--mount",
            "--propagation", "private", "sh", "-c", setup]


def env(cluster, base=os.environ) -> dict:
    """The daemons' and the jobs' environment: this cluster's slurm.conf, and PMIx's hash
    store in place of its shared-memory one (gds ds21), whose lock set-up now and then
    crashes a task inside MPI_Init at address 0 under srun (seen here about once in eight
    8-rank job steps; openpmix/openpmix#1114, open-mpi/ompi#6761).  A PMIX_MCA_gds of the
    user's is kept."""
    return {"PMIX_MCA_gds": "hash", **base, "SLURM_CONF": str(conf_path(cluster))}


def require_slurm() -> None:
    missing = [b for b in ("slurmctld", "slurmd", "srun", "sinfo", "munged", "nsenter")
               if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if missing:
        raise PsrtError(f"--slurm needs {', '.join(missing)}: install Debian's slurmctld slurmd "
                        "slurm-client munge (scripts/install.sh does)")


def _start(argv: list[str], what: str, environ: dict) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, env=environ, stdin=subprocess.DEVNULL,
                          timeout=60)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        # Slurm says what is wrong in its error lines and only then that it stops (fatal:)
        said = [x for x in lines if "error:" in x][-1:] + lines[-1:]
        raise PsrtError(f"starting {what} failed: {'; '.join(said) or f'exit {proc.returncode}'}")


def start(cluster) -> None:
    """munged, slurmctld and the slurmds; returns once `sinfo` shows every node idle.  On a
    failure the logs are kept (keep_logs) before the caller's `down` removes the folder."""
    require_slurm()
    try:
        _start_daemons(cluster)
        wait_idle(cluster)
    except NotIdle as err:
        raise PsrtError(f"{err}; {keep_logs(cluster, err.nodes)}") from None
    except PsrtError as err:
        raise PsrtError(f"{err}; {keep_logs(cluster)}") from None


def _start_daemons(cluster) -> None:
    d = folder(cluster)
    for sub in ["ctld", "munge"] + [f"{h}/{x}" for h in cluster.hosts for x in ("spool", "tmp")]:
        (d / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(d / "munge", 0o755)
    shutil.chown(d / "munge", "munge", "munge")
    conf_path(cluster).write_text(config(cluster))
    environ = env(cluster)
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        _start(["runuser", "-u", "munge", "--", "mungekey", "--create"], "mungekey", environ)
    m = d / "munge"
    _start(["runuser", "-u", "munge", "--", "munged", f"--socket={m}/munge.socket",
            f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed"],
           "munged", environ)
    _start(on_host(cluster, cluster.hosts[0], "slurmctld"), f"slurmctld on {cluster.hosts[0]}", environ)
    for h in cluster.hosts:
        _start(on_host(cluster, h, f"slurmd -N {shlex.quote(h)}"), f"slurmd on {h}", environ)


def node_states(cluster) -> dict:
    """{node: state} as sinfo reports it (asked from the first host)."""
    argv = on_host(cluster, cluster.hosts[0], "sinfo -h -N -o '%N %t'")
    proc = subprocess.run(argv, capture_output=True, text=True, env=env(cluster), timeout=30,
                          stdin=subprocess.DEVNULL)
    states = {}
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2:
            states[parts[0]] = parts[1]
    return states


class NotIdle(PsrtError):
    """Nodes that did not turn idle in time."""

    def __init__(self, message: str, nodes: list):
        super().__init__(message)
        self.nodes = nodes


def wait_idle(cluster, timeout_s: float | None = None) -> None:
    timeout_s = READY_TIMEOUT_S if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    states: dict = {}
    while True:
        states = node_states(cluster)
        if all(states.get(h) == "idle" for h in cluster.hosts) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    late = [h for h in cluster.hosts if states.get(h) != "idle"]
    if late:
        shown = ", ".join(f"{h} {states.get(h, 'unknown')}" for h in cluster.hosts)
        raise NotIdle(f"Slurm did not come up within {timeout_s:.0f} s ({shown})", late)


def keep_logs(cluster, nodes=()) -> str:
    """Copy the daemons' logs where `down` leaves them; says where, and how the slurmd log of
    each of `nodes` (those that did not come up) ends."""
    src, dest = folder(cluster), KEPT_LOGS / cluster.hosts[0]
    shutil.rmtree(dest, ignore_errors=True)
    for log in sorted(src.glob("**/*.log")):
        target = dest / log.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log, target)
    if not dest.exists():
        return "no daemon wrote a log"
    ends = []
    for h in nodes:
        lines = (dest / h / "slurmd.log").read_text(errors="replace").splitlines() \
            if (dest / h / "slurmd.log").exists() else []
        ends.append(f"{h}'s slurmd.log ends: {lines[-1].strip()}" if lines else f"{h} has no slurmd log")
    return f"logs kept in {dest}" + (f" ({'; '.join(ends)})" if ends else "")


def our_processes(cluster) -> list[int]:
    """Pids of this cluster's Slurm and munge daemons (DAEMONS, job steps included) wherever
    they run: started with this cluster's SLURM_CONF, naming its folder (munged) or one of
    its hosts (slurmd -N HOST)."""
    conf, d = f"SLURM_CONF={conf_path(cluster)}".encode(), str(folder(cluster)).encode()
    nodes = [b"\0-N\0" + h.encode() + b"\0" for h in cluster.hosts]       # slurmd -N HOST
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes()
            name = (entry / "comm").read_text().strip()
            if name not in DAEMONS and os.path.basename(argv.split(b"\0")[0]).split(b":")[0].decode() not in DAEMONS:
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, UnicodeDecodeError):
            continue
        if (conf in environ or (d + b"/") in argv or any(n in argv + b"\0" for n in nodes)) \
                and not _zombie(int(entry.name)):     # an exited daemon, not yet reaped by init
            found.append(int(entry.name))
    return found


def stop(cluster) -> None:
    """End every process of this cluster's Slurm and munge and remove its files.

    `cluster.down` has normally ended the daemons with the rest of the namespaces' processes;
    this finds the ones it could not (a namespace already deleted, munged outside them) by
    their pid files and by their environment, SIGTERM first, then SIGKILL what lingers."""
    d = folder(cluster)
    pids = set(our_processes(cluster))
    for pid_file, name in [(d / "ctld" / "slurmctld.pid", "slurmctld"), (d / "munge" / "munged.pid", "munged")] + \
            [(d / h / "slurmd.pid", "slurmd") for h in cluster.hosts]:
        try:
            pid = int(pid_file.read_text().strip())
            if Path(f"/proc/{pid}/comm").read_text().strip() == name:    # not a reused pid
                pids.add(pid)
        except (OSError, ValueError):
            pass
    _end(pids)
    shutil.rmtree(d, ignore_errors=True)
    try:
        BASE.rmdir()
    except OSError:
        pass


def _end(pids, grace_s: float = 2.0) -> None:
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, grace_s)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while pids and time.monotonic() < deadline:
            pids = {p for p in pids if Path(f"/proc/{p}").exists() and not _zombie(p)}
            time.sleep(0.05)
        if not pids:
            return


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True
