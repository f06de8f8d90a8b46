"""mpi_launch and psrt.launch.plan: hostfiles, placement, and the exact launcher command lines.

Command lines are built by pure functions (flavour, environment, core count passed in), so
Open MPI 5, MPICH and srun are checked here although only Open MPI 4 is installed.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from conftest import LAUNCH_CMD, NOWHERE, req, root_flag, write_hostfile

from psrt.errors import PsrtError
from psrt.launch import hostfile as H
from psrt.launch import plan as L
from psrt.launch.__main__ import main as launch_main
from psrt.launch.mpi import drop_exit_banners, local_mpirun_prefix

ROOT = Path(__file__).resolve().parents[2]


# --- hostfiles ------------------------------------------------------------------------------

@pytest.mark.parametrize("line,name,slots,syntax", [
    ("node0 slots=4", "node0", 4, "openmpi"),
    ("  node0   slots=4   max_slots=8  # comment", "node0", 4, "openmpi"),
    ("node0:4", "node0", 4, "mpich"),
    ("10.0.0.7:2", "10.0.0.7", 2, "mpich"),
    ("node0", "node0", None, "plain"),
    ("node-1.example.org", "node-1.example.org", None, "plain"),
])
def test_host_line(line, name, slots, syntax):
    h = H.parse_host_line(line, "f line 1")
    assert (h.name, h.slots, h.syntax) == (name, slots, syntax)


@pytest.mark.parametrize("line", ["", "   ", "# only a comment"])
def test_blank_and_comment_lines_are_skipped(line):
    assert H.parse_host_line(line, "f line 1") is None


@pytest.mark.parametrize("line,says", [
    ("node0 slot=4", "unknown key 'slot'"),
    ("node0 slots=0", "slots '0' is not a positive"),
    ("node0 slots=four", "slots 'four'"),
    ("node0:x", "slot count 'x'"),
    ("node0 node1", "cannot read 'node0 node1'"),
    ("node0:4:eth0", "slot count '4:eth0'"),
])
def test_bad_host_line_names_file_and_line(line, says):
    with pytest.raises(PsrtError) as err:
        H.parse_host_line(line, "hf line 7")
    assert str(err.value).startswith("hf line 7: ") and says in str(err.value)


def test_repository_hostfiles():
    assert H.parse_hostfile(ROOT / "hostfiles" / "localhost") == (
        H.Host("localhost", None, f"{ROOT / 'hostfiles' / 'localhost'} line 3", "plain"),)
    two = H.parse_hostfile(ROOT / "hostfiles" / "two_nodes")
    assert [(h.name, h.slots, h.syntax) for h in two] == [("node0", 4, "openmpi"),
                                                          ("node1", 4, "openmpi")]


def test_repeated_host_adds_slots(tmp_path):
    hosts = H.parse_hostfile(write_hostfile(tmp_path, "a slots=2\nb slots=1\na slots=3\n"))
    assert [(h.name, h.slots) for h in hosts] == [("a", 5), ("b", 1)]


def test_mixed_syntax_is_refused(tmp_path):
    path = write_hostfile(tmp_path, "a slots=2\nb:2\n")
    with pytest.raises(PsrtError, match="mixes Open MPI .* and MPICH"):
        H.parse_hostfile(path)


def test_missing_or_empty_hostfile(tmp_path):
    with pytest.raises(PsrtError, match=r"hostfile .*nope: No such file"):
        H.parse_hostfile(tmp_path / "nope")
    with pytest.raises(PsrtError, match="names no hosts"):
        H.parse_hostfile(write_hostfile(tmp_path, "# nothing\n"))


def test_conversion_between_syntaxes(tmp_path):
    ompi = H.parse_hostfile(write_hostfile(tmp_path, "node0 slots=4\nnode1 slots=2\nnode2\n"))
    as_mpich = H.format_hosts(ompi, "mpich", cores=8)
    assert as_mpich == "node0:4\nnode1:2\nnode2:1\n"
    back = H.parse_hostfile(write_hostfile(tmp_path, as_mpich, "m"))
    assert H.format_hosts(back, "openmpi", cores=8) == "node0 slots=4\nnode1 slots=2\nnode2 slots=1\n"


def test_hosts_option():
    assert [(h.name, h.slots) for h in H.parse_hosts("a:2,b:3,c")] == [("a", 2), ("b", 3), ("c", None)]
    with pytest.raises(PsrtError, match="empty entry"):
        H.parse_hosts("a:2,,b")


# --- placement --------------------------------------------------------------------------------

TWO = "node0:4,node1:4"


def test_more_ranks_than_slots_is_an_error():
    with pytest.raises(PsrtError) as err:
        L.place(req(TWO, 9, hostfile="hostfiles/two_nodes"), cores=2)
    assert str(err.value) == ("-np 9 but hostfiles/two_nodes offers 8 slots (node0 4, node1 4): "
                              "lower -np, raise the slot counts, or pass --oversubscribe")


def test_oversubscribe_when_asked_and_said():
    p = L.place(req(TWO, 10, oversubscribe=True), cores=2)
    assert p.oversubscribed and p.ranks == (("node0", 5), ("node1", 5))
    assert "oversubscribing: 10 ranks on 8 slots (--oversubscribe)" in p.notes[0]


def test_local_run_oversubscribes_past_the_cores_and_says_so():
    p = L.place(req("localhost", 5), cores=2)
    assert p.oversubscribed and p.ranks == (("localhost", 5),)
    assert p.notes == ("oversubscribing: 5 ranks on 2 slots (no slot count given)",)
    assert not L.place(req("localhost", 2), cores=2).oversubscribed


def test_local_slots_written_down_are_a_limit():
    with pytest.raises(PsrtError, match="offers 2 slots"):
        L.place(req("localhost:2", 3), cores=16)


@pytest.mark.parametrize("np_", [0, -3])
def test_np_below_one(np_):
    with pytest.raises(PsrtError, match=rf"-np {np_}: a job needs at least one rank"):
        L.place(req(TWO, np_), cores=2)


@pytest.mark.parametrize("hosts,np_,cores,emulated,threads", [
    ("localhost", 2, 8, False, 4),      # cores per rank on this machine
    ("localhost", 3, 8, False, 2),
    ("localhost", 16, 8, False, 1),     # never below one
    (TWO, 8, 2, False, 1),              # a slot stands for a core
    (TWO, 2, 2, False, 2),              # two ranks on node0's 4 slots
    (TWO, 2, 2, True, 1),               # emulated hosts share this machine's 2 cores
])
def test_threads_are_cores_per_rank(hosts, np_, cores, emulated, threads):
    assert L.place(req(hosts, np_, emulated=emulated), cores).threads == threads


# --- command lines ----------------------------------------------------------------------------


def test_srun_inside_an_allocation():
    env = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "8", "SLURM_CPUS_PER_TASK": "4"}
    p = L.plan_srun(req("localhost", 8, bind="core"), "srun", env)
    assert list(p.argv) == ["srun", "--ntasks=8", "--cpu-bind=cores",
                            f"--export=ALL,PYTHONPATH={ROOT},OMP_NUM_THREADS=4", *LAUNCH_CMD]
    # No -np: the allocation's task count; no cpus-per-task: the node's cpus shared out.
    p = L.plan_srun(req("localhost"), "srun", {"SLURM_NTASKS": "4", "SLURM_CPUS_ON_NODE": "8",
                                                "SLURM_JOB_NUM_NODES": "2"})
    assert p.argv[1] == "--ntasks=4" and "OMP_NUM_THREADS=4" in p.argv[2]
    with pytest.raises(PsrtError, match="allocation has 8 tasks"):
        L.plan_srun(req("localhost", 9), "srun", env)


# --- the CLI ----------------------------------------------------------------------------------

def cli(capsys, *args):
    """Run mpi_launch's main in this process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as done:
        sys.exit(launch_main(list(args)))
    out = capsys.readouterr()
    return done.value.code, out.out, out.err


def test_cli_dry_run_for_another_mpi_needs_no_mpi(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    code, out, _ = cli(capsys, "--dry-run", "--flavour", "mpich", "--hosts", "a:2,b:2",
                       "-np", "4", "python", "x.py")
    assert code == 0 and out.startswith("mpiexec -n 4 -hosts a:2,b:2 ")


def test_cli_bad_hostfile_names_the_line(capsys, tmp_path):
    path = write_hostfile(tmp_path, "node0 slots=4\nnode1 slots=4 extra\n")
    code, _, err = cli(capsys, "--hostfile", str(path), "true")
    assert code == 2 and f"{path} line 2: cannot read 'node1 slots=4 extra'" in err


def test_cli_picks_srun_inside_a_slurm_allocation(capsys, monkeypatch, tmp_path):
    srun = tmp_path / "srun"
    srun.write_text("#!/bin/sh\nexit 0\n")
    srun.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_NTASKS", "6")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    code, out, _ = cli(capsys, "--dry-run", "python", "-m", "psrt.info")
    # by name, as the user would type it: PATH finds the same srun
    assert code == 0 and out.startswith("srun --ntasks=6 --export=ALL,PYTHONPATH=")


# --- command lines (pure) ---------------------------------------------------------------------

def plan(hosts, np_=None, flavour="openmpi4", env=None, cores=2, **kw):
    hostfile_ = kw.pop("hostfile", None)
    r = req(hosts, np_, hostfile=hostfile_, **kw)
    return L.plan_mpirun(r, flavour, "mpirun", env or {}, cores)


@pytest.mark.parametrize("np_,ranks", [
    (8, (("node0", 4), ("node1", 4))),
    (6, (("node0", 4), ("node1", 2))),
    (3, (("node0", 3),)),
    (None, (("node0", 4), ("node1", 4))),  # one rank per slot, like mpirun
])
def test_ranks_fill_hosts_in_order(np_, ranks):
    assert L.place(req(TWO, np_), cores=2).ranks == ranks


def test_mpich_gets_a_converted_host_list_and_genv():
    hosts = H.parse_hostfile(ROOT / "hostfiles" / "two_nodes")
    r = L.Request(command=LAUNCH_CMD, hosts=hosts, hostfile="hostfiles/two_nodes", np=8)
    p = L.plan_mpirun(r, "mpich", "mpiexec", {"PSRT_X": "1"}, 2, dry_run=True)
    assert list(p.argv) == ["mpiexec", "-n", "8", "-hosts", "node0:4,node1:4",
                            "-genv", "PYTHONPATH", str(ROOT), "-genv", "OMP_NUM_THREADS", "1",
                            "-genvlist", "PSRT_X", *LAUNCH_CMD]


def test_openmpi5_oversubscribes_through_map_by():
    argv = plan("localhost", 4, flavour="openmpi5").argv
    assert "--map-by" in argv and argv[argv.index("--map-by") + 1] == ":OVERSUBSCRIBE"
    assert "--oversubscribe" not in argv


def test_bind_choice_and_user_threads_win():
    p = plan("localhost", 2, env={"OMP_NUM_THREADS": "3"}, bind="core")
    argv = list(p.argv)
    assert argv[argv.index("--bind-to") + 1] == "core"
    assert "-x" in argv and argv[argv.index("OMP_NUM_THREADS") - 1] == "-x"
    assert "OMP_NUM_THREADS=1" not in argv
    assert "OMP_NUM_THREADS=3 kept from the environment" in p.notes[0]
    assert "OMP_NUM_THREADS=5" in plan("localhost", 2, threads=5).argv


def test_exports():
    p = plan("localhost", 1, env={"FOO": "1"}, exports=("FOO", "BAR=2"))
    assert "BAR=2" in p.argv and p.argv[p.argv.index("FOO") - 1] == "-x"
    with pytest.raises(PsrtError, match="--export NOPE: not set"):
        plan("localhost", 1, exports=("NOPE",))
    with pytest.raises(PsrtError, match="not a variable name"):
        plan("localhost", 1, exports=("1X=2",))


def test_unknown_host_is_an_error_in_a_real_run():
    with pytest.raises(PsrtError) as err:
        plan(f"localhost:1,{NOWHERE}:1", 2)
    assert f"unknown host {NOWHERE!r}" in str(err.value)


def test_hosts_without_counts_get_one_slot_each():
    p = L.plan_mpirun(req("localhost:2,127.0.0.1"), "openmpi4", "mpirun", {}, 8)
    argv = list(p.argv)
    assert argv[argv.index("--host") + 1] == "localhost:2,127.0.0.1:8"
    assert p.argv[p.argv.index("-np") + 1] == "10"


def test_local_mpirun_prefix_still_serves_the_test_fixture():
    if shutil.which("mpirun") is None:
        pytest.skip("no mpirun on PATH")
    argv = local_mpirun_prefix(3)
    assert argv[0] == "mpirun" and argv[1:3] == ["-np", "3"]


def test_cli_no_mpi_found(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    code, _, err = cli(capsys, "-np", "2", "true")
    assert code == 2 and "no MPI found: neither mpirun nor mpiexec is on PATH" in err


def test_openmpi_two_nodes_hostfile_passed_as_is():
    hosts = H.parse_hostfile(ROOT / "hostfiles" / "two_nodes")
    r = L.Request(command=LAUNCH_CMD, hosts=hosts, hostfile="hostfiles/two_nodes", np=8)
    p = L.plan_mpirun(r, "openmpi4", "mpirun", {"PSRT_TRACE": "1", "PYTHONPATH": "/x"}, 2,
                      dry_run=True)
    assert list(p.argv) == ["mpirun", *root_flag(), "-np", "8", "--hostfile",
                            "hostfiles/two_nodes", "-x", f"PYTHONPATH={ROOT}:/x",
                            "-x", "OMP_NUM_THREADS=1", "-x", "PSRT_TRACE", *LAUNCH_CMD]
    assert p.ranks_per_host == (("node0", 4), ("node1", 4))
    # node0/node1 do not resolve on a test machine: a dry run only warns.
    assert all("a real run would stop: unknown host" in n for n in p.notes)


def test_mpich_hostfile_passed_to_mpich_and_converted_for_openmpi(tmp_path):
    path = write_hostfile(tmp_path, "localhost:2\n")
    hosts = H.parse_hostfile(path)
    r = L.Request(command=LAUNCH_CMD, hosts=hosts, hostfile=str(path), np=2)
    assert L.plan_mpirun(r, "mpich", "mpiexec", {}, 2).argv[3:5] == ("-f", str(path))
    assert L.plan_mpirun(r, "openmpi4", "mpirun", {}, 2).argv[len(root_flag()) + 3:][:2] == \
        ("--host", "localhost:2")


def test_local_run_has_no_host_arguments_and_crowding_flags():
    p = plan("localhost", 4, cores=2)
    assert list(p.argv) == ["mpirun", *root_flag(), "-np", "4", "--oversubscribe",
                            "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1",
                            "-x", f"PYTHONPATH={ROOT}", "-x", "OMP_NUM_THREADS=1", *LAUNCH_CMD]
    # Fits the cores: the MPI's own binding, no yielding, no oversubscription.
    assert list(plan("localhost", 2, cores=2).argv) == [
        "mpirun", *root_flag(), "-np", "2", "-x", f"PYTHONPATH={ROOT}",
        "-x", "OMP_NUM_THREADS=1", *LAUNCH_CMD]


def _yield_flag(p) -> str | None:
    argv = list(p.argv)
    return argv[argv.index("mpi_yield_when_idle") + 1] if "mpi_yield_when_idle" in argv else None


@pytest.mark.parametrize("np_,env,extra,flag", [
    (4, {}, (), "1"),                                          # crowded: yield
    (2, {}, (), None),                                         # fits: MPI's default
    (4, {"PSRT_YIELD": "0"}, (), "0"),                         # PSRT_YIELD decides, both ways
    (2, {"PSRT_YIELD": "1"}, (), "1"),
    (4, {"OMPI_MCA_mpi_yield_when_idle": "0"}, (), None),      # the user's variable is kept
    (4, {}, ("--mca", "mpi_yield_when_idle", "0"), "0"),       # so is the user's flag, once
    (4, {"PSRT_YIELD": "1"}, ("--mca", "mpi_yield_when_idle", "0"), "0"),
])
def test_yielding_follows_psrt_yield_then_the_user_then_crowding(np_, env, extra, flag):
    p = plan("localhost", np_, env=env, cores=2, extra=extra)
    assert _yield_flag(p) == flag and p.argv.count("mpi_yield_when_idle") == (flag is not None)


def test_cli_emulated_dry_run_shows_the_cluster_and_the_agent(capsys):
    code, out, _ = cli(capsys, "--dry-run", "--emulate", "--flavour", "openmpi4", "--hostfile",
                       str(ROOT / "hostfiles" / "two_nodes"), "-np", "8", "python", "-m",
                       "psrt.info")
    first, command = out.splitlines()
    assert code == 0 and first.startswith("# emulated cluster: node0 (198.18.0.1), node1")
    agent = str(ROOT / "scripts" / "netns_agent")
    assert command.startswith(f"{agent} node0 mpirun ")
    for flag in (f"--mca plm_rsh_agent {agent}", "--mca btl self,vader,tcp",
                 "--mca btl_tcp_if_include 198.18.0.0/24", "--mca mpi_yield_when_idle 1",
                 "--bind-to none"):
        assert flag in command
    assert command.count("mpi_yield_when_idle") == 1


def test_cli_emulated_dry_run_for_mpich(capsys, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)     # else it is kept, not set to 1
    code, out, _ = cli(capsys, "--dry-run", "--emulate", "--flavour", "mpich", "--hosts",
                       "n0:2,n1:2", "python", "x.py")
    agent = str(ROOT / "scripts" / "netns_agent")
    assert code == 0 and out.splitlines()[1] == (
        f"{agent} n0 mpiexec -n 4 -hosts n0:2,n1:2 -launcher ssh -launcher-exec {agent} "
        "-iface eth0 -genv UCX_TLS tcp,self -genv UCX_NET_DEVICES eth0 -genv FI_PROVIDER tcp "
        f"-bind-to none -genv PYTHONPATH {ROOT} -genv OMP_NUM_THREADS 1 python x.py")


def test_only_open_mpis_non_zero_exit_notices_are_dropped():
    rule = "-" * 74 + "\n"
    exit_notice = [rule, "Primary job  terminated normally, but 1 process returned\n",
                   "a non-zero exit code. Per user-direction, the job has been aborted.\n", rule,
                   rule, "mpirun detected that one or more processes exited with non-zero status, thus causing\n",
                   "  Exit code:    2\n", rule]
    killed = [rule, "mpirun noticed that process rank 1 with PID 7 on node vm exited on signal 9 (Killed).\n", rule]
    out = []
    drop_exit_banners(["[rank 0] psrt.train: error: --batch-size 3 ...\n"] + exit_notice + killed + ["tail\n"],
                      out.append)
    assert "".join(out) == "[rank 0] psrt.train: error: --batch-size 3 ...\n" + "".join(killed) + "tail\n"


def test_in_job_recovery_turns_ulfm_on_under_open_mpi_5_and_is_refused_elsewhere():
    p = L.plan_mpirun(req("localhost:2", 2, in_job=True), "openmpi5", "mpirun", {}, 2)
    at = p.argv.index("--with-ft")
    assert p.argv[at:at + 5] == ("--with-ft", "ulfm", "--mca", "btl", "tcp,self")
    assert p.env["PSRT_IN_JOB_RECOVERY"] == "1"
    # a TCP path the user (or the emulated cluster) already chose is kept
    kept = L.plan_mpirun(req("localhost:2", 2, in_job=True, extra=("--mca", "btl", "self,tcp")), "openmpi5",
                         "mpirun", {}, 2)
    assert kept.argv.count("--mca") == p.argv.count("--mca") and "self,tcp" in kept.argv
    # ULFM's heartbeats find a lost host, within half the watchdog's silence limit (at most 10 s)
    flags = " ".join(p.argv)
    assert ("--mca mpi_ft_detector true --mca mpi_ft_detector_thread true --mca mpi_ft_detector_timeout 10 "
            "--mca mpi_ft_detector_period 3.33" in flags)
    short = " ".join(L.plan_mpirun(req("localhost:2", 2, in_job=True), "openmpi5", "mpirun",
                                   {"PSRT_TIMEOUT": "8"}, 2).argv)
    assert "mpi_ft_detector_timeout 4 --mca mpi_ft_detector_period 1.33" in short
    own = L.plan_mpirun(req("localhost:2", 2, in_job=True, extra=("--mca", "mpi_ft_detector_timeout", "2")),
                        "openmpi5", "mpirun", {}, 2).argv
    assert own.count("mpi_ft_detector_timeout") == 1 and "mpi_ft_detector_period" in own
    for flavour in ("openmpi4", "mpich"):
        with pytest.raises(PsrtError) as err:
            L.plan_mpirun(req("localhost:2", 2, in_job=True), flavour, "mpirun", {}, 2)
        assert "no ULFM" in str(err.value) and "--restarts" in str(err.value) and "\n" not in str(err.value)
