"""The emulated cluster's pure parts: host names, subnets, rates and the MPI settings it
hands to mpirun (no namespaces are made here)."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from psrt.errors import PsrtError
from psrt.launch import cluster as C

# --- without root -----------------------------------------------------------------------------

@pytest.mark.parametrize("kw,says", [
    (dict(hosts=("a",)), "needs at least 2 hosts"),
    (dict(hosts=("a", "a")), "repeat a name"),
    (dict(hosts=("a", "b_c")), "emulated host 'b_c'"),
    (dict(hosts=("a", "localhost")), "emulated host 'localhost'"),
    (dict(hosts=("a", "b"), subnet="10.0.0.0/24"), "must lie inside 198.18.0.0/15"),
    (dict(hosts=("a", "b"), subnet="198.20.0.0/24"), "must lie inside 198.18.0.0/15"),
    (dict(hosts=("a", "b"), subnet="198.18.0.0/31"), "too small for 2 hosts"),
    (dict(hosts=("a", "b"), subnet="nonsense"), "not a network"),
    (dict(hosts=("a", "b"), rate="fast"), "--rate 'fast'"),
    (dict(hosts=("a", "b"), delay="1 ms"), "--delay '1 ms'"),
])
def test_cluster_validation(kw, says):
    with pytest.raises(PsrtError, match=says):
        C.Cluster(**kw)


def test_layout_addresses_and_names():
    two = C.Cluster(("node0", "node1"))
    assert two.switch is None and two.namespaces == ("node0", "node1")
    assert [two.address(h) for h in two.hosts] == ["198.18.0.1", "198.18.0.2"]
    three = C.Cluster(("a", "b", "c"), "198.19.4.0/24")
    assert three.namespaces == ("a", "b", "c", "a-sw") and three.address("c") == "198.19.4.3"
    assert C._hosts_file(three).splitlines()[2:] == ["198.19.4.1 a", "198.19.4.2 b",
                                                     "198.19.4.3 c"]


def test_mpi_settings_for_open_mpi_4_and_5():
    c = C.Cluster(("a", "b"), "198.18.3.0/24")
    agent = str(C.AGENT)
    assert C.mpi_flags(c, "openmpi4") == [
        "--mca", "plm_rsh_agent", agent, "--mca", "plm_rsh_no_tree_spawn", "1",
        "--mca", "pml", "ob1", "--mca", "btl", "self,vader,tcp",
        "--mca", "btl_tcp_if_include", "198.18.3.0/24",
        "--mca", "btl_tcp_flags", "send,inplace,need-ack,need-csum,hetero-rdma",
        "--mca", "oob_tcp_if_include", "198.18.3.0/24"]
    five = C.mpi_flags(c, "openmpi5")
    assert five[:6] == ["--prtemca", "plm_ssh_agent", agent,
                        "--prtemca", "plm_ssh_no_tree_spawn", "1"]
    assert ["--prtemca", "oob_tcp_if_include", "198.18.3.0/24"] == five[18:21]
    env = C.mpi_env(c, "openmpi5")
    assert env["PRTE_MCA_plm_ssh_agent"] == agent and env["OMPI_MCA_btl"] == "self,sm,tcp"
    assert env["OMPI_MCA_pml"] == "ob1" and env["PRTE_MCA_oob_tcp_if_include"] == c.subnet


@pytest.mark.parametrize("given,ranks_get", [
    ({}, "1"),                                            # the hosts share this machine's cores
    ({"PSRT_YIELD": "0"}, "0"),                           # busy-poll, said explicitly
    ({"OMPI_MCA_mpi_yield_when_idle": "0"}, "0"),          # the user's own setting is kept
    ({"OMPI_MCA_mpi_yield_when_idle": "0", "PSRT_YIELD": "1"}, "1"),   # PSRT_YIELD wins
])
def test_job_env_yields_unless_told_otherwise(given, ranks_get):
    c = C.Cluster(("a", "b"), slurm=True)     # what srun's tasks inherit, too
    assert C.job_env(c, "openmpi4", given)["OMPI_MCA_mpi_yield_when_idle"] == ranks_get
    assert "OMPI_MCA_mpi_yield_when_idle" not in C.job_env(c, "mpich", {"PSRT_YIELD": "0"})


def test_mpi_settings_for_mpich():
    c = C.Cluster(("a", "b"))
    agent = str(C.AGENT)
    assert C.mpi_flags(c, "mpich") == [
        "-launcher", "ssh", "-launcher-exec", agent, "-iface", "eth0",
        "-genv", "UCX_TLS", "tcp,self", "-genv", "UCX_NET_DEVICES", "eth0",
        "-genv", "FI_PROVIDER", "tcp"]
    assert C.mpi_env(c, "mpich") == {
        "HYDRA_LAUNCHER": "ssh", "HYDRA_LAUNCHER_EXEC": agent, "HYDRA_IFACE": "eth0",
        "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0", "FI_PROVIDER": "tcp"}
    with pytest.raises(PsrtError, match="drives Open MPI and MPICH, not unknown"):
        C.mpi_flags(c, "unknown")


def test_agent_argv_quotes_for_the_remote_shell():
    assert C.exec_argv("a", ["echo", "two words", "x;y"]) == [
        str(C.AGENT), "a", "echo", "'two words'", "'x;y'"]
    assert os.access(C.AGENT, os.X_OK)


@pytest.mark.parametrize("rate,bytes_per_s", [("1gbit", 125e6), ("100mbit", 12.5e6),
                                              ("10mbps", 10e6), ("800kbit", 1e5)])
def test_rate_units(rate, bytes_per_s):
    assert C.rate_bytes(rate) == bytes_per_s




def test_a_signal_during_down_waits_until_the_cleanup_is_done(monkeypatch, tmp_path):
    """SIGTERM (or Ctrl-C) while `down` runs is held until every step is done, then handled."""
    done = []

    def stop_processes(present):
        os.kill(os.getpid(), signal.SIGTERM)      # arrives mid-cleanup
        time.sleep(0.2)                            # Python runs handlers between bytecodes
        done.append("processes")

    monkeypatch.setattr(C, "existing_namespaces", lambda: {"a", "b"})
    monkeypatch.setattr(C, "_stop_processes", stop_processes)
    monkeypatch.setattr(C.slurm, "stop", lambda cluster: done.append("slurm"))
    monkeypatch.setattr(C, "_run", lambda argv, what, check=True:
                        done.append(argv[-1]) or subprocess.CompletedProcess(argv, 0))
    monkeypatch.setattr(C, "NETNS_ETC", tmp_path / "netns")
    monkeypatch.setattr(C, "STATE_DIR", tmp_path / "state")

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        with pytest.raises(SystemExit) as stopped:
            C.down(C.Cluster(("a", "b")))
    finally:
        signal.signal(signal.SIGTERM, old)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert done == ["processes", "slurm", "a", "b"]


def test_commands_on_the_cluster_find_the_agent_as_ssh():
    """horovodrun and anything else that reaches a host by `ssh HOST CMD` go through the agent."""
    env = C.job_env(C.Cluster(("a", "b")), "openmpi4", {"PATH": "/usr/bin:/bin"})
    assert env["PATH"] == f"{C.SSH_DIR}:/usr/bin:/bin"
    assert (C.SSH_DIR / "ssh").resolve() == C.AGENT.resolve() and os.access(C.SSH_DIR / "ssh", os.X_OK)


def test_the_agent_takes_ssh_options_and_their_values_before_the_host(tmp_path):
    """As horovodrun calls ssh: `-o KEY=VALUE` and `-p PORT`, before the host and after it, are
    skipped with their values (a stand-in `ip` prints what the agent would run, and says the
    host's link is up when asked)."""
    (tmp_path / "ip").write_text('#!/bin/sh\n[ "$1" = -n ] && { echo "2: eth0@if3: <BROADCAST,UP,LOWER_UP> mtu 1500"; exit; }\n'
                                 'echo "$@"\n')
    (tmp_path / "ip").chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    out = subprocess.run([str(C.SSH_DIR / "ssh"), "-o", "PasswordAuthentication=no", "-o",
                          "StrictHostKeyChecking=no", "-x", "node1", "-p", "22", "-o", "ConnectTimeout=10",
                          "date", "-u"], env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out[:3] == ["netns", "exec", "node1"] and out[-3:] == ["node1", "date", "-u"]
    plain = subprocess.run([str(C.AGENT), "node1", "true"], env=env, capture_output=True, text=True)
    assert plain.stdout.split()[:3] == ["netns", "exec", "node1"] and plain.stdout.split()[-1] == "true"
    bad = subprocess.run([str(C.AGENT), "-o", "X=1", "node1"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "usage: netns_agent" in bad.stderr
    # a host whose link is down (python -m psrt.cluster fail) answers as a lost machine would
    (tmp_path / "ip").write_text('#!/bin/sh\n[ "$1" = -n ] && { echo "2: eth0@if3: <BROADCAST,MULTICAST> mtu 1500 state DOWN"; exit; }\n'
                                 'echo "$@"\n')
    lost = subprocess.run([str(C.AGENT), "node1", "true"], env=env, capture_output=True, text=True)
    assert lost.returncode == 255 and "No route to host" in lost.stderr and not lost.stdout


def test_a_failed_host_is_unreachable_before_its_processes_die(monkeypatch):
    """`fail` takes the link down before it kills: the kill ends the job at once, and the
    restart's probe that follows must already find the host gone (a probe between the two
    found it answering, and the restart tried it again)."""
    done = []
    monkeypatch.setattr(C, "_run", lambda argv, what, check=True: done.append(" ".join(argv)) or
                        subprocess.CompletedProcess(argv, 0, stdout="4242\n", stderr=""))
    monkeypatch.setattr(C, "kill", lambda pids: done.append(f"kill {sorted(pids)}"))
    C.fail("node1")
    assert done.index(f"ip -n node1 link set {C.IFACE} down") < done.index("kill [4242]"), done


def test_the_delay_lines_delay_reads_tc_syntax():
    from psrt.launch.delay_line import delay_ns
    assert delay_ns("500us") == 500_000 and delay_ns("2ms") == 2_000_000 and delay_ns("0.2s") == 200_000_000
    with pytest.raises(ValueError, match="--delay '2x'"):
        delay_ns("2x")


def test_a_delay_puts_even_two_hosts_behind_a_switch():
    """The delay line sits between the hosts, so a delay gives two hosts a switch namespace
    too (netem's hosts pass a bridge there, as three hosts do)."""
    assert C.Cluster(("a", "b"), delay="1ms").switch == "a-sw"
    assert "delay 1ms" in C.Cluster(("a", "b"), delay="1ms").describe()[0]


def test_a_delay_is_dilated_with_the_compute():
    from psrt.bench.scaling import Scale, stands_for
    line = stands_for("250mbit", "resnet50", Scale(32, 3.125), "1ms")
    assert "one-way delay 1ms, which stands for 320 us there" in line
    assert "which stands for 1.6 ms there" in stands_for("250mbit", "resnet50", Scale(32, 3.125), "5ms")
    assert "latency not dilated" in stands_for("250mbit", "resnet50", Scale(32, 3.125))
