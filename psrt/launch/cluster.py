"""An emulated cluster: hosts as Linux network namespaces of this machine.

    python -m psrt.cluster run --hostfile hostfiles/two_nodes -- \\
        mpirun -np 8 -hostfile hostfiles/two_nodes python -m psrt.info

Each host is a network namespace named after its hostfile entry, with a host name of its own
(a UTS namespace, set by the launch agent) and an address in 198.18.0.0/15, the range set
aside for network benchmarks (RFC 2544), so nothing here can reach a real network.  Two
hosts share one veth link; more hosts, or hosts whose links have a delay, hang off a switch
namespace: a bridge there, or, for a delay on a kernel without netem, psrt's delay line
(psrt/launch/delay_line.py).  Hosts find each other by name through /etc/netns/HOST/hosts, which `ip netns exec` mounts over
/etc/hosts.  The root namespace gets no interface, address or route.

MPI (Open MPI 4 and 5, MPICH's Hydra) starts its daemons through scripts/netns_agent
(`ip netns exec HOST ...`) instead of ssh, and is told to use TCP between hosts: ranks of
different namespaces share one kernel, and shared-memory transports would reach across.
Open MPI is also told to yield when idle: on a small machine busy-polling ranks starve the
kernel's network processing (an Open MPI ping-pong across the veth took 4.8 ms one way
without mpi_yield_when_idle, 14 us with it).
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
import shutil
import select
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from psrt import env as psrt_env
from psrt.errors import PsrtError
from psrt.launch import slurm
from psrt.launch.delay_line import delay_ns
from psrt.launch.hostfile import is_local
from psrt.launch.mpi import kill
from psrt.launch.plan import ROOT
# re-exported: how MPI is told to use the emulated hosts
from psrt.launch.emulated_mpi import AGENT, IFACE, mpi_env, mpi_flags  # noqa: F401

SSH_DIR = ROOT / "scripts" / "netns_ssh"   # holds `ssh`, a link to AGENT
ALLOWED = ipaddress.ip_network("198.18.0.0/15")
DEFAULT_SUBNET = "198.18.0.0/24"
STATE_DIR = Path("/run/psrt-cluster")
NETNS_ETC = Path("/etc/netns")
_HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,59}$")
RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$", re.I)


@dataclass(frozen=True)
class Cluster:
    """Host names (namespaces), their subnet, and the optional shaping of every host's link."""

    hosts: tuple
    subnet: str = DEFAULT_SUBNET
    rate: str | None = None   # tc syntax: 1gbit, 100mbit, 10mbps (bytes/s)
    delay: str | None = None  # tc syntax: 500us, 1ms
    slurm: bool = False       # munge, slurmctld and one slurmd per host (psrt/launch/slurm.py)
    slots: tuple = ()         # per host, from the hostfile (None: not given); Slurm's CPUs

    def __post_init__(self):
        object.__setattr__(self, "hosts", tuple(self.hosts))
        object.__setattr__(self, "slots", tuple(self.slots))
        if self.slots and (len(self.slots) != len(self.hosts) or
                           any(n is not None and (not isinstance(n, int) or n < 1) for n in self.slots)):
            raise PsrtError(f"emulated hosts {', '.join(self.hosts)}: slots {self.slots} must give a "
                            "positive count (or none) for each host")
        if len(self.hosts) < 2:
            raise PsrtError(f"an emulated cluster needs at least 2 hosts, got {len(self.hosts)} "
                            f"({', '.join(self.hosts) or 'none'}); e.g. hostfiles/two_nodes")
        if len(set(self.hosts)) != len(self.hosts):
            raise PsrtError(f"emulated hosts repeat a name: {', '.join(self.hosts)}")
        for h in self.hosts:
            if not _HOST_NAME.match(h) or is_local(h):
                raise PsrtError(f"emulated host {h!r}: use letters, digits and '-' (at most 60), "
                                "and not this machine's own name or localhost")
        try:
            net = ipaddress.ip_network(self.subnet)
        except ValueError:
            raise PsrtError(f"--subnet {self.subnet!r}: not a network like 198.18.0.0/24") from None
        if not net.subnet_of(ALLOWED):
            raise PsrtError(f"--subnet {self.subnet}: must lie inside {ALLOWED}, the range set "
                            "aside for benchmarks, so no real network is ever addressed")
        if net.num_addresses - 2 < len(self.hosts):
            raise PsrtError(f"--subnet {self.subnet}: too small for {len(self.hosts)} hosts")
        if self.rate is not None and not RATE.match(self.rate):
            raise PsrtError(f"--rate {self.rate!r}: expected tc syntax such as 1gbit or 100mbit")
        if self.delay is not None:
            try:
                delay_ns(self.delay)
            except ValueError as err:
                raise PsrtError(str(err)) from None

    @property
    def switch(self) -> str | None:
        """Namespace that holds the switch (for more than two hosts, or a delay: the delay
        line, where it is used, sits between the hosts)."""
        return f"{self.hosts[0]}-sw" if len(self.hosts) > 2 or self.delay else None

    @property
    def namespaces(self) -> tuple:
        return self.hosts + ((self.switch,) if self.switch else ())

    def address(self, host: str) -> str:
        net = ipaddress.ip_network(self.subnet)
        return str(net.network_address + 1 + self.hosts.index(host))

    def describe(self) -> list[str]:
        link = "one veth link" if self.switch is None else f"a switch in namespace {self.switch}"
        shape = ", ".join(x for x in (self.rate and f"rate {self.rate}",
                                      self.delay and f"delay {self.delay} (netem, or the switch's "
                                                     "delay line where the kernel has no netem)") if x)
        hosts = ", ".join(f"{h} ({self.address(h)})" for h in self.hosts)
        return [f"emulated cluster: {hosts} on {self.subnet}, {link}"
                + (f", each host's {IFACE} shaped to {shape}" if shape else "")
                + (f", Slurm (slurmctld on {self.hosts[0]}, a slurmd per host, {self._cpus()})"
                   if self.slurm else "")]

    def _cpus(self) -> str:
        per_host = slurm.cpus(self)
        if len(set(per_host.values())) == 1:
            return f"{next(iter(per_host.values()))} CPUs each"
        return ", ".join(f"{h} {n} CPUs" for h, n in per_host.items())


# --- commands ---------------------------------------------------------------------------------

def _run(argv: list[str], what: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if check and out.returncode != 0:
        detail = " ".join((out.stderr or out.stdout).split()) or f"exit {out.returncode}"
        raise PsrtError(f"{what}: `{shlex.join(argv)}` failed: {detail}")
    return out


def require_netns() -> None:
    """Refuse early, in one line, where namespaces cannot be made."""
    if os.geteuid() != 0:
        raise PsrtError("the emulated cluster needs root (it creates network namespaces): "
                        "run it with sudo, or run on one host without --emulate")
    for tool in ("ip", "unshare", "hostname"):
        if shutil.which(tool) is None:
            raise PsrtError(f"the emulated cluster needs `{tool}` on PATH "
                            "(Debian: apt install iproute2 util-linux hostname)")
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        raise PsrtError("`ip netns` does not work here (no network namespace support?)")
    if not os.access(AGENT, os.X_OK):
        raise PsrtError(f"{AGENT} is not executable: chmod +x {AGENT}")


def existing_namespaces() -> set[str]:
    out = _run(["ip", "netns", "list"], "listing namespaces")
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def exec_argv(host: str, argv) -> list[str]:
    """argv that runs `argv` on `host` through the agent (which, like ssh, re-parses it)."""
    return [str(AGENT), host] + [shlex.quote(a) for a in argv]


# --- up / down --------------------------------------------------------------------------------

def _state_path(name: str) -> Path:
    return STATE_DIR / f"{name}.json"


def _hosts_file(cluster: Cluster) -> str:
    lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
    lines += [f"{cluster.address(h)} {h}" for h in cluster.hosts]
    return "\n".join(lines) + "\n"


def rate_bytes(rate: str) -> float:
    """Bytes per second of a tc rate such as 1gbit or 100mbps."""
    value, unit = RATE.match(rate).groups()
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[unit.lower()[:-3].rstrip("b")]
    return float(value) * scale / (8 if unit.lower().endswith("bit") else 1)


def _shape(cluster: Cluster, host: str, iface: str = IFACE, delay: bool = True) -> None:
    """Shape what leaves `iface` in namespace `host`: netem for a delay (rate included), htb
    for a rate alone (or where `delay` is False)."""
    dev = ["tc", "-n", host, "qdisc", "replace", "dev", iface, "root"]
    if cluster.delay and delay:
        extra = ["rate", cluster.rate] if cluster.rate else []
        _run(dev + ["netem", "delay", cluster.delay, "limit", "100000"] + extra, f"shaping {host}")
    elif cluster.rate:
        _shape_rate(host, iface, cluster.rate)


# A link of rate R is an HTB qdisc (Linux's hierarchical token bucket) with two classes that
# share R: small packets (IPv4 total length under SMALL_PACKET bytes: TCP's acknowledgements,
# MPI's rendezvous go-ahead and match headers) go first, bulk data waits in a queue of
# QUEUE_MS.  With one FIFO (tbf), a rank's go-ahead to its left neighbour and the ACKs of
# what it receives queued behind its own bulk data to its right, so each of the ring's
# 2(N-1) steps waited up to a full queue: measured on 4 hosts of 4 ranks at 250 Mbit/s,
# psrt's ring all-reduce of 3 MiB took 350 ms against 204 ms with the small class (24 MiB:
# 2.19 s against 1.59 s; the link model's 189 ms and 1.51 s).  A real host keeps them apart
# too: the kernel's default fq_codel isolates each flow, and a datacenter switch's queue
# holds a small fraction of a millisecond at 25 Gbit/s.  This machine's kernel has neither
# fq_codel nor prio (only htb, tbf and the FIFOs), hence the classes.
#
# The bulk queue holds 50 ms, deep enough that an all-to-all into each host's port rarely
# overflows it: an accelerator fabric loses no packets (InfiniBand's credit-based flow
# control, RoCE with priority flow control) and the step model charges no loss, while a
# TCP retransmission timeout (200 ms at least on Linux) is not dilated.  With 10 ms, the
# sharded servers on 4 hosts of 4 ranks (VGG-16's profile, 6 steps) had 221 TCP timeouts,
# with 50 ms 10; the ring's time did not change, its go-aheads no longer waiting in it.
SMALL_PACKET = 256
QUEUE_MS = 50


def _shape_rate(host: str, iface: str, rate: str) -> None:
    tc = ["tc", "-n", host]
    bytes_s = rate_bytes(rate)
    # A burst of ~2 ms at line rate: small enough to hold the rate, large enough for the
    # kernel timer (a token bucket needs burst >= rate / HZ).
    burst = str(max(16384, int(bytes_s / 500)))
    bucket = ["ceil", rate, "burst", burst, "cburst", burst]
    steps = [["qdisc", "replace", "dev", iface, "root", "handle", "1:", "htb", "default", "20"],
             ["class", "add", "dev", iface, "parent", "1:", "classid", "1:1", "htb", "rate", rate, *bucket]]
    # Each class is guaranteed its share and may borrow the whole rate; the small packets'
    # class borrows first (prio 0).  A quantum of one frame keeps HTB from warning that the
    # default (rate / 10) is too large.
    for classid, share, prio in (("1:10", 0.05, 0), ("1:20", 0.95, 1)):
        steps.append(["class", "add", "dev", iface, "parent", "1:1", "classid", classid, "htb",
                      "rate", f"{int(bytes_s * 8 * share)}bit", *bucket, "prio", str(prio), "quantum", "1514"])
    steps += [["qdisc", "add", "dev", iface, "parent", "1:20", "handle", "20:", "bfifo",
               "limit", str(int(bytes_s * QUEUE_MS / 1000))],
              # u32 on the IPv4 header's total length (bytes 2-3): its high bits all zero.
              ["filter", "add", "dev", iface, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
               "match", "u16", "0", f"0x{0x10000 - SMALL_PACKET:04x}", "at", "2", "flowid", "1:10"]]
    for argv in steps:
        _run(tc + argv, f"shaping {host}")


def up(cluster: Cluster, owner: int | None = None) -> None:
    """Create the namespaces, links, addresses and names; undo everything on failure.

    Args:
        owner: pid that will take the cluster down (None: left up until `down`).
    """
    require_netns()
    taken = sorted(set(cluster.namespaces) & existing_namespaces())
    if taken:
        raise PsrtError(f"namespace {', '.join(taken)} already exists: another emulated cluster "
                        "is up, or one was left behind (python -m psrt.cluster down)")
    # The record goes first, so that `down` can find whatever a crash leaves half made.
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    _state_path(cluster.hosts[0]).write_text(json.dumps({**asdict(cluster), "owner": owner}))
    try:
        _create(cluster)
        if cluster.slurm:
            slurm.start(cluster)
    except BaseException:
        down(cluster)
        raise


def _create(cluster: Cluster) -> None:
    ip = ["ip"]
    for ns in cluster.namespaces:
        _run(ip + ["netns", "add", ns], f"creating namespace {ns}")
    # Devices are created straight inside their namespaces: none appears in the root one.
    line = bool(cluster.delay) and not _has_netem(cluster.switch)
    if cluster.switch is None:
        a, b = cluster.hosts
        _run(ip + ["link", "add", IFACE, "netns", a, "type", "veth", "peer", "name", IFACE,
                   "netns", b], "linking the hosts")
    else:
        sw = cluster.switch
        if not line:
            _run(ip + ["-n", sw, "link", "add", "br0", "type", "bridge"], "creating the bridge")
            _run(ip + ["-n", sw, "link", "set", "br0", "up"], "starting the bridge")
        for i, h in enumerate(cluster.hosts):
            port = f"p{i}"
            _run(ip + ["link", "add", IFACE, "netns", h, "type", "veth", "peer", "name", port,
                       "netns", sw], f"linking {h} to the switch")
            _run(ip + ["-n", sw, "link", "set", port] + ([] if line else ["master", "br0"]) + ["up"],
                 f"plugging {h} into the switch")
            # The switch port limits what the host receives, as the host's own eth0 limits
            # what it sends: each host has a full-duplex link of the given rate, and N
            # senders cannot push N x rate into one host (a server's link is its limit).
            # The delay is the host's alone, so one hop costs it once, as with two hosts.
            if cluster.rate:
                _shape(cluster, sw, port, delay=False)
    prefix = ipaddress.ip_network(cluster.subnet).prefixlen
    for h in cluster.hosts:
        _run(ip + ["-n", h, "link", "set", "lo", "up"], f"starting {h}'s loopback")
        _run(ip + ["-n", h, "addr", "add", f"{cluster.address(h)}/{prefix}", "dev", IFACE],
             f"addressing {h}")
        # No IPv6 link-local address: its neighbour discovery would only add noise to
        # the link's byte counters.
        _run(ip + ["-n", h, "link", "set", IFACE, "addrgenmode", "none"], f"configuring {h}")
        _run(ip + ["-n", h, "link", "set", IFACE, "up"], f"starting {h}'s {IFACE}")
        _write_hosts(NETNS_ETC / h, _hosts_file(cluster))
        _tcp(h)
        if cluster.rate or cluster.delay:
            _shape(cluster, h, delay=not line)
    if line:
        _start_delay_line(cluster)


def _has_netem(namespace: str) -> bool:
    """Whether the kernel has netem, asked on a veth pair of `namespace`'s own (gone after;
    veth, which the cluster needs anyway: a kernel may lack the dummy device)."""
    _run(["ip", "-n", namespace, "link", "add", "netem-probe", "type", "veth", "peer", "name",
          "netem-probe1"], "probing for netem")
    try:
        return _run(["tc", "-n", namespace, "qdisc", "add", "dev", "netem-probe", "root", "netem",
                     "delay", "1ms"], "probing for netem", check=False).returncode == 0
    finally:
        _run(["ip", "-n", namespace, "link", "del", "netem-probe"], "probing for netem", check=False)


def _start_delay_line(cluster: Cluster, timeout: float = 20.0) -> None:
    """Start psrt.launch.delay_line in the switch namespace and wait for its `ready`; `down`
    ends it with the namespace's other processes.  Its errors go to a log in STATE_DIR."""
    ports = [f"p{i}" for i in range(len(cluster.hosts))]
    log = STATE_DIR / f"{cluster.hosts[0]}.delay_line.log"
    path = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    with open(log, "w") as err:
        proc = subprocess.Popen(["ip", "netns", "exec", cluster.switch, sys.executable, "-m",
                                 "psrt.launch.delay_line", "--delay", cluster.delay, *ports],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, text=True,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(path)},
                                cwd=ROOT, start_new_session=True)
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    said = proc.stdout.readline().strip() if ready else ""
    proc.stdout.close()
    if said != "ready":
        proc.kill()
        proc.wait()
        detail = " ".join(log.read_text().split()) or f"no `ready` within {timeout:g} s"
        raise PsrtError(f"--delay {cluster.delay}: the kernel has no netem, and psrt's delay line "
                        f"in namespace {cluster.switch} did not start: {detail[-300:]}")


# The emulated hosts' TCP congestion control, set rather than inherited from the machine's
# default (a namespace starts with it): a machine running BBR (v1) gave the emulated links
# 6-22% retransmitted segments under the sharded servers' all-to-all, BBR's known loss rate
# where many flows share a shallow buffer (Hock, Bless & Zitterbart, ICNP 2017), and
# the model charges none.  Reno (NewReno, RFC 6582) halves its window on a loss, as the
# CUBIC of most Linux clusters does, and is the one choice every kernel lets a namespace make
# (the net.ipv4.tcp_allowed_congestion_control list always holds it).  Measured here on 4
# hosts at 250 Mbit/s, ResNet-50's profile: 1-3% of segments retransmitted against 6-22%
# under BBR, and the ps-sharded step a sixth to a fifth shorter with 2 and with 4 ranks a host.
CONGESTION_CONTROL = "reno"


def _tcp(host: str) -> None:
    _run(["ip", "netns", "exec", host, "sysctl", "-q", "-w",
          f"net.ipv4.tcp_congestion_control={CONGESTION_CONTROL}"], f"setting {host}'s TCP congestion control")


def _write_hosts(folder: Path, text: str) -> None:
    # Another cluster's `down` removes /etc/netns when it looks empty; if that happens
    # between our mkdir and our write, make it again.
    for attempt in range(3):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(text)
            return
        except FileNotFoundError:
            if attempt == 2:
                raise


def _stop_processes(namespaces) -> None:
    """End what still runs inside our namespaces (e.g. MPI daemons after a Ctrl-C), so the
    namespaces, and with them their links, really go away."""
    pids = set()
    for ns in namespaces:
        out = _run(["ip", "netns", "pids", ns], "listing processes", check=False)
        pids |= {int(p) for p in out.stdout.split() if p.isdigit()}
    pids.discard(os.getpid())
    for sig, pause in ((signal.SIGTERM, 1.0), (signal.SIGKILL, 0.0)):
        alive = set()
        for pid in pids:
            try:
                os.kill(pid, sig)
                alive.add(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return
        deadline = time.monotonic() + pause
        while pause and time.monotonic() < deadline and any(_alive(p) for p in alive):
            time.sleep(0.05)
        pids = {p for p in alive if _alive(p)}


def fail(host: str) -> None:
    """Emulate a lost host: its link goes down, so the other hosts and the launch agent no
    longer reach it, and every process on `host` is killed (SIGKILL, as a crash gives no
    warning).  The link first: the killed processes end the job at once, and a restart that
    asked the hosts before the link was down would find this one still answering."""
    _run(["ip", "-n", host, "link", "set", IFACE, "down"], f"taking {host}'s link down")
    out = _run(["ip", "netns", "pids", host], f"listing the processes of {host}")
    pids = {int(p) for p in out.stdout.split() if p.isdigit()} - {os.getpid()}
    # All stopped first, then killed: the host's processes end together, and none outlives
    # another long enough to say so (a shell there printing "Killed" for its child).
    for pid in pids:
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            pass
    kill(pids)


def revive(host: str) -> None:
    """A failed host answers again: its link comes back up (it runs nothing until a job starts)."""
    _run(["ip", "-n", host, "link", "set", IFACE, "up"], f"bringing {host}'s link up")


def host_states(cluster: Cluster) -> dict[str, str]:
    """Each host's state as the launch agent finds it when MPI or a restart asks: `up`;
    `failed` (its link is down: `fail HOST`); `gone` (its namespace was removed behind the
    cluster's back); `unreachable` (its link is gone: a veth pair goes with either end);
    `unknown` where namespaces cannot be looked into (not root)."""
    present = existing_namespaces()
    states = {}
    for h in cluster.hosts:
        if h not in present:
            states[h] = "gone (its namespace no longer exists; `down` clears the rest)"
        elif os.geteuid() != 0:
            states[h] = "unknown (looking into a namespace needs root)"
        else:
            out = _run(["ip", "-n", h, "-o", "link", "show", "dev", IFACE], f"asking {h}", check=False)
            flags = re.search(r"<([^>]*)>", out.stdout)
            if out.returncode != 0 or flags is None:
                states[h] = f"unreachable (no {IFACE})"
            elif "UP" in flags.group(1).split(","):
                states[h] = "up"
            else:
                states[h] = f"failed (link down; `python -m psrt.cluster revive {h}` brings it back)"
    return states


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def down(cluster: Cluster) -> list[str]:
    """Remove the cluster's namespaces (their links go with them), names and record.

    Returns the namespaces that existed.  Missing pieces are not an error: this also
    clears what a crash left half made.
    """
    with _signals_held():
        present = [ns for ns in cluster.namespaces if ns in existing_namespaces()]
        _stop_processes(present)     # Slurm's daemons and jobs among them
        slurm.stop(cluster)          # what escaped that, munged and Slurm's files (also after a crash)
        for ns in present:
            out = _run(["ip", "netns", "del", ns], f"removing namespace {ns}", check=False)
            if out.returncode != 0 and ns in existing_namespaces():   # not gone by another's down
                _run(["ip", "netns", "del", ns], f"removing namespace {ns}")
        for h in cluster.hosts:
            shutil.rmtree(NETNS_ETC / h, ignore_errors=True)
        _state_path(cluster.hosts[0]).unlink(missing_ok=True)
        (STATE_DIR / f"{cluster.hosts[0]}.delay_line.log").unlink(missing_ok=True)
        try:
            NETNS_ETC.rmdir()  # only if nothing else lives there
        except OSError:
            pass
    return present


_HELD = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextmanager
def _signals_held():
    """Hold Ctrl-C, SIGTERM and SIGHUP until the block is done, then deliver the first that
    came to the handler that was in place: a cleanup cut short would leave half a cluster
    (namespaces, daemons) that nothing owns any more."""
    if threading.current_thread() is not threading.main_thread():
        yield               # only the main thread receives signals in Python
        return
    caught = []
    old = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in _HELD}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if caught:
            signal.raise_signal(caught[0])


def recorded() -> list[tuple[Cluster, int | None]]:
    """Clusters this machine has a record of, with the pid that owns each (None: `up`)."""
    out = []
    for path in sorted(STATE_DIR.glob("*.json")) if STATE_DIR.is_dir() else []:
        try:
            state = json.loads(path.read_text())
            owner = state.pop("owner", None)
            out.append((Cluster(**state), owner))
        except (ValueError, TypeError, PsrtError):
            path.unlink(missing_ok=True)  # unreadable: nothing can be done with it
    return out


@contextmanager
def running(cluster: Cluster):
    """The cluster, up for the length of a `with` block and down after it, also after an
    error, Ctrl-C (KeyboardInterrupt) or SIGTERM/SIGHUP (turned into SystemExit)."""
    def stop(signum, frame):
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        # up() undoes its own half-made work, and touches nothing when a name is taken:
        # those namespaces belong to someone else and must survive this block.
        up(cluster, owner=os.getpid())
        try:
            yield cluster
        finally:
            down(cluster)      # a signal during it waits until it is done
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def link_bytes(host: str) -> tuple[int, int]:
    """(tx, rx) byte counters of `host`'s link."""
    out = _run(["ip", "-n", host, "-j", "-s", "link", "show", "dev", IFACE], "reading counters")
    stats = json.loads(out.stdout)[0]["stats64"]
    return stats["tx"]["bytes"], stats["rx"]["bytes"]


def job_env(cluster: Cluster, flavour: str, env) -> dict:
    """Environment for a command run on the cluster: MPI settings, this checkout, the agent as
    `ssh` (and SLURM_CONF with Slurm: srun passes the rest on to the tasks).  Open MPI's ranks yield when
    idle, as every emulated host shares this machine's cores, unless PSRT_YIELD=0 or an
    OMPI_MCA_mpi_yield_when_idle of the user's says otherwise (psrt.env.yield_when_idle)."""
    path = [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    # `ssh HOST CMD` reaches another emulated host through the agent (horovodrun asks every
    # host by ssh before it starts mpirun): no host here runs an ssh server.
    search = [str(SSH_DIR)] + [p for p in env.get("PATH", os.defpath).split(os.pathsep) if p]
    out = {**env, **mpi_env(cluster, flavour), "PYTHONPATH": os.pathsep.join(path),
           "PATH": os.pathsep.join(search)}
    yield_ = psrt_env.yield_when_idle(True, env)
    if yield_ is not None and flavour.startswith("openmpi"):
        out["OMPI_MCA_mpi_yield_when_idle"] = yield_
    return slurm.env(cluster, out) if cluster.slurm else out
