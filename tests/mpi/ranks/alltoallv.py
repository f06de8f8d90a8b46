"""Rank-side: the variable-size all-to-all, every algorithm, against what each rank must get.

Cases: counts drawn at random (the same matrix on every rank), zero counts everywhere but the
diagonal, one rank sending all its rows to one other, rows of 3 bf16 values, counts given
or exchanged by the call (recv_counts=None); how many metadata exchanges each check mode
costs; then, checked, counts that disagree between ranks, a rank that leaves its counts to be
exchanged while the others give theirs, and counts of the wrong length or negative on one
rank, each of which must raise CollectiveMismatch on every rank naming the ranks.  Prints
one PSRT-RESULT line.
"""
import json

import torch

import psrt
from psrt.errors import CollectiveMismatch

world = psrt.init()
group = psrt.Communicator(world.comm)
r, n = world.rank, world.size


def block(src: int, dst: int, rows: int, dtype) -> torch.Tensor:
    """The rows rank src sends to rank dst: values that name both ends."""
    base = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    return (base + 1000 * src + 10 * dst).to(dtype)


def case(name: str, counts: torch.Tensor, dtype=torch.float32) -> list[str]:
    """counts[i][j]: rows rank i sends to rank j."""
    bad = []
    send = torch.cat([block(r, j, int(counts[r][j]), dtype) for j in range(n)])
    want = torch.cat([block(i, r, int(counts[i][r]), dtype) for i in range(n)])
    for algo in ("pairwise", "native"):
        for given in (True, False):
            recv = counts[:, r].tolist() if given else None
            got = group.alltoallv(send, counts[r].tolist(), recv, algorithm=algo)
            if not torch.equal(got, want):
                bad.append(f"{name} {algo} recv_counts {'given' if given else 'exchanged'}")
    return bad


g = torch.Generator().manual_seed(7)
failures = []
failures += case("random", torch.randint(0, 5, (n, n), generator=g))
failures += case("zeros", torch.diag(torch.ones(n, dtype=torch.long)))
failures += case("empty", torch.zeros(n, n, dtype=torch.long))
lopsided = torch.zeros(n, n, dtype=torch.long)
lopsided[0][n - 1] = 50                                      # rank 0 sends everything to the last
failures += case("one rank sends all", lopsided)
failures += case("bf16", torch.randint(0, 4, (n, n), generator=g), torch.bfloat16)
class CountingComm:
    """An mpi4py communicator that counts the exchanges made on it (psrt's metadata)."""

    def __init__(self, comm):
        self._comm, self.calls = comm, 0

    def __getattr__(self, name):
        if name in ("allgather", "alltoall", "bcast", "Iallreduce"):
            self.calls += 1
        return getattr(self._comm, name)


# What checking costs: given counts travel alone except on the calls the check mode checks.
meta_calls = {}
for mode in ("all", "cheap", "off"):
    g = psrt.Communicator(world.comm, check=mode)
    g._meta = g._agreement.meta = CountingComm(g._meta)
    ones = torch.ones(n, n, dtype=torch.long)
    for _ in range(3):
        g.alltoallv(torch.ones(n, 3), ones[r].tolist(), ones[:, r].tolist())
    meta_calls[mode] = g._meta.calls
    g.close()

# Errors on the calls that are checked: one CollectiveMismatch on every rank naming the ranks.
strict = psrt.Communicator(world.comm, check="all")


def error_of(recv) -> str | None:
    try:
        strict.alltoallv(torch.ones(n, 3), [1] * n, recv)
    except CollectiveMismatch as err:
        return str(err)
    return None


errors = {}
if n > 1:
    recv = [1] * n
    if r == 0:
        recv[n - 1] += 1                 # rank 0 expects one row more from the last rank than it sends
    errors["pairs"] = error_of(recv)
    errors["mixed"] = error_of(None if r == 0 else [1] * n)      # rank 0 has the counts exchanged
    errors["length"] = error_of([1] * (n + 1) if r == 1 else [1] * n)
    errors["negative"] = error_of([1] * (n - 1) + [-1] if r == n - 1 else [1] * n)
strict.close()
print("PSRT-RESULT " + json.dumps({"rank": r, "failures": failures, "errors": errors,
                                   "meta_calls": meta_calls}), flush=True)
