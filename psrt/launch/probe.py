"""Whether hosts answer: the question a restart and a grow-back ask of every host of a job
(psrt/launch/restart.py, growback.py), the way MPI reaches a host."""
from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from psrt.launch.hostfile import Host, is_local

PROBE_TIMEOUT_S = 10.0


def answers(host: str, timeout: float = PROBE_TIMEOUT_S, ssh: str = "ssh") -> bool:
    """Whether `host` can start a process now: `ssh HOST true` (batch mode, no password
    prompt), which is how Open MPI and MPICH start their daemons there.  This machine always
    answers."""
    if is_local(host):
        return True
    argv = [ssh, "-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, int(timeout))}", host, "true"]
    try:
        return subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=timeout).returncode == 0
    except (subprocess.TimeoutExpired, OSError):
        return False


def survivors(hosts: tuple[Host, ...], probe: Callable[[str], bool] = answers) -> tuple[Host, ...]:
    """The hosts that answer, in hostfile order (asked at once: a dead host costs one timeout)."""
    with ThreadPoolExecutor(max_workers=min(32, max(1, len(hosts)))) as pool:
        alive = list(pool.map(probe, [h.name for h in hosts]))
    return tuple(h for h, ok in zip(hosts, alive) if ok)
