"""The emulated cluster's switch with a one-way delay, in user space, for kernels without netem.

    ip netns exec SWITCH python -m psrt.launch.delay_line --delay 1ms p0 p1 p2 p3

Linux emulates a link's latency with the netem qdisc (sch_netem); a kernel built without it
has no other queueing discipline that holds a packet for a set time (tbf and htb only pace).
This switch does it instead: it reads every frame that a host sends into its switch port
(a raw AF_PACKET socket per port), holds it until the kernel's receive timestamp plus the
delay, and writes it out of the port behind which its destination MAC address was last seen
(every other port while unknown, as a learning bridge floods).  A frame crosses one switch,
so each hop between hosts costs the delay once, as netem on each sender's link does.

Frames keep the kernel's segmentation offload: the sockets carry the virtio-net header
(PACKET_VNET_HDR), so a TCP burst of up to 64 KiB crosses as one frame and is cut into
packets only where a real NIC would cut it; written back with the same header, it leaves
the port's qdisc (the link's rate) as it would have left the bridge.

The line runs at the highest nice level it may take, so that on a host whose cores the
ranks keep busy it still wakes when a frame is due; what it cannot hold to (a wake-up
later than the due time) it sends at once.  It prints `ready` once every port is open.
"""
from __future__ import annotations

import argparse
import heapq
import os
import re
import select
import signal
import socket
import struct
import sys
import time

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15          # linux/if_packet.h
PACKET_OUTGOING = 4           # what this socket's own port sends (our own writes among it)
SO_TIMESTAMPNS = 35           # asm-generic/socket.h: receive times as a struct timespec
VNET_HDR = 10                 # sizeof(struct virtio_net_hdr)
FRAME = VNET_HDR + 65536 + 64  # the largest offloaded frame, its header and Ethernet's
_TIMESPEC = struct.Struct("qq")
_UNITS = {"us": 1e3, "usec": 1e3, "ms": 1e6, "msec": 1e6, "s": 1e9, "sec": 1e9}


def delay_ns(text: str) -> int:
    """Nanoseconds of a tc-style delay (500us, 1ms, 0.2s)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(us|usec|ms|msec|s|sec)", text.strip(), re.I)
    if m is None:
        raise ValueError(f"--delay {text!r}: expected tc syntax such as 500us or 2ms")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def open_port(name: str) -> socket.socket:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.bind((name, 0))
    return s


def _received_at(ancillary) -> int:
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= _TIMESPEC.size:
            sec, nsec = _TIMESPEC.unpack_from(data)
            return sec * 1_000_000_000 + nsec
    return time.time_ns()


def serve(ports: list[str], delay: int, ready=None) -> None:
    socks = [open_port(p) for p in ports]
    port_of = {s: i for i, s in enumerate(socks)}
    where: dict[bytes, int] = {}      # MAC address -> the port it was last seen behind
    due: list = []                    # (due ns, sequence, out ports, frame)
    seq = 0
    if ready:
        ready()
    while True:
        now = time.time_ns()
        while due and due[0][0] <= now:
            _, _, outs, frame = heapq.heappop(due)
            for j in outs:
                try:
                    socks[j].send(frame)
                except OSError:       # the port's queue is full: dropped, as a switch drops
                    pass
        timeout = max(0.0, (due[0][0] - time.time_ns()) / 1e9) if due else None
        readable, _, _ = select.select(socks, [], [], timeout)
        for s in readable:
            i = port_of[s]
            while True:
                try:
                    frame, anc, _, addr = s.recvmsg(FRAME, 64, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                if addr[2] == PACKET_OUTGOING or len(frame) < VNET_HDR + 14:
                    continue
                dst, src = frame[VNET_HDR:VNET_HDR + 6], frame[VNET_HDR + 6:VNET_HDR + 12]
                where[src] = i
                j = where.get(dst) if not dst[0] & 1 else None     # multicast bit: flood
                outs = (j,) if j is not None and j != i else tuple(k for k in range(len(socks)) if k != i)
                seq += 1
                heapq.heappush(due, (_received_at(anc) + delay, seq, outs, frame))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m psrt.launch.delay_line", description=__doc__.split("\n")[0])
    p.add_argument("--delay", required=True, help="one-way delay per hop, tc syntax (500us, 2ms)")
    p.add_argument("ports", nargs="+", help="the switch's ports (interfaces of this namespace)")
    args = p.parse_args(argv)
    try:
        delay = delay_ns(args.delay)
    except ValueError as err:
        p.error(str(err))
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -20)
    except OSError:
        pass                          # not root: the ordinary priority, later wake-ups
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        serve(args.ports, delay, ready=lambda: print("ready", flush=True))
    except OSError as err:
        print(f"psrt.launch.delay_line: {err}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
