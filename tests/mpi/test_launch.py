"""mpi_launch and psrt.launch.plan: hostfiles, placement, and the exact launcher command lines.

Command lines are built by pure functions (flavour, environment, core count passed in), so
Open MPI 5, MPICH and srun are checked here although only Open MPI 4 is installed.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from psrt.launch import hostfile as H
from psrt.launch import plan as L
from psrt.launch.__main__ import main as launch_main
from psrt.launch.mpi import local_mpirun_prefix
from psrt.errors import PsrtError

ROOT = Path(__file__).resolve().parents[2]
CMD = ("python", "-m", "psrt.info")
NOWHERE = "psrt-no-such-host.invalid"  # .invalid never resolves (RFC 6761)


def req(hosts, np_=None, **kw):
    if isinstance(hosts, str):
        hosts = H.parse_hosts(hosts)
    return L.Request(command=CMD, hosts=hosts, np=np_, **kw)


# --- hostfiles ------------------------------------------------------------------------------


# --- placement --------------------------------------------------------------------------------

TWO = "node0:4,node1:4"


@pytest.mark.parametrize("np_,ranks", [
    (8, (("node0", 4), ("node1", 4))),
    (6, (("node0", 4), ("node1", 2))),
    (3, (("node0", 3),)),
    (None, (("node0", 4), ("node1", 4))),  # one rank per slot, like mpirun
])
def test_ranks_fill_hosts_in_order(np_, ranks):
    assert L.place(req(TWO, np_), cores=2).ranks == ranks


# --- command lines ----------------------------------------------------------------------------

def plan(hosts, np_=None, flavour="openmpi4", env=None, cores=2, **kw):
    hostfile_ = kw.pop("hostfile", None)
    r = req(hosts, np_, hostfile=hostfile_, **kw)
    return L.plan_mpirun(r, flavour, "mpirun", env or {}, cores)


def test_mpich_gets_a_converted_host_list_and_genv():
    hosts = H.parse_hostfile(ROOT / "hostfiles" / "two_nodes")
    r = L.Request(command=CMD, hosts=hosts, hostfile="hostfiles/two_nodes", np=8)
    p = L.plan_mpirun(r, "mpich", "mpiexec", {"PSRT_X": "1"}, 2, dry_run=True)
    assert list(p.argv) == ["mpiexec", "-n", "8", "-hosts", "node0:4,node1:4",
                            "-genv", "PYTHONPATH", str(ROOT), "-genv", "OMP_NUM_THREADS", "1",
                            "-genvlist", "PSRT_X", *CMD]


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
    assert argv[0] == shutil.which("mpirun") and argv[1:3] == ["-np", "3"]


# --- the CLI ----------------------------------------------------------------------------------

def cli(capsys, *args):
    """Run mpi_launch's main in this process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as done:
        sys.exit(launch_main(list(args)))
    out = capsys.readouterr()
    return done.value.code, out.out, out.err


needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun on PATH")


def test_cli_no_mpi_found(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    code, _, err = cli(capsys, "-np", "2", "true")
    assert code == 2 and "no MPI found: neither mpirun nor mpiexec is on PATH" in err


@needs_mpirun
@pytest.mark.mpi
def test_mpi_launch_script_runs_ranks_and_errors_without_traceback(tmp_path):
    """The real script, end to end: two ranks report their world; bad input is one line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "SLURM_"))}
    env.pop("OMP_NUM_THREADS", None)
    out = subprocess.run([sys.executable, str(ROOT / "mpi_launch"), "-np", "2", "python", "-m",
                          "psrt.info", "--json", "--allreduce", "64KiB", "--iters", "1"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    recs = sorted((json.loads(l.split(" ", 1)[1]) for l in out.stdout.splitlines()
                   if l.startswith("PSRT-RESULT ")), key=lambda r: r["rank"])
    assert [(r["rank"], r["size"], r["local_rank"], r["num_nodes"], r["launcher"])
            for r in recs] == [(0, 2, 0, 1, "openmpi"), (1, 2, 1, 1, "openmpi")]
    assert all(r["allreduce_bytes"] == 65536 for r in recs)
    bad = subprocess.run([sys.executable, str(ROOT / "mpi_launch"), "-np", "0", "true"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr == "mpi_launch: error: -np 0: a job needs at least one rank\n"
