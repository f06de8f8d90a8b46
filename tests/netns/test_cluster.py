"""The emulated cluster (psrt.cluster): hosts as network namespaces, MPI across their links.

Tests marked `netns` need root and `ip netns`; each uses host names and a 198.19.x.0/24
subnet of its own, and removes everything it made, also when it fails.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from conftest import PYTHON, interruptible
from psrt.errors import PsrtError
from psrt.launch import cluster as C
from psrt.launch import cluster_cli as CLI
from psrt.launch.hostfile import parse_hosts
from psrt.launch.plan import Request, plan_mpirun

ROOT = Path(__file__).resolve().parents[2]


def _netns_missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "needs `ip` (iproute2) and `unshare` (util-linux)"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` does not work here"
    return None


_MISSING = _netns_missing()


def netns(test):
    """Mark a test `netns` and skip it, saying why, where namespaces cannot be made."""
    return pytest.mark.netns(pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))(test))


needs_openmpi = pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun on PATH")


@pytest.fixture
def names(request):
    """make(n) -> (host names, subnet) unique to this test and process; whatever was made
    with them is removed at the end, pass or fail."""
    tag = zlib.crc32(f"{os.getpid()}:{request.node.nodeid}".encode())
    made = []

    def make(n: int):
        hosts = tuple(f"t{tag % 10**7:07d}{chr(97 + len(made))}{i}" for i in range(n))
        subnet = f"198.19.{(tag + len(made)) % 256}.0/24"
        made.append(C.Cluster(hosts, subnet))
        return hosts, subnet

    yield make
    if _MISSING is None:
        for cluster in made:
            C.down(cluster)


def namespaces() -> set[str]:
    return C.existing_namespaces()


def assert_gone(cluster: C.Cluster):
    """No namespace, hosts file, record or mount of the cluster's is left."""
    assert not set(cluster.namespaces) & namespaces()
    assert not any((C.NETNS_ETC / h).exists() for h in cluster.hosts)
    assert not C._state_path(cluster.hosts[0]).exists()
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    ours = [p for p in points if p in {f"/run/netns/{ns}" for ns in cluster.namespaces}
            or p.startswith(f"/run/psrt-slurm/{cluster.hosts[0]}")]
    assert not ours, ours


# --- without root -----------------------------------------------------------------------------


def test_refuses_without_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(PsrtError, match="the emulated cluster needs root"):
        C.require_netns()


# --- with namespaces --------------------------------------------------------------------------

def rank_records(stdout: str) -> list[dict]:
    return sorted((json.loads(l.split(" ", 1)[1]) for l in stdout.splitlines()
                   if l.startswith("PSRT-RESULT ")), key=lambda r: r["rank"])


@netns
@pytest.mark.mpi
@needs_openmpi
def test_two_hosts_mpirun_hostfile(names, tmp_path):
    """The acceptance run, at half size to spare the CPU: plain `mpirun -np 4 -hostfile FILE`
    on the emulated pair puts ranks 0-1 on the first host and 2-3 on the second (docs/
    launching.md shows the full -np 8), and the allreduce's bytes cross the veth."""
    hosts, subnet = names(2)
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{hosts[0]} slots=2\n{hosts[1]} slots=2\n")
    nbytes, iters = 1 << 20, 1
    cluster = C.Cluster(hosts, subnet)
    # Pin Open MPI's ring allreduce (tuned algorithm 4) so the bytes it must send across
    # the cut between the hosts are known: 2(n-1)/n of the buffer in each direction.
    env = C.job_env(cluster, "openmpi4", os.environ)
    env.update(OMPI_MCA_coll_tuned_use_dynamic_rules="1", OMPI_MCA_coll_tuned_allreduce_algorithm="4",
               OMP_NUM_THREADS="1")
    argv = ["mpirun", "-np", "4", "-hostfile", str(hostfile), sys.executable, "-m", "psrt.info",
            "--json", "--allreduce", str(nbytes), "--iters", str(iters)]
    with C.running(cluster):
        before = {h: C.link_bytes(h) for h in hosts}
        out = subprocess.run(C.exec_argv(hosts[0], argv), env=env, capture_output=True,
                             text=True, timeout=400, stdin=subprocess.DEVNULL)
        after = {h: C.link_bytes(h) for h in hosts}
    assert_gone(cluster)
    assert out.returncode == 0, out.stderr[-3000:]
    recs = rank_records(out.stdout)
    assert [r["rank"] for r in recs] == list(range(4))
    assert [r["hostname"] for r in recs] == [hosts[0]] * 2 + [hosts[1]] * 2
    assert [(r["node_rank"], r["local_rank"], r["local_size"], r["num_nodes"]) for r in recs] == \
        [(r // 2, r % 2, 2, 2) for r in range(4)]
    assert all(r["launcher"] == "openmpi" and r["size"] == 4 for r in recs)
    # Warm-up plus timed runs; each direction of the cut carries 2(n-1)/n * nbytes per run
    # (reduce-scatter and allgather), plus a little startup traffic and packet headers.
    n = len(recs)
    need = (1 + iters) * 2 * (n - 1) / n * nbytes
    sent = {h: after[h][0] - before[h][0] for h in hosts}
    received = {h: after[h][1] - before[h][1] for h in hosts}
    for h in hosts:
        assert need <= sent[h] <= 1.1 * need + (1 << 20), (h, sent[h], need)
    assert sent[hosts[0]] == received[hosts[1]] and sent[hosts[1]] == received[hosts[0]]


@netns
@pytest.mark.mpi
@needs_openmpi
def test_three_hosts_on_a_bridge_with_mpi_launch_flags(names):
    """More than two hosts meet on a bridge; mpi_launch --emulate's flags drive it."""
    hosts, subnet = names(3)
    cluster = C.Cluster(hosts, subnet)
    req = Request(command=(sys.executable, "-m", "psrt.info", "--json", "--allreduce", "4KiB"),
                  hosts=parse_hosts(",".join(f"{h}:1" for h in hosts)), emulated=True)
    plan = plan_mpirun(req, "openmpi4", "mpirun", {}, os.cpu_count() or 1,
                       emulation=C.mpi_flags(cluster, "openmpi4"))
    with C.running(cluster):
        assert set(cluster.namespaces) <= namespaces()
        out = subprocess.run(C.exec_argv(hosts[0], plan.argv), env={**os.environ, **plan.env},
                             capture_output=True, text=True, timeout=400,
                             stdin=subprocess.DEVNULL)
    assert_gone(cluster)
    assert out.returncode == 0, out.stderr[-3000:]
    recs = rank_records(out.stdout)
    assert [(r["hostname"], r["node_rank"], r["num_nodes"]) for r in recs] == \
        [(h, i, 3) for i, h in enumerate(hosts)]


# Two ranks exchange 6 MiB both ways at once, back to back (MPI_Sendrecv, as each step of
# the MPI library's Rabenseifner all-reduce); rank 0 prints each exchange's seconds.
_EXCHANGE = """
import json, time
import numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
other = 1 - comm.rank
send, recv = np.ones(3 << 19, np.float32), np.empty(3 << 19, np.float32)
times = []
for i in range(10):
    t = time.perf_counter()
    comm.Sendrecv(send, other, 0, recv, other, 0)
    times.append(time.perf_counter() - t)
if comm.rank == 0:
    print("EXCHANGES", json.dumps(times[2:]))
"""


@netns
@pytest.mark.mpi
@needs_openmpi
def test_a_two_way_exchange_runs_both_ways_at_once(names):
    """The links are full duplex: a two-way exchange of M bytes takes M / rate, not up to
    twice it.  With the TCP BTL's put protocol (Open MPI's default), the go-ahead for one
    direction's data waited behind the other's whole message, and most of these exchanges
    took 1.6-2.5x it (psrt/launch/emulated_mpi.py, btl_tcp_flags)."""
    hosts, subnet = names(2)
    cluster = C.Cluster(hosts, subnet, "250mbit")
    req = Request(command=(sys.executable, "-c", _EXCHANGE), hosts=parse_hosts(",".join(f"{h}:1" for h in hosts)),
                  emulated=True)
    plan = plan_mpirun(req, "openmpi4", "mpirun", {}, os.cpu_count() or 1,
                       emulation=C.mpi_flags(cluster, "openmpi4"))
    with C.running(cluster):
        out = subprocess.run(C.exec_argv(hosts[0], plan.argv), env={**os.environ, **plan.env},
                             capture_output=True, text=True, timeout=400, stdin=subprocess.DEVNULL)
    assert_gone(cluster)
    assert out.returncode == 0, out.stderr[-3000:]
    times = json.loads(next(l for l in out.stdout.splitlines() if l.startswith("EXCHANGES ")).split(" ", 1)[1])
    one_way = (6 << 20) / C.rate_bytes("250mbit")
    # the median: a connection's first exchanges can still be growing its TCP window
    assert statistics.median(times) < 1.15 * one_way, (one_way, times)


def _mpich_venv() -> Path | None:
    """MPICH's environment from scripts/with_mpi.sh, if it has been built on this machine."""
    cache = os.environ.get("PSRT_MPI_CACHE") or \
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "psrt"
    venv = Path(cache) / "venv-mpich"
    return venv if (venv / ".psrt-ready").exists() else None


@netns
@pytest.mark.mpi
@pytest.mark.skipif(_mpich_venv() is None,
                    reason="MPICH's environment is not built (bash scripts/with_mpi.sh mpich -- true)")
def test_mpich_on_two_hosts_sends_over_the_link(names):
    """MPICH's UCX layer would use shared memory across the namespaces; the cluster's
    settings must put the allreduce on the veth (bytes >= the buffer, each way, per run)."""
    hosts, subnet = names(2)
    cluster = C.Cluster(hosts, subnet)
    nbytes, runs = 256 << 10, 2  # warm-up and one timed run
    cmd = ["bash", str(ROOT / "scripts" / "with_mpi.sh"), "mpich", "--", "mpiexec", "-hosts",
           f"{hosts[0]}:2,{hosts[1]}:2", "-n", "4", "python", "-m", "psrt.info", "--json",
           "--allreduce", str(nbytes), "--iters", str(runs - 1)]
    with C.running(cluster):
        before = {h: C.link_bytes(h)[0] for h in hosts}
        out = subprocess.run(C.exec_argv(hosts[0], cmd), env=C.job_env(cluster, "mpich", os.environ),
                             capture_output=True, text=True, timeout=400, stdin=subprocess.DEVNULL)
        sent = {h: C.link_bytes(h)[0] - before[h] for h in hosts}
    assert_gone(cluster)
    assert out.returncode == 0, out.stderr[-3000:]
    recs = rank_records(out.stdout)
    assert [(r["hostname"], r["node_rank"], r["local_rank"], r["launcher"]) for r in recs] == \
        [(hosts[r // 2], r // 2, r % 2, "mpich") for r in range(4)]
    # Each host needs the other's whole contribution: at least the buffer, each way, per run.
    assert all(sent[h] >= runs * nbytes for h in hosts), sent


@netns
def test_cleanup_after_an_error_kills_what_runs_inside(names):
    hosts, subnet = names(2)
    cluster = C.Cluster(hosts, subnet)
    with pytest.raises(RuntimeError, match="boom"):
        with C.running(cluster):
            left = subprocess.Popen(C.exec_argv(hosts[1], ["sleep", "60"]))
            # The process itself inside before the error (on a loaded machine the agent can take
            # seconds to enter the namespace, after the cleanup has looked for what runs there).
            # Any pid would not do: the agent's own `ip -n HOST link show`, which checks that
            # the host is up, passes through the namespace first, and the agent could then enter
            # it between the cleanup's look and the namespace's removal.  The agent execs its
            # way to the command (ip netns exec, unshare, sh), so the command keeps its pid.
            deadline = time.monotonic() + 30
            while left.pid not in _pids_inside(hosts[1]) and time.monotonic() < deadline:
                time.sleep(0.05)
            raise RuntimeError("boom")
    assert left.wait(timeout=10) != 0  # ended by the cleanup, not by itself
    assert_gone(cluster)


@netns
def test_signals_take_the_cluster_down(names):
    """Ctrl-C (SIGINT) and SIGTERM on `python -m psrt.cluster run` remove the cluster."""
    runs = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        hosts, subnet = names(2)
        # a fresh interpreter (not the suite's warm python): the signal goes to psrt.cluster itself
        cmd = [PYTHON, "-m", "psrt.cluster", "run", "--hosts", ",".join(hosts),
               "--subnet", subnet, "--", "sleep", "120"]
        runs[sig] = (C.Cluster(hosts, subnet), subprocess.Popen(
            cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE, text=True,
            preexec_fn=interruptible))
    deadline = time.monotonic() + 240
    for sig, (cluster, proc) in runs.items():
        # Wait until the command runs inside the first host, then interrupt.
        while not _pids_inside(cluster.hosts[0]):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the cluster never came up"
            time.sleep(0.2)
        proc.send_signal(sig)
    for sig, (cluster, proc) in runs.items():
        assert proc.wait(timeout=60) == 128 + sig
        assert "Traceback" not in proc.stderr.read()
        assert_gone(cluster)


def _pids_inside(host: str) -> set[int]:
    out = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True)
    return {int(p) for p in out.stdout.split() if p.isdigit()} if out.returncode == 0 else set()


@netns
def test_existing_namespace_is_refused_and_left_alone(names):
    hosts, subnet = names(2)
    subprocess.run(["ip", "netns", "add", hosts[0]], check=True)
    try:
        with pytest.raises(PsrtError, match=f"namespace {hosts[0]} already exists"):
            C.up(C.Cluster(hosts, subnet))
        assert hosts[0] in namespaces() and hosts[1] not in namespaces()
        with pytest.raises(PsrtError, match="already exists"):
            with C.running(C.Cluster(hosts, subnet)):
                pass
        assert hosts[0] in namespaces() and hosts[1] not in namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", hosts[0]])


@netns
@needs_openmpi
def test_cli_up_status_exec_down(names, capfd):
    hosts, subnet = names(2)
    spec = ["--hosts", ",".join(hosts), "--subnet", subnet]
    assert CLI.main(["up", *spec, "--rate", "100mbit"]) == 0
    qdisc = subprocess.run(["tc", "-n", hosts[1], "qdisc", "show", "dev", C.IFACE],
                           capture_output=True, text=True).stdout
    assert "htb" in qdisc and f"bfifo 20: parent 1:20 limit {int(C.rate_bytes('100mbit') * C.QUEUE_MS / 1000)}b" in qdisc
    classes = subprocess.run(["tc", "-n", hosts[1], "class", "show", "dev", C.IFACE],
                             capture_output=True, text=True).stdout
    assert "class htb 1:1 root rate 100Mbit ceil 100Mbit" in classes, classes
    # the hosts' TCP is the cluster's own, not the machine's default (cluster.CONGESTION_CONTROL)
    cc = subprocess.run(["ip", "netns", "exec", hosts[1], "sysctl", "-n", "net.ipv4.tcp_congestion_control"],
                        capture_output=True, text=True).stdout.strip()
    assert cc == C.CONGESTION_CONTROL == "reno"
    assert CLI.main(["status"]) == 0
    assert f"{hosts[0]} ({C.Cluster(hosts, subnet).address(hosts[0])})" in capfd.readouterr().out
    # On a host: its own name, the others' addresses by name, only our link.
    assert CLI.main(["exec", hosts[1], "--", "sh", "-c",
                   f"hostname; getent hosts {hosts[0]}; ls /sys/class/net"]) == 0
    out = capfd.readouterr().out.split()
    assert out[0] == hosts[1] and out[1:3] == [C.Cluster(hosts, subnet).address(hosts[0]), hosts[0]]
    assert sorted(out[3:]) == ["eth0", "lo"]
    # status says each host's state: failed (fail HOST), back (revive HOST), gone (its namespace removed)
    assert CLI.main(["fail", hosts[1]]) == 0
    capfd.readouterr()
    assert CLI.main(["status"]) == 0
    out = capfd.readouterr().out
    assert f"\n  {hosts[0]}: up\n" in out and f"\n  {hosts[1]}: failed (link down; " in out, out
    assert CLI.main(["revive", hosts[1]]) == 0 and CLI.main(["status"]) == 0
    assert f"\n  {hosts[1]}: up\n" in capfd.readouterr().out
    subprocess.run(["ip", "netns", "del", hosts[1]], check=True)
    # The veth pair goes with either end, so the other host is left without a link; but the
    # kernel tears a deleted namespace down later, in a work queue: ask until it has.
    deadline = time.monotonic() + 20
    while True:
        assert CLI.main(["status"]) == 0
        out = capfd.readouterr().out
        if f"\n  {hosts[0]}: unreachable (no eth0)\n" in out or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert f"\n  {hosts[1]}: gone (its namespace no longer exists" in out, out
    assert f"\n  {hosts[0]}: unreachable (no eth0)\n" in out, out
    assert CLI.main(["down", *spec]) == 0
    assert_gone(C.Cluster(hosts, subnet))


# Run on the receiving host: a TCP sink that counts bytes and a UDP echo, until killed.
_SINK = """
import socket, sys, threading
host = sys.argv[1]
def echo():
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.bind((host, 9001))
    while True:
        data, peer = u.recvfrom(64)
        u.sendto(data, peer)
threading.Thread(target=echo, daemon=True).start()
t = socket.socket()
t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
t.bind((host, 9000))
t.listen(1)
print("ready", flush=True)
conn, _ = t.accept()
while conn.recv(1 << 20):
    pass
"""

# Run on the sending host: bulk TCP for `seconds` while a small UDP probe times round trips.
_SOURCE = """
import json, socket, statistics, sys, threading, time
peer, seconds = sys.argv[1], float(sys.argv[2])
t = socket.create_connection((peer, 9000))
sent, stop = [0], time.monotonic() + seconds
def bulk():
    block = bytes(1 << 16)
    while time.monotonic() < stop:
        sent[0] += t.send(block)
start = time.monotonic()
threading.Thread(target=bulk, daemon=True).start()
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.settimeout(1.0)
rtts = []
time.sleep(seconds / 3)     # the bulk flow's window grows until the queue is full
while time.monotonic() < stop:
    t0 = time.perf_counter()
    u.sendto(b"x" * 32, (peer, 9001))
    u.recvfrom(64)
    rtts.append(time.perf_counter() - t0)
    time.sleep(0.01)
print(json.dumps({"rtt_ms": statistics.median(rtts) * 1e3, "rate": sent[0] / (time.monotonic() - start)}))
"""



def _bulk_with_probe(cluster: C.Cluster) -> dict:
    """{rtt_ms, rate} of 3 s of bulk TCP from the first host to the second, with a small UDP
    probe's round trips timed meanwhile (_SOURCE, _SINK)."""
    a, b = cluster.hosts[:2]
    sink = subprocess.Popen(C.exec_argv(b, [sys.executable, "-c", _SINK, cluster.address(b)]),
                            stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout.readline().strip() == "ready"
        out = subprocess.run(C.exec_argv(a, [sys.executable, "-c", _SOURCE, cluster.address(b), "3"]),
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)
    finally:
        sink.kill()
        sink.wait()


@netns
def test_small_packets_pass_the_bulk_queue(names):
    """A shaped link keeps the 10 ms bulk queue it needs for incast, but a small packet (an
    ACK, MPI's go-ahead) does not wait in it: with one FIFO the probe's round trip is the
    queue's depth (cluster.QUEUE_MS) while a bulk flow fills the link."""
    hosts, subnet = names(2)
    cluster = C.Cluster(hosts, subnet, rate="20mbit")
    with C.running(cluster):
        got = _bulk_with_probe(cluster)
    # The bulk flow still runs at the link's rate (20 Mbit/s, less the headers) ...
    assert 0.8 * C.rate_bytes("20mbit") < got["rate"] < 1.1 * C.rate_bytes("20mbit"), got
    # ... and the probe's round trip is far under the queue's 10 ms.
    assert got["rtt_ms"] < C.QUEUE_MS / 4, got


def _netem(cluster: C.Cluster) -> bool:
    return C._has_netem(cluster.switch)


@netns
def test_delay_uses_netem_where_the_kernel_has_it(names):
    """--delay is netem on each host's link where the kernel has sch_netem."""
    hosts, subnet = names(2)
    cluster = C.Cluster(hosts, subnet, rate="1gbit", delay="1ms")
    with C.running(cluster):
        if not _netem(cluster):
            pytest.skip("this kernel has no netem: the delay line stands in (the next test)")
        qdisc = subprocess.run(["tc", "-n", hosts[0], "qdisc", "show", "dev", C.IFACE],
                               capture_output=True, text=True).stdout
        assert "netem" in qdisc and "delay 1ms" in qdisc
    assert_gone(cluster)


def _delay_lines(cluster: C.Cluster) -> list[int]:
    out = subprocess.run(["pgrep", "-f", "psrt.launch.delay_line"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if _in_namespace(int(p), cluster.switch)]


def _in_namespace(pid: int, namespace: str) -> bool:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(f"/run/netns/{namespace}").st_ino
    except OSError:
        return False


@netns
def test_delay_without_netem_is_the_switchs_delay_line(names):
    """Where the kernel has no netem, a --delay of 2 ms is held by psrt's delay line: every
    round trip between two hosts takes at least 2 x 2 ms, and little more, also while a bulk
    flow fills the link, which keeps its rate; `down` ends the line with its namespace."""
    hosts, subnet = names(2)
    cluster = C.Cluster(hosts, subnet, rate="20mbit", delay="2ms")
    with C.running(cluster):
        if _netem(cluster):
            pytest.skip("this kernel has netem, which --delay uses instead")
        assert len(_delay_lines(cluster)) == 1
        got = _bulk_with_probe(cluster)
    assert 0.8 * C.rate_bytes("20mbit") < got["rate"] < 1.1 * C.rate_bytes("20mbit"), got
    assert 4.0 <= got["rtt_ms"] < 4.0 + C.QUEUE_MS / 10, got
    assert_gone(cluster)
    assert not _delay_lines(cluster)


def _horovodrun() -> str | None:
    exe = Path(sys.executable).with_name("horovodrun")
    return str(exe) if exe.exists() else shutil.which("horovodrun")


@netns
@pytest.mark.mpi
@needs_openmpi
@pytest.mark.skipif(_horovodrun() is None, reason="horovodrun is not installed (scripts/install_horovod.sh)")
def test_horovodrun_across_two_hosts_through_the_agent(names):
    """`horovodrun -np 4 -H a:2,b:2`, typed as on two real hosts (docs/how-to/launching.md runs -np 8):
    its ssh checks and its mpirun reach the second host through the agent, found as
    `ssh` on the cluster's PATH.  Ranks land 2 + 2, an allreduce crosses the link, and Horovod
    trains across the hosts to the same loss as psrt's ring."""
    hosts, subnet = names(2)
    cluster = C.Cluster(hosts, subnet)
    env = C.job_env(cluster, "openmpi4", dict(os.environ, OMP_NUM_THREADS="1"))
    run = [_horovodrun(), "-np", "4", "-H", f"{hosts[0]}:2,{hosts[1]}:2", sys.executable]
    nbytes = 1 << 20
    with C.running(cluster):
        before = C.link_bytes(hosts[0])[0]
        info = subprocess.run(C.exec_argv(hosts[0], run + ["-m", "psrt.info", "--json", "--allreduce", str(nbytes),
                                                           "--iters", "1"]),
                              env=env, capture_output=True, text=True, timeout=400, stdin=subprocess.DEVNULL)
        sent = C.link_bytes(hosts[0])[0] - before
        train = subprocess.run(C.exec_argv(hosts[0], run + [str(ROOT / "examples" / "horovod_vs_ring.py"),
                                                            "--steps", "3", "--quiet"]),
                               env=env, capture_output=True, text=True, timeout=400, stdin=subprocess.DEVNULL,
                               cwd=ROOT)
    assert_gone(cluster)
    assert info.returncode == 0, info.stderr[-3000:]
    recs = sorted((json.loads(line.split("PSRT-RESULT ", 1)[1]) for line in info.stdout.splitlines()
                   if "PSRT-RESULT " in line), key=lambda r: r["rank"])
    assert [(r["hostname"], r["node_rank"], r["local_rank"]) for r in recs] == \
        [(hosts[r // 2], r // 2, r % 2) for r in range(4)]
    # warm-up and timed run, each at least the other host's half of the sum, each way
    assert sent >= 2 * nbytes, sent
    assert train.returncode == 0, train.stderr[-3000:]
    assert re.search(r"horovod vs ring: final train loss ([\d.]+) vs \1 ", train.stdout), train.stdout[-2000:]


def _pair(names, tmp_path):
    """Two emulated hosts of two slots: (hosts, hostfile, cluster, job environment)."""
    hosts, subnet = names(2)
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{hosts[0]} slots=2\n{hosts[1]} slots=2\n")
    cluster = C.Cluster(hosts, subnet)
    env = C.job_env(cluster, "openmpi4", os.environ)
    env.update(OMP_NUM_THREADS="1")
    return hosts, hostfile, cluster, env


@netns
@needs_openmpi
@pytest.mark.parametrize("mode", ["kill", "raise"])
def test_dead_rank_on_the_second_host_ends_the_job(names, tmp_path, mode):
    """A rank on the second emulated host dies (SIGKILL) or raises while the others wait in
    an allreduce: the whole job ends, non-zero, and no rank's process is left on either host."""
    hosts, hostfile, cluster, env = _pair(names, tmp_path)
    tag = f"psrt-orphan-{os.getpid()}-{mode}"
    argv = ["mpirun", "-np", "4", "-hostfile", str(hostfile), sys.executable,
            str(ROOT / "tests" / "mpi" / "ranks" / "fault_rank.py"), mode, "3", "0", tag]
    with C.running(cluster):
        t0 = time.monotonic()
        out = subprocess.run(C.exec_argv(hosts[0], argv), env=env, capture_output=True, text=True,
                             timeout=180, stdin=subprocess.DEVNULL)
        elapsed = time.monotonic() - t0
        time.sleep(1)
        stray = subprocess.run(["pgrep", "-f", tag], capture_output=True, text=True).stdout.split()
    assert_gone(cluster)
    assert out.returncode != 0, out.stdout[-2000:]
    assert "finished" not in out.stdout
    assert elapsed < 90, elapsed     # start-up included; the fault itself is seen in seconds
    assert not stray, stray
    if mode == "raise":
        assert out.stderr.count("injected failure in user code") == 1, out.stderr[-3000:]


@netns
@pytest.mark.mpi
@needs_openmpi
def test_two_hosts_train_ps_and_ring(names, tmp_path):
    """`mpirun -hostfile F python -m psrt.train --dp ps,ring` trains across the emulated
    pair with its defaults (at -np 4 here; docs/how-to/training.md shows -np 8): both strategies
    learn, and the server sends several times what a ring rank sends."""
    hosts, hostfile, cluster, env = _pair(names, tmp_path)
    metrics = tmp_path / "m.jsonl"
    argv = ["mpirun", "-np", "4", "-hostfile", str(hostfile), sys.executable, "-m", "psrt.train",
            "--dp", "ps,ring", "--quiet", "--metrics", str(metrics)]
    with C.running(cluster):
        out = subprocess.run(C.exec_argv(hosts[0], argv), env=env, capture_output=True, text=True,
                             timeout=400, stdin=subprocess.DEVNULL)
    assert_gone(cluster)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "4 ranks" in out.stdout
    summary = {}
    for dp in ("ps", "ring"):
        lines = [json.loads(x) for x in (tmp_path / f"m.{dp}.jsonl").read_text().splitlines()]
        summary[dp] = next(x for x in lines if x.get("summary"))
        assert summary[dp]["workers"] == 4 and summary[dp]["test_acc"] > 0.85, summary[dp]
    assert summary["ps"]["bytes_max_rank"] > 2 * summary["ring"]["bytes_max_rank"]


@netns
@pytest.mark.mpi
@needs_openmpi
def test_sigterm_to_cluster_run_ends_the_mpi_job_on_every_host(names):
    """SIGTERM to `python -m psrt.cluster run -- mpirun ...` while ranks run on both emulated
    hosts: exit 143, and 10 s after the signal no rank, daemon or namespace of the job is left."""
    import uuid
    hosts, subnet = names(2)
    tag = f"psrt-sig-{uuid.uuid4().hex[:10]}"
    cmd = [sys.executable, "-m", "psrt.cluster", "run", "--hosts", ",".join(hosts), "--subnet", subnet,
           "--", "mpirun", "--allow-run-as-root", "-np", "2", "--host", f"{hosts[0]}:1,{hosts[1]}:1",
           sys.executable, str(ROOT / "tests" / "mpi" / "ranks" / "busy_job.py"), tag]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_", "PMIX_", "PSRT_"))}
    proc = subprocess.Popen(cmd, env={**env, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        assert proc.stdout.readline() == "running\n", proc.stderr.read()[-3000:]
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
        time.sleep(max(0.0, 10 - (time.monotonic() - sent)))
        ps = subprocess.run(["ps", "-eo", "pid,stat,args"], capture_output=True, text=True).stdout
        left = [line for line in ps.splitlines() if tag in line and " Z" not in line[:12]]
        assert left == [], left
        assert_gone(C.Cluster(hosts, subnet))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
