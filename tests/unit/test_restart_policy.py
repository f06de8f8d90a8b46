"""Restarts on the survivors (psrt.launch.restart) and what they rely on, without MPI:
which failures are retried, on which hosts and with how many ranks, what the ranks are told;
the launcher ending a job whose mpirun hangs after an abort; checkpoints killed mid-write."""
from __future__ import annotations

import multiprocessing
import os
import random
import signal
import sys
import time

import pytest
import torch

from psrt.errors import IN_JOB_DONE
from psrt.launch import mpi
from psrt.launch.hostfile import parse_hosts
from psrt.launch.plan import Request, plan_srun
from psrt.launch.restart import Policy, next_request, run_restarting, worth_retrying
from psrt.train import checkpoint
from psrt.train.recovery import Recovery

HOSTS = parse_hosts("node0:4,node1:4")


def _req(np_=8, hosts=HOSTS, hostfile="hostfiles/two_nodes"):
    return Request(command=("python", "-m", "psrt.train"), hosts=hosts, hostfile=hostfile, np=np_)


def test_what_is_retried():
    assert worth_retrying(0) and worth_retrying(2) and worth_retrying(130) and worth_retrying(143)
    assert worth_retrying(1) is None and worth_retrying(3) is None and worth_retrying(137) is None
    assert "full disk" in worth_retrying(4) and "usage" not in worth_retrying(4)


def test_a_full_disk_at_a_checkpoint_is_exit_4_naming_the_path_and_keeps_the_previous_one(tmp_path, monkeypatch):
    """The error a full disk gives is a StorageError (exit 4, which the launcher names as such,
    not as a usage error) naming the checkpoint, and the checkpoint written before stays."""
    import errno

    import torch

    from psrt.errors import StorageError
    from psrt.train import checkpoint

    class Ctl:
        rank, size = 0, 1

        def gather(self, obj, root=0):
            return [obj]

        def bcast(self, obj, root=0):
            return obj

    class State:
        worker_rank = 0

        def state_dict(self):
            return {"w": torch.ones(3)}
    path = str(tmp_path / "ck.pt")
    config = {k: 1 for k in checkpoint.MUST_MATCH + ("dp",)}
    checkpoint.save(path, Ctl(), State(), 3, 10, config)

    def full(f, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(StorageError) as err:
        checkpoint.save(path, Ctl(), State(), 6, 10, config)
    assert err.value.exit_code == 4 and "\n" not in str(err.value)
    assert str(err.value).startswith(f"--checkpoint {path}: cannot write it (No space left on device)")
    monkeypatch.undo()
    assert torch.load(path, weights_only=True)["step"] == 3
    assert not list(tmp_path.glob(".ck.pt.*.tmp"))


def test_survivors_get_the_job_with_their_slots_and_the_hostfile_is_not_passed_on():
    req = next_request(_req(), cores=2, policy=Policy(1), probe=lambda h: h != "node1", say=lambda s: None)
    assert [h.name for h in req.hosts] == ["node0"] and req.np == 4 and req.hostfile is None
    same = next_request(_req(), cores=2, policy=Policy(1), probe=lambda h: True, say=lambda s: None)
    assert same.np == 8 and same.hostfile == "hostfiles/two_nodes"     # a crash, no host lost


def test_a_rank_lost_on_a_host_that_answers_keeps_np():
    """-np 4 on this machine with no slot count (2 cores here: mpirun oversubscribes): a killed
    rank leaves the host there, and the restart runs the 4 ranks asked for, not the core count."""
    local = _req(np_=4, hosts=parse_hosts("localhost"), hostfile="hostfiles/localhost")
    said = []
    again = next_request(local, cores=2, policy=Policy(1), probe=lambda h: True, say=said.append)
    assert again.np == 4 and again.hostfile == "hostfiles/localhost" and said == []
    starts = []
    codes = iter([137, 0])
    assert run_restarting(local, lambda r, e: starts.append(r.np) or next(codes), cores=2, policy=Policy(1),
                          probe=lambda h: True, say=said.append) == 0
    assert starts == [4, 4]
    assert "restart 1: 4 rank(s) on localhost, from the last checkpoint" in said
    # one rank per slot asked (no -np): the same count again
    assert next_request(_req(np_=None), cores=2, policy=Policy(1), probe=lambda h: True, say=said.append).np == 8


def test_a_job_that_shrinks_says_why_in_one_line():
    said = []
    req = next_request(_req(), cores=2, policy=Policy(1), probe=lambda h: h == "node0", say=said.append)
    assert req.np == 4
    assert said == ["not answering: node1; 4 rank(s) instead of 8: the slots of the hosts that answer (node0 4)"]
    said.clear()
    req = next_request(_req(np_=3), cores=2, policy=Policy(1), probe=lambda h: h == "node0", say=said.append)
    assert req.np == 3 and said == ["not answering: node1"]       # the survivors hold what was asked


def test_too_few_ranks_left_is_one_line():
    from psrt.errors import PsrtError
    with pytest.raises(PsrtError, match=r"4 rank\(s\) left on node0 \(node1 lost\), under --min-np 8"):
        next_request(_req(), cores=2, policy=Policy(1, min_np=8), probe=lambda h: h == "node0",
                     say=lambda s: None)
    with pytest.raises(PsrtError, match="no host of the job answers"):
        next_request(_req(), cores=2, policy=Policy(1), probe=lambda h: False, say=lambda s: None)


def test_restart_loop_tells_the_ranks_and_a_returning_host_is_back_in():
    starts, said = [], []
    codes = iter([3, 137, 0])
    alive = iter([{"node0"}, {"node0", "node1"}])      # node1 lost, then back for the 2nd restart
    answering = {"now": {"node0", "node1"}}

    def probe(host):
        return host in answering["now"]

    def start(req, extra):
        starts.append((req.np, [h.name for h in req.hosts], dict(extra)))
        code = next(codes)
        if code:
            answering["now"] = next(alive)
        return code
    code = run_restarting(_req(), start, cores=2, policy=Policy(2), probe=probe, say=said.append)
    assert code == 0
    assert [s[:2] for s in starts] == [(8, ["node0", "node1"]), (4, ["node0"]), (8, ["node0", "node1"])]
    assert starts[0][2] == {"PSRT_RESTARTS": "2"}
    assert starts[1][2]["PSRT_RESTART_COUNT"] == "1" and starts[2][2]["PSRT_RESTART_COUNT"] == "2"
    assert float(starts[1][2]["PSRT_FAILED_AT"]) <= time.time() + 1e-3     # written to the millisecond
    assert any("not answering: node1" in s for s in said)


def test_a_lost_host_that_answers_again_widens_the_job_without_using_a_restart():
    """The narrowed start is told of a file (PSRT_GROW_FILE) that appears once the lost host
    answers again; the job's exit 5 then starts it on both hosts, though the one restart
    allowed is spent.  Exit 5 without that request is a failure like any other."""
    starts, said = [], []
    answering = {"now": {"node0", "node1"}}

    def start(req, extra):
        starts.append((req.np, dict(extra)))
        if len(starts) == 1:               # node1 lost: the job fails
            answering["now"] = {"node0"}
            return 3
        if len(starts) == 2:               # narrowed: node1 comes back, the launcher asks, the job stops
            answering["now"] = {"node0", "node1"}
            deadline = time.monotonic() + 10
            while not os.path.exists(extra["PSRT_GROW_FILE"]) and time.monotonic() < deadline:
                time.sleep(0.01)
            return 5
        return 0
    code = run_restarting(_req(), start, cores=2, policy=Policy(1), probe=lambda h: h in answering["now"],
                          say=said.append, grow_every=0.02)
    assert code == 0, said
    assert [n for n, _ in starts] == [8, 4, 8]
    assert "PSRT_GROW_FILE" not in starts[0][1] and "PSRT_GROW_FILE" not in starts[2][1]
    assert starts[2][1]["PSRT_RESTART_COUNT"] == "2" and "PSRT_FAILED_AT" not in starts[2][1]
    assert not os.path.exists(os.path.dirname(starts[1][1]["PSRT_GROW_FILE"]))     # removed afterwards
    assert "node1 answer(s) again: asking the job to stop at its next checkpoint, to start again on every host" in said
    codes = iter([3, 5])
    said.clear()
    assert run_restarting(_req(), lambda r, e: next(codes), 2, Policy(1), probe=lambda h: h == "node0",
                          say=said.append, grow_every=0.02) == 5
    assert said[-1] == "giving up after 1 restart(s) (exit 5)"


def test_under_in_job_recovery_a_host_back_is_said_in_one_line():
    from psrt.launch.growback import telling
    said, answering = [], {"now": True}
    with telling(parse_hosts("node1"), lambda h: answering["now"], 0.02, said.append):
        time.sleep(0.1)
        answering["now"] = False           # lost, then back
        time.sleep(0.1)
        answering["now"] = True
        deadline = time.monotonic() + 10
        while not said and time.monotonic() < deadline:
            time.sleep(0.01)
    assert said == ["node1 answer(s) again: under --in-job-recovery the job cannot widen to it (ULFM adds no "
                    "ranks) and goes on narrowed, until Open MPI 5's runtime hears from that host and ends the "
                    "job (--restarts N then starts it again on every host from the last checkpoint)"]


def test_usage_errors_and_exhausted_restarts_stop():
    said = []
    assert run_restarting(_req(), lambda r, e: 2, 2, Policy(3), probe=lambda h: True, say=said.append) == 2
    assert said == ["not restarting: exit 2 is a usage error, which a restart would repeat"]
    calls = []
    code = run_restarting(_req(), lambda r, e: calls.append(1) or 1, 2, Policy(2), probe=lambda h: True,
                          say=said.append)
    assert code == 1 and len(calls) == 3 and said[-1] == "giving up after 2 restart(s) (exit 1)"


def test_recovery_checkpoints_often_and_resumes_only_on_a_restart(monkeypatch, tmp_path):
    monkeypatch.setenv("PSRT_RESTARTS", "1")
    assert Recovery(str(tmp_path / "c"), 0, total=100, lead=True).every == 5
    assert Recovery(str(tmp_path / "c"), 7, total=100, lead=True).every == 7     # --checkpoint-every kept
    assert Recovery(None, 0, total=100, lead=True).every == 0
    monkeypatch.delenv("PSRT_RESTARTS")
    assert Recovery(str(tmp_path / "c"), 0, total=100, lead=True).every == 0


def _failing_writes(monkeypatch, error, only=""):
    """open() in psrt.train.recovery, whose files raise `error` on write (for paths ending
    in `only`)."""
    import builtins
    from psrt.train import recovery as rec

    class Failing:
        def __init__(self, f):
            self.f = f
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            self.f.close()
        def write(self, _):
            raise error

    def fake(path, mode="r"):
        f = builtins.open(path, mode)
        return Failing(f) if path.endswith(only) else f
    monkeypatch.setattr(rec, "open", fake, raising=False)


def test_the_step_note_is_never_left_empty_by_a_rank_that_dies_writing_it(monkeypatch, tmp_path):
    """The last finished step (`CKPT.step`) is what a restart reports as done again and what
    psrt.bench recovery reads while the run goes on: a rank that dies while writing it (here:
    an exception at the write, which leaves the disk as a kill would) leaves the previous step."""
    monkeypatch.setenv("PSRT_RESTARTS", "1")
    book = Recovery(str(tmp_path / "c"), 0, total=100, lead=True)
    book.step_done(7)
    assert (tmp_path / "c.step").read_text() == "7"
    _failing_writes(monkeypatch, SystemExit(137))
    with pytest.raises(SystemExit):
        book.step_done(8)
    assert (tmp_path / "c.step").read_text() == "7"


def test_on_a_full_disk_the_step_note_is_rewritten_in_place(monkeypatch, tmp_path):
    """No room for a new file: the note takes the new step in place, and the run goes on to the
    checkpoint write that reports the full disk (the chaos campaign's enospc trial)."""
    monkeypatch.setenv("PSRT_RESTARTS", "1")
    book = Recovery(str(tmp_path / "c"), 0, total=100, lead=True)
    book.step_done(7)
    _failing_writes(monkeypatch, OSError(28, "No space left on device"), only=".tmp")
    book.step_done(8)
    assert (tmp_path / "c.step").read_text() == "8" and not (tmp_path / "c.step.tmp").exists()


def test_a_hung_abort_is_ended_with_its_code(tmp_path, monkeypatch):
    """mpirun stuck in 'abort is already in progress' (a host it would tell is gone): the
    launcher kills what is left ABORT_GRACE_S after the notice and returns the abort's code."""
    monkeypatch.setattr(mpi, "ABORT_GRACE_S", 0.5)
    script = ("import sys, time; sys.stderr.write('psrt: watchdog: rank(s) 2 silent for 5 s, lost\\n'); "
              "sys.stderr.flush(); time.sleep(60)")
    t0 = time.monotonic()
    code = mpi.run_job([sys.executable, "-c", script], dict(os.environ), quiet_exit=True)
    assert code == 3 and time.monotonic() - t0 < 20


def test_a_launcher_hung_after_a_rank_error_without_a_notice_is_ended(monkeypatch):
    """Open MPI 4.1 can lose its own MPI_ABORT notice (an ORTE_ERROR_LOG in show_help) and then
    wait for the daemon of a lost host: the rank's error line alone ends it, after three grace
    periods (a launcher ending by itself keeps its own code)."""
    monkeypatch.setattr(mpi, "ABORT_GRACE_S", 0.3)
    script = ("import sys, time; sys.stderr.write('[rank 0] psrt.train: error: --dp ps server rank 0: no "
              "gradient from worker rank(s) [2, 3] after 5 s\\n'); sys.stderr.flush(); time.sleep(60)")
    t0 = time.monotonic()
    code = mpi.run_job([sys.executable, "-c", script], dict(os.environ), quiet_exit=True)
    assert code == 1 and 0.9 <= time.monotonic() - t0 < 20
    quick = "import sys; sys.stderr.write('[rank 0] psrt.train: error: --lr 0: must be positive\\n'); sys.exit(2)"
    assert mpi.run_job([sys.executable, "-c", quick], dict(os.environ), quiet_exit=True) == 2


def test_open_mpi_5_losing_a_daemon_is_a_failure_and_an_in_job_end_is_not_waited_for(monkeypatch):
    """Open MPI 5's runtime ends a job that lost a host's daemon and exits 0: the launcher returns
    1.  One that waits for such a daemon after the survivors of an in-job recovery have finished
    is ended ABORT_GRACE_S after their line, with exit 0, as is one that fails on its way out
    after that line (the lost host back: its daemon's connection refused)."""
    monkeypatch.setattr(mpi, "ABORT_GRACE_S", 0.3)
    lost = "import sys; sys.stderr.write('A daemon failed to report back after being spawned. This could\\n')"
    assert mpi.run_job([sys.executable, "-c", lost], dict(os.environ), quiet_exit=True) == 1
    done = f"import sys, time; sys.stderr.write({IN_JOB_DONE!r} + '\\n'); sys.stderr.flush(); time.sleep(60)"
    t0 = time.monotonic()
    assert mpi.run_job([sys.executable, "-c", done], dict(os.environ), quiet_exit=True) == 0
    assert time.monotonic() - t0 < 20
    late = done.replace("time.sleep(60)", "sys.stderr.write('PRTE has lost communication with a remote daemon.\\n'); "
                        "sys.exit(1)")
    assert mpi.run_job([sys.executable, "-c", late], dict(os.environ), quiet_exit=True) == 0


def _write_forever(path: str, base: int) -> None:
    k = base
    while True:
        k += 1
        checkpoint.atomic_save({"step": k, "w": torch.full((1 << 18,), float(k))}, path)


def test_a_kill_at_a_random_moment_of_a_write_leaves_a_whole_checkpoint(tmp_path):
    """20 writers, each killed (SIGKILL) at a random moment: the checkpoint file is always one
    whole write, never a torn or mixed one."""
    path = str(tmp_path / "ckpt.pt")
    rng = random.Random(7)
    checkpoint.atomic_save({"step": 0, "w": torch.zeros(1 << 18)}, path)
    seen = set()
    # Writers come from a fork server that has run no torch operation (a process forked after
    # torch's thread pool started can hang), so each starts in milliseconds.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "psrt.train.checkpoint"])
    for trial in range(20):
        writer = ctx.Process(target=_write_forever, args=(path, 1000 * trial), daemon=True)
        writer.start()
        deadline = time.monotonic() + 60
        while torch.load(path, weights_only=True)["step"] <= 1000 * trial and time.monotonic() < deadline:
            time.sleep(0.005)                          # until this writer is under way
        time.sleep(rng.uniform(0.0, 0.05))
        os.kill(writer.pid, signal.SIGKILL)
        writer.join()
        state = torch.load(path, weights_only=True)
        assert torch.equal(state["w"], torch.full((1 << 18,), float(state["step"])))
        seen.add(state["step"])
    assert len(seen) == 20      # each writer was killed after whole writes of its own


def test_under_srun_a_restart_is_a_step_on_the_nodes_that_answer(tmp_path, monkeypatch):
    """mpi_launch --launcher srun --restarts: the allocation's nodes from SLURM_JOB_NODELIST
    (expanded by scontrol) with their CPUs, the first step placed by Slurm, the restart named
    onto the survivors with their CPUs' worth of tasks (never more than asked), sharing the
    CPUs the lost step still holds (--overlap), the ranks told as under mpirun."""
    from psrt.errors import PsrtError
    from psrt.launch import srun
    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\necho c1; echo c2; echo c3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "c[1-3]", "SLURM_JOB_CPUS_PER_NODE": "4,2(x2)",
           "SLURM_NTASKS": "6", "PATH": os.environ["PATH"]}
    assert srun.cpus_per_node("4,2(x2)") == [4, 2, 2]
    assert [(h.name, h.slots) for h in srun.allocation(env)] == [("c1", 4), ("c2", 2), ("c3", 2)]
    assert [h.slots for h in srun.allocation({**env, "SLURM_CPUS_PER_TASK": "2"})] == [2, 1, 1]
    runs = []
    codes = iter([137, 0])
    monkeypatch.setattr(srun, "run_job", lambda argv, e, quiet_exit, logs=None: runs.append((argv, e)) or next(codes))
    req = Request(command=("python", "-m", "psrt.train"), hosts=parse_hosts("localhost"), np=6)
    code = srun.run_restarting_srun(req, env, Policy(2), say=lambda s: None, probe=lambda n: n != "c2")
    assert code == 0 and len(runs) == 2
    first, again = runs[0][0], runs[1][0]
    assert first[:2] == ("srun", "--ntasks=6") and not any(a.startswith("--nodelist") for a in first)
    assert again[:5] == ("srun", "--ntasks=6", "--nodes=2", "--nodelist=c1,c3", "--overlap")
    assert again[-3:] == ("python", "-m", "psrt.train")
    # threads per rank from the CPUs of the step's nodes, not of the whole allocation
    one_node = plan_srun(Request(command=("x",), hosts=(), np=2),
                         "srun", {"SLURM_NTASKS": "4", "SLURM_CPUS_ON_NODE": "2", "SLURM_JOB_NUM_NODES": "2"},
                         nodes=("c1",))
    assert one_node.env["OMP_NUM_THREADS"] == "1"
    assert runs[0][1]["PSRT_RESTARTS"] == "2" and runs[1][1]["PSRT_RESTART_COUNT"] == "1"
    with pytest.raises(PsrtError, match=r"SLURM_JOB_CPUS_PER_NODE='4,x': cannot read 'x'"):
        srun.cpus_per_node("4,x")
    with pytest.raises(PsrtError, match=r"names 3 node\(s\) but SLURM_JOB_CPUS_PER_NODE=4\(x2\) counts 2"):
        srun.allocation({**env, "SLURM_JOB_CPUS_PER_NODE": "4(x2)"})
    said = []
    codes = iter([1])
    assert srun.run_restarting_srun(req, env, Policy(1, min_np=5), say=said.append,
                                    probe=lambda n: n == "c1") == 1
    assert said[-1] == "not restarting: 4 rank(s) left on c1 (c2, c3 lost), under --min-np 5"
    ended = tmp_path / "ended"
    ended.write_text("#!/bin/sh\necho JobId=7 JobName=x JobState=NODE_FAIL Reason=None\n")
    ended.chmod(0o755)
    with pytest.raises(PsrtError, match=r"^Slurm job 7 is over \(NODE_FAIL\): .* --no-kill"):
        srun.require_running(env, scontrol=str(ended))
    said, runs[:] = [], []
    assert run_restarting(req, lambda r, e: runs.append(r) or 3, 2, Policy(1), probe=lambda h: True, say=said.append,
                          precheck=lambda: srun.require_running(env, scontrol=str(ended))) == 3
    assert len(runs) == 1 and said[-1].startswith("not restarting: Slurm job 7 is over (NODE_FAIL)")
    assert srun.probe_argv("c2")[:7] == ["srun", "--overlap", "--mpi=none", "--nodes=1", "--ntasks=1",
                                         "--nodelist=c2", "--time=1"]
