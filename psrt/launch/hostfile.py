"""Hostfiles: the two common syntaxes (Open MPI's `host slots=N`, MPICH's `host:N`), read
into one list of hosts and written back in whichever syntax the launcher understands.
See hostfiles/README.md."""
from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from psrt.errors import PsrtError

# A host name or IPv4 address; IPv6 would clash with MPICH's `host:N`.
_NAME = r"[A-Za-z0-9_.-]+"
_OPENMPI_LINE = re.compile(rf"^({_NAME})((?:\s+\w+=\S*)*)$")
_MPICH_LINE = re.compile(rf"^({_NAME}):(\S*)$")
_OPENMPI_KEYS = ("slots", "max_slots", "max-slots")


# --- hostfiles ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Host:
    """One hostfile entry.  `slots` is None when the entry gave none (see `slots_of`)."""

    name: str
    slots: int | None
    where: str = ""      # "FILE line N", for error messages
    syntax: str = "plain"  # "openmpi" (`host slots=N`), "mpich" (`host:N`) or "plain" (`host`)


def _positive(text: str, what: str, where: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise PsrtError(f"{where}: {what} {text!r} is not a positive whole number")
    return value


def parse_host_line(line: str, where: str) -> Host | None:
    """Parse one line of an Open MPI or MPICH hostfile; None for a blank or comment line."""
    text = line.split("#", 1)[0].strip()
    if not text:
        return None
    m = _MPICH_LINE.match(text)
    if m:
        return Host(m.group(1), _positive(m.group(2), "slot count", where), where, "mpich")
    m = _OPENMPI_LINE.match(text)
    if not m:
        raise PsrtError(f"{where}: cannot read {text!r}: expected `host slots=N` (Open MPI), "
                        "`host:N` (MPICH) or a bare `host`")
    slots = None
    for item in m.group(2).split():
        key, value = item.split("=", 1)
        if key not in _OPENMPI_KEYS:
            raise PsrtError(f"{where}: unknown key {key!r} in {text!r} (known: slots, max_slots)")
        if key == "slots":
            slots = _positive(value, "slots", where)
        else:
            _positive(value, key, where)  # checked, then left to MPI: psrt places by slots
    return Host(m.group(1), slots, where, "openmpi" if m.group(2) else "plain")


def _merge(hosts: list[Host], source: str) -> tuple[Host, ...]:
    """Fold repeated hosts into one entry (slots add up, as in Open MPI and MPICH)."""
    if not hosts:
        raise PsrtError(f"{source}: names no hosts")
    syntaxes = {h.syntax for h in hosts} - {"plain"}
    if len(syntaxes) > 1:
        raise PsrtError(f"{source}: mixes Open MPI (`host slots=N`) and MPICH (`host:N`) lines")
    merged: dict[str, Host] = {}
    for h in hosts:
        if h.name in merged:
            old = merged[h.name]
            slots = None if old.slots is None and h.slots is None else \
                (old.slots or 1) + (h.slots or 1)
            h = Host(h.name, slots, old.where, old.syntax)
        merged[h.name] = h
    return tuple(merged.values())


def parse_hostfile(path: str | os.PathLike) -> tuple[Host, ...]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise PsrtError(f"hostfile {path}: {err.strerror or err}") from None
    hosts = [parse_host_line(line, f"{path} line {i}") for i, line in enumerate(lines, 1)]
    return _merge([h for h in hosts if h is not None], str(path))


def parse_hosts(spec: str) -> tuple[Host, ...]:
    """`--hosts node0:4,node1:4` (slot counts optional)."""
    items = [s.strip() for s in spec.split(",")]
    if any(not s for s in items):
        raise PsrtError(f"--hosts {spec!r}: empty entry (expected host[:N],host[:N],...)")
    hosts = [parse_host_line(s, f"--hosts entry {s!r}") for s in items]
    return _merge(hosts, f"--hosts {spec!r}")


def hostfile_syntax(hosts: tuple[Host, ...]) -> str:
    """'openmpi', 'mpich' or 'plain' (no slot counts anywhere)."""
    kinds = {h.syntax for h in hosts} - {"plain"}
    return kinds.pop() if kinds else "plain"


def format_hosts(hosts: tuple[Host, ...], syntax: str, cores: int) -> str:
    """Hostfile text in `syntax` ('openmpi' or 'mpich') with every slot count spelled out."""
    fmt = "{} slots={}" if syntax == "openmpi" else "{}:{}"
    return "".join(fmt.format(h.name, slots_of(h, cores)) + "\n" for h in hosts)


def is_local(name: str) -> bool:
    return name in ("localhost", "127.0.0.1", "::1", socket.gethostname())


def slots_of(host: Host, cores: int) -> int:
    """Slots of an entry: as given; else this machine's cores for a local name, else 1."""
    if host.slots is not None:
        return host.slots
    return cores if is_local(host.name) else 1
