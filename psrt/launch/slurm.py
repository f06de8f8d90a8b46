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

Everything lives under /run/psrt-slurm/<first host>/; `stop` ends the daemons and removes it.
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
CPUS_PER_NODE = 4        # what each emulated node offers Slurm (slots, as in the hostfiles)
PARTITION = "emulated"
READY_TIMEOUT_S = 60


def folder(cluster) -> Path:
    return BASE / cluster.hosts[0]


def conf_path(cluster) -> Path:
    return folder(cluster) / "slurm.conf"


def munge_socket(cluster) -> Path:
    return folder(cluster) / "munge" / "munge.socket"


def config(cluster, cpus: int = CPUS_PER_NODE) -> str:
    """slurm.conf for the cluster (pure: tested without Slurm)."""
    d = folder(cluster)
    nodes = "\n".join(f"NodeName={h} NodeAddr={cluster.address(h)} CPUs={cpus} State=UNKNOWN"
                      for h in cluster.hosts)
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
SlurmdTimeout=10
KillWait=5
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
    return {**base, "SLURM_CONF": str(conf_path(cluster))}


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
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise PsrtError(f"starting {what} failed: {detail[-1] if detail else f'exit {proc.returncode}'}")


def start(cluster) -> None:
    """munged, slurmctld and the slurmds; returns once `sinfo` shows every node idle."""
    require_slurm()
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
    wait_idle(cluster)


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


def wait_idle(cluster, timeout_s: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    states: dict = {}
    while time.monotonic() < deadline:
        states = node_states(cluster)
        if all(states.get(h) == "idle" for h in cluster.hosts):
            return
        time.sleep(0.5)
    shown = ", ".join(f"{h} {states.get(h, 'unknown')}" for h in cluster.hosts)
    raise PsrtError(f"Slurm did not come up within {timeout_s:.0f} s ({shown}); logs in {folder(cluster)}")


def stop(cluster) -> None:
    """End munged (the daemons in the hosts' namespaces end with them) and remove the files."""
    d = folder(cluster)
    pid_file = d / "munge" / "munged.pid"
    if pid_file.exists():
        try:
            pid = int(pid_file.read_text().strip())
            os.kill(pid, signal.SIGTERM)
            for _ in range(50):
                os.kill(pid, 0)
                time.sleep(0.05)
        except (ValueError, ProcessLookupError, PermissionError):
            pass
    shutil.rmtree(d, ignore_errors=True)
    try:
        BASE.rmdir()
    except OSError:
        pass
