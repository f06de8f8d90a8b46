"""`python -m psrt.cluster`: the emulated cluster's command line, and `mpi_launch --emulate`.

The namespaces, links and daemons themselves are psrt/launch/cluster.py.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

from psrt.errors import ArgumentParser, PsrtError, cli_main
from psrt.launch import slurm
from psrt.launch.cluster import (DEFAULT_SUBNET, SSH_DIR, Cluster, _alive, down, exec_argv, fail, host_states,
                                 job_env, mpi_flags, recorded, require_netns, revive, running, up)
from psrt.launch.hostfile import parse_hostfile, parse_hosts
from psrt.launch.logs import keeping_logs
from psrt.launch.mpi import find_mpirun, mpi_flavour, run_job
from psrt.launch.plan import plan_mpirun
from psrt.launch.probe import answers


# --- entry points -----------------------------------------------------------------------------

def launch(req, flavour: str, mpirun: str, env, cores: int, args, dry_run: bool = False,
           restarting=None) -> int:
    """`mpi_launch --emulate`: run the planned mpirun on the first host of a fresh cluster.

    `restarting(req, start, probe)`, when given, runs `start` and starts it again after a
    failure (psrt.launch.restart); `probe` asks a host the way the cluster's MPI reaches it."""
    cluster = Cluster(tuple(h.name for h in req.hosts), args.subnet or DEFAULT_SUBNET,
                      args.rate, args.delay)

    def planned(request, job_env):
        return plan_mpirun(request, flavour, mpirun, job_env, cores,
                           emulation=mpi_flags(cluster, flavour), dry_run=dry_run)
    plan = planned(req, env)
    for note in plan.notes:
        print(f"mpi_launch: {note}", file=sys.stderr, flush=True)
    if dry_run:
        for line in cluster.describe():
            print(f"# {line}")
        print(shlex.join(exec_argv(cluster.hosts[0], plan.argv)))
        return 0

    def run(logs):
        def start(request, extra):
            job_env = {**env, **extra}
            p = planned(request, job_env) if extra else plan
            # mpirun runs on the first host of this attempt (a lost first host is left out)
            # in-job: the agent mpirun calls holds a lost host's session as ssh would (scripts/netns_agent)
            argv = (["env", "NETNS_AGENT_HOLD=1"] if request.in_job else []) + list(p.argv)
            return run_job(exec_argv(request.hosts[0].name, argv), {**job_env, **p.env},
                           quiet_exit=flavour.startswith("openmpi"), logs=logs)
        if restarting is None:
            return start(req, {})
        return restarting(req, start, probe=lambda host: answers(host, ssh=str(SSH_DIR / "ssh")))
    with running(cluster):
        # every start of the job keeps its notices in one directory (psrt/launch/logs.py)
        return keeping_logs(run, say=lambda line: print(f"mpi_launch: {line}", file=sys.stderr, flush=True),
                            environ=env)


def _cluster_from(args) -> Cluster:
    hosts = parse_hosts(args.hosts) if args.hosts else parse_hostfile(args.hostfile)
    return Cluster(tuple(h.name for h in hosts), args.subnet, args.rate, args.delay,
                   getattr(args, "slurm", False), tuple(h.slots for h in hosts))


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m psrt.cluster",
                                description="Emulate a cluster with network namespaces (root).")
    sub = p.add_subparsers(dest="action", required=True)

    def shape_opts(sp, hosts_required=True):
        where = sp.add_mutually_exclusive_group(required=hosts_required)
        where.add_argument("--hostfile", help="one host per entry (e.g. hostfiles/two_nodes)")
        where.add_argument("--hosts", help="host,host,... instead of a hostfile")
        sp.add_argument("--subnet", default=DEFAULT_SUBNET,
                        help=f"inside 198.18.0.0/15 (default {DEFAULT_SUBNET})")
        sp.add_argument("--rate", help="bandwidth of every host's link, tc syntax (1gbit)")
        sp.add_argument("--delay", help="one-way delay of every host's link (1ms; netem, or psrt's delay line)")

    def slurm_opt(sp):
        sp.add_argument("--slurm", action="store_true",
                        help="also run Slurm: munge, slurmctld on the first host, a slurmd per host")

    up_ = sub.add_parser("up", help="create the cluster and leave it up")
    shape_opts(up_)
    slurm_opt(up_)
    run = sub.add_parser("run", help="create, run a command on the first host, remove")
    shape_opts(run)
    slurm_opt(run)
    run.add_argument("command", nargs=argparse.REMAINDER)
    ex = sub.add_parser("exec", help="run a command on a host of a cluster that is up")
    ex.add_argument("host")
    ex.add_argument("command", nargs=argparse.REMAINDER)
    dn = sub.add_parser("down", help="remove clusters (default: every one no process owns)")
    shape_opts(dn, hosts_required=False)
    dn.add_argument("--force", action="store_true", help="also those a running job owns")
    sub.add_parser("status", help="list the clusters that are up and the state of each host")
    for action, what in (("fail", "emulate a lost host: kill everything on it and take its link down"),
                         ("revive", "bring a failed host's link back up")):
        sub.add_parser(action, help=what).add_argument("host")
    return p


def _command(args) -> list[str]:
    cmd = list(args.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise PsrtError(f"{args.action}: no command given (put it after --)")
    return cmd


def _flavour() -> str:
    return mpi_flavour(find_mpirun())


@cli_main("psrt.cluster")
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.action == "status":
        clusters = recorded()
        if not clusters:
            print("no emulated cluster is up")
        for cluster, owner in clusters:
            who = "up until `down`" if not owner else f"owned by pid {owner}" if _alive(owner) else \
                f"owned by pid {owner}, which has ended: `down` removes it"
            print(f"{cluster.describe()[0]} ({who})")
            for host, state in host_states(cluster).items():
                print(f"  {host}: {state}")
        return 0
    if args.action == "down":
        if args.hostfile or args.hosts:
            targets = [_cluster_from(args)]
        else:
            targets = [c for c, owner in recorded()
                       if args.force or owner is None or not _alive(owner)]
        require_netns()
        for cluster in targets:
            gone = down(cluster)
            print(f"removed {', '.join(gone) or 'nothing left'} ({', '.join(cluster.hosts)})")
        return 0
    if args.action == "up":
        cluster = _cluster_from(args)
        up(cluster)
        print(cluster.describe()[0])
        launcher = slurm.srun_hint(cluster) if cluster.slurm else "mpirun"
        print(f"run: python -m psrt.cluster exec {cluster.hosts[0]} -- {launcher} ...; "
              "remove: python -m psrt.cluster down")
        return 0
    if args.action in ("fail", "revive"):
        if not any(args.host in c.hosts for c, _ in recorded()):
            raise PsrtError(f"no emulated cluster is up with a host {args.host!r} "
                            "(python -m psrt.cluster status)")
        (fail if args.action == "fail" else revive)(args.host)
        print(f"{args.host}: {'lost (processes killed, link down)' if args.action == 'fail' else 'link up'}")
        return 0
    if args.action == "exec":
        cmd = _command(args)
        owners = [c for c, _ in recorded() if args.host in c.hosts]
        if not owners:
            raise PsrtError(f"no emulated cluster is up with a host {args.host!r} "
                            "(python -m psrt.cluster status)")
        env = job_env(owners[0], _flavour(), os.environ)
        return run_job(exec_argv(args.host, cmd), env)
    # run
    cmd = _command(args)
    cluster = _cluster_from(args)
    env = job_env(cluster, _flavour(), os.environ)
    with running(cluster):
        return run_job(exec_argv(cluster.hosts[0], cmd), env)


if __name__ == "__main__":
    sys.exit(main())
