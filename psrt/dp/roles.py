"""Which ranks serve and which train, for each parameter-server layout: pure functions of the
world size and the options, with no torch, so `psrt.train` can size the global batch for the
workers of every chosen strategy before any rank imports torch.  The strategies build their
layout from these same functions."""
from __future__ import annotations

from psrt.errors import PsrtError

Layout = tuple[list[int], list[int]]   # (server ranks, worker ranks), the same on every rank


def ps_layout(size: int, servers: int | None) -> Layout:
    """--dp ps: rank 0 serves and works (servers 0/None), or the last rank is a dedicated
    server (servers 1)."""
    servers = servers or 0
    if servers == 0:
        return [0], list(range(size))
    if servers != 1:
        raise PsrtError(f"--dp ps has one server (--servers 0: rank 0 serves and works; 1: a "
                        f"dedicated last rank), got --servers {servers}: use --dp ps-sharded",
                        everywhere=True)
    if size < 2:
        raise PsrtError("--dp ps --servers 1 needs at least 2 ranks (1 worker + 1 server), "
                        f"got {size}", everywhere=True)
    return [size - 1], list(range(size - 1))


def sharded_layout(size: int, servers: int | None, shards: int | None = None) -> Layout:
    """--dp ps-sharded: the last S ranks are dedicated servers (servers S > 0), or ranks
    0..shards-1 hold a shard each and also work (servers 0/None; every rank by default)."""
    servers = servers or 0
    if servers < 0:
        raise PsrtError(f"--dp ps-sharded: --servers must be >= 0, got {servers}", everywhere=True)
    if servers > 0:
        if shards not in (None, servers):
            raise PsrtError(f"--dp ps-sharded: with {servers} dedicated servers there are "
                            f"{servers} shards; drop shards={shards}", everywhere=True)
        if servers >= size:
            raise PsrtError(f"--dp ps-sharded --servers {servers} leaves no worker among "
                            f"{size} ranks: use at most {size - 1} dedicated servers", everywhere=True)
        return list(range(size - servers, size)), list(range(size - servers))
    shards = size if shards is None else int(shards)
    if not 1 <= shards <= size:
        raise PsrtError(f"--dp ps-sharded: shards must be between 1 and the number of ranks "
                        f"({size}), got {shards}", everywhere=True)
    return list(range(shards)), list(range(size))


def async_layout(size: int, servers: int | None) -> Layout:
    """--dp ps-async: one dedicated server, the last rank."""
    if servers not in (None, 1):
        raise PsrtError(f"--dp ps-async runs one dedicated server rank: use --servers 1 (or "
                        f"leave it out), got --servers {servers}", everywhere=True)
    if size < 2:
        raise PsrtError(f"--dp ps-async needs at least 2 ranks (workers + 1 dedicated server), "
                        f"got {size}", everywhere=True)
    return [size - 1], list(range(size - 1))


def num_workers(strategy: str, size: int, servers: int | None = None) -> int:
    """How many ranks of `size` train with `strategy` (the others serve)."""
    layout = {"ps": ps_layout, "ps-sharded": sharded_layout, "ps-async": async_layout}.get(strategy)
    return size if layout is None else len(layout(size, servers)[1])
