"""mpi_launch: start a command on N MPI ranks (mpirun, mpiexec or srun).  See docs/how-to/launching.md.

    ./mpi_launch -np 4 python -m psrt.info
    python -m psrt.launch --dry-run --hostfile hostfiles/two_nodes -np 8 python -m psrt.info
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import shutil
import sys

from psrt.env import grow_back_s
from psrt.errors import ArgumentParser, PsrtError, cli_main
from psrt.launch import cluster_cli
from psrt.launch.growback import telling
from psrt.launch.hostfile import is_local, parse_hostfile, parse_hosts
from psrt.launch.logs import keeping_logs
from psrt.launch.mpi import check_ulfm, find_mpirun, mpi_flavour, resolve_program, run_job
from psrt.launch.plan import FLAVOURS, ROOT, Request, plan_mpirun, plan_srun
from psrt.launch.probe import answers
from psrt.launch.restart import Policy, run_restarting, ssh_for
from psrt.launch.srun import run_restarting_srun

DEFAULT_HOSTFILE = ROOT / "hostfiles" / "localhost"

def _parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="mpi_launch",
        description="Start a command on N MPI ranks with mpirun (Open MPI, MPICH) or srun.",
        epilog="example: mpi_launch -np 4 python -m psrt.info --allreduce 16MiB")
    p.add_argument("-n", "-np", "--np", dest="np", type=int, metavar="N",
                   help="number of ranks (default: one per slot)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--hostfile", metavar="FILE",
                       help="hosts and slots, Open MPI or MPICH syntax (default: "
                            "hostfiles/localhost, this machine)")
    where.add_argument("--hosts", metavar="LIST", help="host[:N],host[:N],... instead of a file")
    p.add_argument("--bind", default="auto", choices=("auto", "none", "core", "socket", "numa"),
                   help="bind ranks to cores etc. (auto: the MPI's default, none when crowded)")
    p.add_argument("--oversubscribe", action="store_true",
                   help="allow more ranks than slots")
    p.add_argument("--threads", type=int, metavar="N",
                   help="OMP_NUM_THREADS per rank (default: cores per rank)")
    p.add_argument("-x", "--export", action="append", default=[], metavar="NAME[=VALUE]",
                   help="also export this variable (PYTHONPATH, OMP_NUM_THREADS, PSRT_* always are)")
    p.add_argument("--launcher", default="auto", choices=("auto", "mpirun", "srun"),
                   help="auto: srun inside a Slurm allocation (no hostfile given), else mpirun")
    p.add_argument("--mpirun", metavar="PATH", help="the mpirun or mpiexec to use")
    p.add_argument("--flavour", choices=FLAVOURS,
                   help="build the command for this MPI instead of asking mpirun --version")
    p.add_argument("--extra-args", default="", metavar="ARGS",
                   help="more launcher arguments, one shell-quoted string")
    p.add_argument("--emulate", action="store_true",
                   help="run on an emulated cluster of the hostfile's hosts (network namespaces "
                        "of this machine, needs root; see python -m psrt.cluster)")
    p.add_argument("--rate", help="emulated links: bandwidth, tc syntax (e.g. 1gbit)")
    p.add_argument("--delay", help="emulated links: one-way delay, tc syntax (e.g. 1ms)")
    p.add_argument("--subnet", help="emulated hosts' subnet inside 198.18.0.0/15 "
                                    "(default 198.18.0.0/24)")
    p.add_argument("--restarts", type=int, default=0, metavar="N",
                   help="after a failure start the job again, up to N times, on the hosts that "
                        "still answer (psrt.train continues from its last checkpoint)")
    p.add_argument("--min-np", type=int, default=1, metavar="M",
                   help="with --restarts: stop instead when fewer than M ranks are left")
    p.add_argument("--in-job-recovery", action="store_true",
                   help="after a lost rank the survivors carry on inside the job (MPI's ULFM: "
                        "Open MPI 5); psrt.train continues from the last step they all finished")
    p.add_argument("--dry-run", action="store_true",
                   help="print the exact command and run nothing")
    p.add_argument("command", nargs=argparse.REMAINDER, help="program and its arguments")
    return p


def _request(args, cores: int) -> Request:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise PsrtError("no command given (e.g. mpi_launch -np 2 python -m psrt.info)")
    if args.hosts:
        hosts, hostfile = parse_hosts(args.hosts), None
    else:
        hostfile = args.hostfile or str(DEFAULT_HOSTFILE)
        hosts = parse_hostfile(hostfile)
    if args.threads is not None and args.threads < 1:
        raise PsrtError(f"--threads {args.threads}: needs at least one thread")
    if args.restarts < 0 or args.min_np < 1:
        raise PsrtError(f"--restarts {args.restarts} --min-np {args.min_np}: restarts are 0 or "
                        "more, and at least one rank is needed")
    return Request(command=tuple(command), hosts=hosts, hostfile=hostfile, np=args.np,
                   bind=args.bind, oversubscribe=args.oversubscribe, threads=args.threads,
                   exports=tuple(args.export), extra=tuple(shlex.split(args.extra_args)),
                   emulated=args.emulate, in_job=args.in_job_recovery)


def _say(notes) -> None:
    for note in notes:
        print(f"mpi_launch: {note}", file=sys.stderr, flush=True)


@cli_main("mpi_launch")
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    env = os.environ
    cores = os.cpu_count() or 1
    req = _request(args, cores)
    in_slurm = "SLURM_JOB_ID" in env or "SLURM_JOBID" in env
    explicit_hosts = bool(args.hostfile or args.hosts)
    use_srun = args.launcher == "srun" or (
        args.launcher == "auto" and in_slurm and not explicit_hosts and not args.emulate
        and shutil.which("srun"))
    if use_srun:
        if explicit_hosts or args.emulate:
            raise PsrtError("srun places ranks on the Slurm allocation's nodes: drop "
                            "--hostfile/--hosts/--emulate, or use --launcher mpirun")
        if args.in_job_recovery:
            raise PsrtError("--in-job-recovery: needs Open MPI 5's mpirun (--with-ft ulfm), not srun: "
                            "use --launcher mpirun, or --restarts N")
        if shutil.which("srun") is None and not args.dry_run:
            raise PsrtError("--launcher srun: no srun on PATH (not on a Slurm cluster?)")
        plan = plan_srun(req, "srun", env)      # by name, as the user would type it
        _say(plan.notes)
        if args.dry_run:
            print(plan.shell())
            return 0
        if args.restarts:
            return run_restarting_srun(req, env, Policy(args.restarts, args.min_np), say=lambda line: _say([line]))
        return run_job(plan.argv, {**env, **plan.env})
    if args.flavour and args.dry_run:
        mpirun = args.mpirun or ("mpiexec" if args.flavour == "mpich" else "mpirun")
        flavour = args.flavour
    else:
        mpirun = find_mpirun(args.mpirun)
        flavour = args.flavour or mpi_flavour(mpirun)
        if os.path.isabs(mpirun):   # Open MPI will change the ranks' PATH: pin the program
            req = dataclasses.replace(req, command=resolve_program(req.command))
        if args.in_job_recovery:
            check_ulfm(mpirun, flavour)
    if args.emulate:
        return cluster_cli.launch(req, flavour, mpirun, env, cores, args, dry_run=args.dry_run,
                              restarting=lambda r, start, probe: restarting(r, start, cores, args, env, probe))
    if args.rate or args.delay or args.subnet:
        raise PsrtError("--rate, --delay and --subnet shape the emulated cluster: add --emulate")
    plan = plan_mpirun(req, flavour, mpirun, env, cores, dry_run=args.dry_run)
    _say(plan.notes)
    if args.dry_run:
        print(plan.shell())
        return 0

    def run(logs):
        def start(request, extra):
            # planned again with the restart's variables, which the ranks of every host must see
            job_env = {**env, **extra}
            p = plan_mpirun(request, flavour, mpirun, job_env, cores) if extra else plan
            return run_job(p.argv, {**job_env, **p.env}, quiet_exit=flavour.startswith("openmpi"), logs=logs)
        return restarting(req, start, cores, args, env)
    # every start of the job keeps its notices in one directory (psrt/launch/logs.py)
    return keeping_logs(run, say=lambda line: _say([line]), environ=env)


def restarting(req, start, cores: int, args, env, probe=None) -> int:
    """`start` the job, and again on the survivors after a failure, as --restarts says."""
    if probe is None:
        ssh = ssh_for(env)
        probe = lambda host: answers(host, ssh=ssh)   # noqa: E731
    say, every = (lambda line: _say([line])), grow_back_s(env)
    if args.in_job_recovery:     # no grow-back inside a job: a host back is said, in one line
        remote = [h for h in req.hosts if not is_local(h.name)]
        with telling(remote, probe, every, say):
            return run_restarting(req, start, cores, Policy(args.restarts, args.min_np), probe=probe, say=say)
    return run_restarting(req, start, cores, Policy(args.restarts, args.min_np), probe=probe, say=say,
                          grow_every=every)


if __name__ == "__main__":
    sys.exit(main())
