"""mpi_launch --emulate: jobs on emulated hosts (root), their command lines and clean-up."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from psrt.launch import hostfile as H
from psrt.launch import plan as L
from psrt.launch.__main__ import main as launch_main

ROOT = Path(__file__).resolve().parents[2]
CMD = ("python", "-m", "psrt.info")
NOWHERE = "psrt-no-such-host.invalid"  # .invalid never resolves (RFC 6761)


def req(hosts, np_=None, **kw):
    if isinstance(hosts, str):
        hosts = H.parse_hosts(hosts)
    return L.Request(command=CMD, hosts=hosts, np=np_, **kw)


def hostfile(tmp_path, text, name="hosts"):
    path = tmp_path / name
    path.write_text(text)
    return path


# --- hostfiles ------------------------------------------------------------------------------


# --- placement --------------------------------------------------------------------------------

TWO = "node0:4,node1:4"


# --- command lines ----------------------------------------------------------------------------

def plan(hosts, np_=None, flavour="openmpi4", env=None, cores=2, **kw):
    hostfile_ = kw.pop("hostfile", None)
    r = req(hosts, np_, hostfile=hostfile_, **kw)
    return L.plan_mpirun(r, flavour, "mpirun", env or {}, cores)


def root_flag():
    return ["--allow-run-as-root"] if os.geteuid() == 0 else []


def test_openmpi_two_nodes_hostfile_passed_as_is():
    hosts = H.parse_hostfile(ROOT / "hostfiles" / "two_nodes")
    r = L.Request(command=CMD, hosts=hosts, hostfile="hostfiles/two_nodes", np=8)
    p = L.plan_mpirun(r, "openmpi4", "mpirun", {"PSRT_TRACE": "1", "PYTHONPATH": "/x"}, 2,
                      dry_run=True)
    assert list(p.argv) == ["mpirun", *root_flag(), "-np", "8", "--hostfile",
                            "hostfiles/two_nodes", "-x", f"PYTHONPATH={ROOT}:/x",
                            "-x", "OMP_NUM_THREADS=1", "-x", "PSRT_TRACE", *CMD]
    assert p.ranks_per_host == (("node0", 4), ("node1", 4))
    # node0/node1 do not resolve on a test machine: a dry run only warns.
    assert all("a real run would stop: unknown host" in n for n in p.notes)


def test_mpich_hostfile_passed_to_mpich_and_converted_for_openmpi(tmp_path):
    path = hostfile(tmp_path, "localhost:2\n")
    hosts = H.parse_hostfile(path)
    r = L.Request(command=CMD, hosts=hosts, hostfile=str(path), np=2)
    assert L.plan_mpirun(r, "mpich", "mpiexec", {}, 2).argv[3:5] == ("-f", str(path))
    assert L.plan_mpirun(r, "openmpi4", "mpirun", {}, 2).argv[len(root_flag()) + 3:][:2] == \
        ("--host", "localhost:2")


def test_local_run_has_no_host_arguments_and_crowding_flags():
    p = plan("localhost", 4, cores=2)
    assert list(p.argv) == ["mpirun", *root_flag(), "-np", "4", "--oversubscribe",
                            "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1",
                            "-x", f"PYTHONPATH={ROOT}", "-x", "OMP_NUM_THREADS=1", *CMD]
    # Fits the cores: the MPI's own binding, no yielding, no oversubscription.
    assert list(plan("localhost", 2, cores=2).argv) == [
        "mpirun", *root_flag(), "-np", "2", "-x", f"PYTHONPATH={ROOT}",
        "-x", "OMP_NUM_THREADS=1", *CMD]


# --- the CLI ----------------------------------------------------------------------------------

def cli(capsys, *args):
    """Run mpi_launch's main in this process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as done:
        sys.exit(launch_main(list(args)))
    out = capsys.readouterr()
    return done.value.code, out.out, out.err


needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun on PATH")


@needs_mpirun
def test_cli_dry_run_prints_the_command(capsys, monkeypatch):
    for k in list(os.environ):
        if k.startswith("PSRT_") or k in ("OMP_NUM_THREADS", "PYTHONPATH"):
            monkeypatch.delenv(k)
    code, out, err = cli(capsys, "--dry-run", "-np", "2", "python", "-m", "psrt.info", "--json")
    threads = max(1, (os.cpu_count() or 1) // 2)
    assert code == 0 and out.count("\n") == 1
    assert out.startswith(" ".join([shutil.which("mpirun"), *root_flag(), "-np", "2"]))
    assert out.rstrip().endswith(f"-x PYTHONPATH={ROOT} -x OMP_NUM_THREADS={threads} "
                                 "python -m psrt.info --json")


def test_cli_emulated_dry_run_shows_the_cluster_and_the_agent(capsys):
    code, out, _ = cli(capsys, "--dry-run", "--emulate", "--flavour", "openmpi4", "--hostfile",
                       str(ROOT / "hostfiles" / "two_nodes"), "-np", "8", "python", "-m",
                       "psrt.info")
    first, command = out.splitlines()
    assert code == 0 and first.startswith("# emulated cluster: node0 (198.18.0.1), node1")
    agent = str(ROOT / "scripts" / "netns_agent")
    assert command.startswith(f"{agent} node0 mpirun ")
    for flag in (f"--mca plm_rsh_agent {agent}", "--mca btl self,tcp",
                 "--mca btl_tcp_if_include 198.18.0.0/24", "--mca mpi_yield_when_idle 1",
                 "--bind-to none"):
        assert flag in command
    assert command.count("mpi_yield_when_idle") == 1


def test_cli_emulated_dry_run_for_mpich(capsys):
    code, out, _ = cli(capsys, "--dry-run", "--emulate", "--flavour", "mpich", "--hosts",
                       "n0:2,n1:2", "python", "x.py")
    agent = str(ROOT / "scripts" / "netns_agent")
    assert code == 0 and out.splitlines()[1] == (
        f"{agent} n0 mpiexec -n 4 -hosts n0:2,n1:2 -launcher ssh -launcher-exec {agent} "
        "-iface eth0 -genv UCX_TLS tcp,self -genv UCX_NET_DEVICES eth0 -genv FI_PROVIDER tcp "
        f"-bind-to none -genv PYTHONPATH {ROOT} -genv OMP_NUM_THREADS 1 python x.py")


@needs_mpirun
@pytest.mark.parametrize("args,message", [
    (["-np", "0", "true"], "-np 0: a job needs at least one rank"),
    (["--hosts", "a:2,b:2", "-np", "5", "true"], "-np 5 but --hosts offers 4 slots (a 2, b 2)"),
    (["--hosts", f"localhost:1,{NOWHERE}:1", "-np", "2", "true"], f"unknown host '{NOWHERE}'"),
    (["--emulate", "-np", "2", "true"], "an emulated cluster needs at least 2 hosts"),
    (["--rate", "1gbit", "-np", "1", "true"], "--rate, --delay and --subnet shape the emulated"),
    (["-np", "2"], "no command given"),
    (["--launcher", "srun", "--hostfile", str(ROOT / "hostfiles" / "two_nodes"), "true"],
     "srun places ranks on the Slurm allocation's nodes"),
])
def test_cli_bad_input_is_one_line_and_exit_2(capsys, args, message):
    code, out, err = cli(capsys, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("mpi_launch: error: ") and message in err








