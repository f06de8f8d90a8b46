"""Launcher command lines: rank placement and the mpirun / mpiexec / srun argv.

Pure functions: flavour, environment and core count come in as arguments, so every command
line is unit-tested without an MPI.  `mpi_launch` (psrt/launch/__main__.py) and the emulated
cluster (cluster.py) both build their commands here; mpi.py asks the machine's MPI.
Hostfile formats: see hostfiles/README.md.
"""
from __future__ import annotations

import os
import re
import shlex
import socket
from dataclasses import dataclass, field
from pathlib import Path

from psrt import env as psrt_env
from psrt.errors import PsrtError
from psrt.launch.hostfile import Host, hostfile_syntax, is_local, slots_of

ROOT = Path(__file__).resolve().parents[2]
FLAVOURS = ("openmpi4", "openmpi5", "mpich")

# --- planning ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Request:
    """What the user asked for, flavour-independent."""

    command: tuple[str, ...]
    hosts: tuple[Host, ...]
    hostfile: str | None = None      # where `hosts` came from (None: --hosts or the default)
    np: int | None = None            # None: one rank per slot, like mpirun
    bind: str = "auto"               # auto | none | core | socket | numa
    oversubscribe: bool = False
    threads: int | None = None       # OMP_NUM_THREADS; None: cores per rank
    exports: tuple[str, ...] = ()    # NAME or NAME=VALUE
    extra: tuple[str, ...] = ()      # passed to the launcher before the command
    emulated: bool = False           # the hosts are namespaces of this machine (psrt.cluster)
    in_job: bool = False             # --in-job-recovery: ULFM on (Open MPI 5), see in_job_flags


@dataclass(frozen=True)
class Plan:
    """The exact command, the variables it sets, and what the user should be told."""

    argv: tuple[str, ...]
    env: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    ranks_per_host: tuple[tuple[str, int], ...] = ()

    def shell(self) -> str:
        return shlex.join(self.argv)


@dataclass(frozen=True)
class Placement:
    ranks: tuple[tuple[str, int], ...]  # (host, ranks on it), hosts in hostfile order
    oversubscribed: bool
    threads: int
    notes: tuple[str, ...]


def _describe(hosts, cores) -> str:
    return ", ".join(f"{h.name} {slots_of(h, cores)}" for h in hosts)


def place(req: Request, cores: int) -> Placement:
    """Fill the hosts' slots in order (ranks 0.. on the first host), like mpirun's default.

    More ranks than slots is an error, except where the user said --oversubscribe or the
    run is on this machine alone with no slot count given (then it is said out loud).
    """
    if req.np is not None and req.np < 1:
        raise PsrtError(f"-np {req.np}: a job needs at least one rank")
    slots = [slots_of(h, cores) for h in req.hosts]
    total = sum(slots)
    np_ = total if req.np is None else req.np
    implied_local = all(is_local(h.name) and h.slots is None for h in req.hosts)
    notes = []
    over = np_ > total
    if over and not (req.oversubscribe or implied_local):
        where = req.hostfile or "--hosts"
        raise PsrtError(
            f"-np {np_} but {where} offers {total} slot{'s' * (total != 1)} "
            f"({_describe(req.hosts, cores)}): lower -np, raise the slot counts, "
            "or pass --oversubscribe")
    if over:
        why = "--oversubscribe" if req.oversubscribe else "no slot count given"
        notes.append(f"oversubscribing: {np_} ranks on {total} slot{'s' * (total != 1)} ({why})")
    counts = []
    left = np_
    for s in slots:
        counts.append(min(s, left))
        left -= counts[-1]
    i = 0
    while left:  # the excess goes round the hosts, as mpirun --oversubscribe does
        counts[i % len(counts)] += 1
        left -= 1
        i += 1
    ranks = tuple((h.name, n) for h, n in zip(req.hosts, counts) if n)
    # Cores per rank: a slot stands for a core; namespaces of one machine share its cores.
    per_host = min(s // n for s, n in zip(slots, counts) if n)
    if req.emulated or implied_local:
        per_host = min(per_host, cores // np_)
    threads = req.threads if req.threads is not None else max(1, per_host)
    return Placement(ranks, over, threads, tuple(notes))


def _exports(req: Request, env, threads: int) -> tuple[dict, list[str], list[str]]:
    """(values to set, names forwarded as they are, notes).

    PYTHONPATH gets this checkout so `python -m psrt...` runs anywhere; OMP_NUM_THREADS is
    cores per rank so N ranks do not each start a thread per core; PSRT_* pass through.
    """
    values, names, notes = {}, [], []
    path = [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                          if p and p != str(ROOT)]
    values["PYTHONPATH"] = os.pathsep.join(path)
    if "OMP_NUM_THREADS" in env and req.threads is None:
        # As torchrun does: a value the user set wins over the computed one.
        notes.append(f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']} kept from the environment "
                     f"(cores per rank: {threads})")
        names.append("OMP_NUM_THREADS")
    else:
        values["OMP_NUM_THREADS"] = str(threads)
    names += sorted(k for k in env if k.startswith("PSRT_"))
    for item in req.exports:
        name, eq, value = item.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise PsrtError(f"--export {item!r}: not a variable name (expected NAME or NAME=VALUE)")
        if eq:
            values[name] = value
        elif name not in env:
            raise PsrtError(f"--export {name}: not set in this environment")
        elif name not in names:
            names.append(name)
    return values, [n for n in names if n not in values], notes


def _check_hosts_resolve(req: Request, dry_run: bool) -> list[str]:
    """Unknown host names fail here, in one line, not minutes later inside ssh."""
    notes = []
    for h in req.hosts:
        if req.emulated or is_local(h.name):
            continue
        try:
            socket.getaddrinfo(h.name, None)
        except OSError:
            msg = f"unknown host {h.name!r} ({h.where or '--hosts'}): it does not resolve here"
            if not dry_run:
                raise PsrtError(msg + "; fix the name, add it to /etc/hosts, or add --emulate to run these "
                                 "hosts as network namespaces of this machine (root)") from None
            notes.append("a real run would stop: " + msg)
    return notes


# The watchdog takes a rank silent this long for dead (psrt.watchdog.SILENT_S), or PSRT_TIMEOUT
# if shorter; ULFM's own detector must find a lost host before it.
WATCHDOG_SILENT_S = 30.0


def in_job_flags(flavour: str, taken: tuple[str, ...], env=os.environ) -> list[str]:
    """mpirun's flags for --in-job-recovery: ULFM on, and the TCP path between all ranks,
    because Open MPI 5's shared-memory BTL does not report a dead peer (checked here: an
    MPI_Allreduce over it waits forever after a rank dies, over TCP it fails in 0.5 s with
    MPI_ERR_PROC_FAILED).  And ULFM's heartbeat detector: a lost *host* closes no connection
    (nothing crosses its dead link), so without heartbeats no survivor's call ever fails; its
    timeout is half the watchdog's silence limit (at most ULFM's default, 10 s), so the
    survivors recover before the watchdog ends the job.  A PsrtError where the MPI has no ULFM."""
    if flavour != "openmpi5":
        name = {"openmpi4": "Open MPI 4", "mpich": "MPICH"}.get(flavour, f"this MPI ({flavour})")
        raise PsrtError(f"--in-job-recovery: {name} cannot shrink a communicator after a rank is lost "
                        "(no ULFM; Open MPI 5 has it): use --restarts N to continue on the survivors "
                        "from the last checkpoint")
    flags = ["--with-ft", "ulfm"]
    if not any(a.startswith("btl") for a in taken):
        flags += ["--mca", "btl", "tcp,self"]
    limit = min(10.0, min(WATCHDOG_SILENT_S, psrt_env.get("PSRT_TIMEOUT", env)) / 2)
    # its own thread sends the heartbeats: a rank whose Python holds the GIL a while (an import,
    # a long step) is not taken for lost
    for name, value in (("mpi_ft_detector", "true"), ("mpi_ft_detector_thread", "true"),
                        ("mpi_ft_detector_timeout", f"{limit:g}"), ("mpi_ft_detector_period", f"{limit / 3:.3g}")):
        if name not in taken:          # the user's own --extra-args "--mca NAME VALUE" wins
            flags += ["--mca", name, value]
    return flags


_OMPI_BIND = {"none": "none", "core": "core", "socket": "socket", "numa": "numa"}
_SRUN_BIND = {"none": "none", "core": "cores", "socket": "sockets", "numa": "ldoms"}


def plan_mpirun(req: Request, flavour: str, mpirun: str, env, cores: int,
                emulation: list[str] = (), dry_run: bool = False) -> Plan:
    """argv for Open MPI's mpirun (4.x, 5.x) or MPICH's mpiexec (Hydra).

    Args:
        emulation: extra flags from `psrt.cluster.mpi_flags` (launch agent, TCP path).
    """
    placement = place(req, cores)
    notes = list(placement.notes) + _check_hosts_resolve(req, dry_run)
    values, names, env_notes = _exports(req, env, placement.threads)
    notes += env_notes
    ulfm = in_job_flags(flavour, tuple(emulation) + req.extra, env) if req.in_job else []
    if req.in_job:
        values["PSRT_IN_JOB_RECOVERY"] = "1"
        names = [n for n in names if n != "PSRT_IN_JOB_RECOVERY"]
    np_ = sum(n for _, n in placement.ranks)
    local_only = all(is_local(h.name) for h in req.hosts) and not req.emulated
    # Physical oversubscription (more ranks than cores here) makes busy-polling ranks
    # starve each other, and on an emulated cluster the kernel's network work as well.
    crowded = placement.oversubscribed or req.emulated or (local_only and np_ > cores)
    bind = req.bind
    if bind == "auto":
        bind = "none" if crowded else ""
    if bind and bind not in _OMPI_BIND:
        raise PsrtError(f"--bind {bind!r}: choose one of auto, none, core, socket, numa")
    syntax = "mpich" if flavour == "mpich" else "openmpi"
    host_args = []
    if not (local_only and all(h.slots is None for h in req.hosts)):
        # A hostfile already in this MPI's syntax with every slot count is passed as it is;
        # anything else is converted to an explicit host list (see hostfiles/README.md).
        native = req.hostfile and hostfile_syntax(req.hosts) == syntax and \
            all(h.slots is not None for h in req.hosts)
        if native:
            host_args = ["-f" if syntax == "mpich" else "--hostfile", req.hostfile]
        else:
            spec = ",".join(f"{h.name}:{slots_of(h, cores)}" for h in req.hosts)
            host_args = ["-hosts" if syntax == "mpich" else "--host", spec]
    if flavour == "mpich":
        argv = [mpirun, "-n", str(np_)] + host_args + list(emulation)
        if bind:
            argv += ["-bind-to", bind]
        for k, v in values.items():
            argv += ["-genv", k, v]
        if names:
            argv += ["-genvlist", ",".join(names)]
    else:
        argv = [mpirun]
        if os.geteuid() == 0:
            argv.append("--allow-run-as-root")
        argv += ["-np", str(np_)] + host_args
        if placement.oversubscribed:
            argv += ["--map-by", ":OVERSUBSCRIBE"] if flavour == "openmpi5" else ["--oversubscribe"]
        if bind:
            argv += ["--bind-to", bind]
        argv += list(emulation) + ulfm
        yield_ = psrt_env.yield_when_idle(crowded, env, req.extra)
        if yield_ is not None and "mpi_yield_when_idle" not in req.extra:
            argv += ["--mca", "mpi_yield_when_idle", yield_]
        for k, v in values.items():
            argv += ["-x", f"{k}={v}"]
        for k in names:
            argv += ["-x", k]
    argv += list(req.extra) + list(req.command)
    return Plan(tuple(argv), values, tuple(notes), placement.ranks)


def _slurm_cores_per_rank(env, np_: int, nodes: int | None = None) -> int:
    """CPUs per task: SLURM_CPUS_PER_TASK, else a node's CPUs over the tasks each of the step's
    `nodes` (default: the allocation's) runs."""
    if env.get("SLURM_CPUS_PER_TASK", "").isdigit():
        return int(env["SLURM_CPUS_PER_TASK"])
    cpus = env.get("SLURM_CPUS_ON_NODE", "")
    nodes = str(nodes or env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1")
    if cpus.isdigit() and nodes.isdigit():
        per_node = -(-np_ // int(nodes))
        return max(1, int(cpus) // per_node)
    return 1


def plan_srun(req: Request, srun: str, env, nodes: tuple[str, ...] | None = None) -> Plan:
    """argv for srun inside a Slurm allocation: the allocation decides placement, or the
    step runs on `nodes` (a restart on the survivors, psrt/launch/srun.py), sharing their
    CPUs with a step that lost a node and that Slurm still counts as running (--overlap)."""
    if req.np is not None and req.np < 1:
        raise PsrtError(f"-np {req.np}: a job needs at least one rank")
    tasks = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")
    np_ = req.np or (int(tasks) if tasks and tasks.isdigit() else 1)
    notes = []
    if tasks and tasks.isdigit() and np_ > int(tasks) and not req.oversubscribe:
        raise PsrtError(f"-np {np_} but the Slurm allocation has {tasks} tasks "
                        "(SLURM_NTASKS): lower -np, allocate more, or pass --oversubscribe")
    threads = req.threads or _slurm_cores_per_rank(env, np_, len(nodes) if nodes else None)
    values, names, env_notes = _exports(req, env, threads)
    notes += env_notes
    argv = [srun, f"--ntasks={np_}"]
    if nodes:
        argv += [f"--nodes={len(nodes)}", f"--nodelist={','.join(nodes)}", "--overlap"]
    if req.oversubscribe:
        argv.append("--overcommit")
    if req.bind != "auto":
        if req.bind not in _SRUN_BIND:
            raise PsrtError(f"--bind {req.bind!r}: choose one of auto, none, core, socket, numa")
        argv.append(f"--cpu-bind={_SRUN_BIND[req.bind]}")
    if any("," in v for v in values.values()):
        raise PsrtError("a value exported through srun --export may not contain a comma")
    # srun exports the whole environment with ALL; the listed values are set on top.
    argv.append("--export=" + ",".join(["ALL"] + [f"{k}={v}" for k, v in values.items()]))
    argv += list(req.extra) + list(req.command)
    return Plan(tuple(argv), values, tuple(notes))
