"""Restarts under srun: the nodes of the Slurm allocation, asking a node whether a job step
starts there, and the job started again as a new step on the nodes that do.

`mpi_launch --launcher srun --restarts N` inside an allocation runs the job as one srun step;
when the step fails, every node of the allocation is asked at once with a one-task step
(`srun --nodelist=NODE true`, under a deadline: a node that slurmctld has not yet marked DOWN
takes the launch's MessageTimeout to fail), and the job runs again as a step on the nodes
that answer, with as many tasks as their CPUs in the allocation hold (never more than asked
for).  The policy (what is retried, --min-np, the ranks' PSRT_RESTART_COUNT) is restart.py's,
shared with mpirun.

Slurm ends a whole job when one of its nodes fails unless it was allocated with --no-kill
(`salloc -k`, `#SBATCH --no-kill`); with it the job goes on with the node removed from it.
The step that lost a node stays on slurmctld's books holding its CPUs (seen with Slurm 22.05:
its tasks on the lost node never report), so the steps started afterwards share them
(--overlap) instead of waiting for them for ever.
"""
from __future__ import annotations

import dataclasses
import re
import subprocess

from psrt.errors import PsrtError
from psrt.launch.hostfile import Host
from psrt.launch.logs import keeping_logs
from psrt.launch.mpi import run_job
from psrt.launch.plan import plan_srun
from psrt.launch.probe import PROBE_TIMEOUT_S
from psrt.launch.restart import Policy, run_restarting

WHERE = "SLURM_JOB_NODELIST"
_CPUS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def cpus_per_node(spec: str) -> list[int]:
    """Slurm's compressed CPU counts, e.g. SLURM_JOB_CPUS_PER_NODE "4(x2),2" -> [4, 4, 2]."""
    counts = []
    for item in spec.split(","):
        m = _CPUS.match(item.strip())
        if not m:
            raise PsrtError(f"SLURM_JOB_CPUS_PER_NODE={spec!r}: cannot read {item!r} "
                            "(expected N or N(xK), comma-separated)")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def allocation(env, scontrol: str = "scontrol") -> tuple[Host, ...]:
    """The allocation's nodes, each with the tasks its CPUs hold (CPUs // SLURM_CPUS_PER_TASK),
    in Slurm's order; the node list expanded by `scontrol show hostnames`."""
    nodelist = env.get(WHERE) or env.get("SLURM_NODELIST")
    spec = env.get("SLURM_JOB_CPUS_PER_NODE", "")
    if not nodelist or not spec:
        raise PsrtError("--restarts under srun needs SLURM_JOB_NODELIST and SLURM_JOB_CPUS_PER_NODE "
                        "(set inside a Slurm allocation: salloc or sbatch)")
    try:
        out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise PsrtError(f"scontrol show hostnames {nodelist}: {err}") from None
    names = out.stdout.split()
    if out.returncode != 0 or not names:
        raise PsrtError(f"scontrol show hostnames {nodelist}: {out.stderr.strip() or 'no node'}")
    cpus = cpus_per_node(spec)
    if len(cpus) != len(names):
        raise PsrtError(f"{WHERE}={nodelist} names {len(names)} node(s) but SLURM_JOB_CPUS_PER_NODE={spec} "
                        f"counts {len(cpus)}")
    per_task = int(env["SLURM_CPUS_PER_TASK"]) if env.get("SLURM_CPUS_PER_TASK", "").isdigit() else 1
    return tuple(Host(n, max(1, c // max(1, per_task)), WHERE) for n, c in zip(names, cpus))


def probe_argv(node: str, srun: str = "srun") -> list[str]:
    """A one-task step on `node` that does nothing: it starts only where slurmd answers."""
    return [srun, "--overlap", "--mpi=none", "--nodes=1", "--ntasks=1", f"--nodelist={node}",
            "--time=1", "--quiet", "true"]


def step_starts(node: str, srun: str = "srun", timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a step starts on `node` within `timeout`.  A node Slurm knows to be down is
    refused at once; one it still counts as up but that is gone holds srun for the launch's
    MessageTimeout, so srun is stopped at the deadline (SIGTERM: it withdraws the step)."""
    proc = subprocess.Popen(probe_argv(node, srun), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        return proc.wait(timeout=timeout) == 0
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return False


def job_state(job: str, scontrol: str = "scontrol") -> str:
    """RUNNING, NODE_FAIL, ... as slurmctld has job `job` ("" when it cannot be asked)."""
    try:
        out = subprocess.run([scontrol, "-o", "show", "job", job], capture_output=True, text=True, timeout=30,
                             stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    m = re.search(r"\bJobState=(\S+)", out)
    return m.group(1) if m else ""


def require_running(env, scontrol: str = "scontrol") -> None:
    """A restart needs the allocation: one that Slurm ended with the lost node (no --no-kill)
    is said in one line instead of srun's "job has expired"."""
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID", "")
    state = job_state(job, scontrol) if job else ""
    if state and state != "RUNNING":
        raise PsrtError(f"Slurm job {job} is over ({state}): a lost node ends the whole job unless it "
                        "was allocated with --no-kill (salloc/sbatch), which --restarts under srun needs")


def run_restarting_srun(req, env, policy: Policy, say, srun: str = "srun", probe=None) -> int:
    """Run `req` as an srun step, and after a failure as a new step on the nodes of the
    allocation that still start one (restart.run_restarting decides when and how many)."""
    tasks = env.get("SLURM_NTASKS", "")
    asked = req.np or (int(tasks) if tasks.isdigit() else None)
    whole = dataclasses.replace(req, hosts=allocation(env), hostfile=None, np=asked)
    probe = probe or (lambda node: step_starts(node, srun))

    def run(logs):
        def start(request, extra):
            job_env = {**env, **extra}
            # The first step is placed by the allocation; a restart names its nodes.
            nodes = None if "PSRT_RESTART_COUNT" not in extra else tuple(h.name for h in request.hosts)
            plan = plan_srun(request, srun, job_env, nodes=nodes)
            # quiet_exit: srun waits for a lost node's tasks until slurmctld declares it DOWN;
            # run_job ends it ABORT_GRACE_S after the survivors' abort notice (mpi.Ending).
            return run_job(plan.argv, {**job_env, **plan.env}, quiet_exit=True, logs=logs)
        return run_restarting(whole, start, cores=1, policy=policy, probe=probe, say=say,
                              precheck=lambda: require_running(env))
    # every step of the job keeps its notices in one directory (psrt/launch/logs.py)
    return keeping_logs(run, say=say, environ=env)
