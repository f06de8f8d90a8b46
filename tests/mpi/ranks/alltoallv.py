"""Rank-side: the variable-size all-to-all, every algorithm, against what each rank must get.

Cases: counts drawn at random (the same matrix on every rank), zero counts everywhere but the
diagonal, one rank sending all its rows to one other, rows of 3 bf16 values, counts given
or exchanged by the call (recv_counts=None); then counts that disagree between ranks, which
must raise CollectiveMismatch on every rank naming the pair.  Prints one PSRT-RESULT line.
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
# Disagreeing counts: rank 0 expects one row more from the last rank than it sends.
mismatch = None
if n > 1:
    counts = torch.ones(n, n, dtype=torch.long)
    recv = counts[:, r].tolist()
    if r == 0:
        recv[n - 1] += 1
    try:
        group.alltoallv(torch.ones(n, 3), counts[r].tolist(), recv)
    except CollectiveMismatch as err:
        mismatch = str(err)
print("PSRT-RESULT " + json.dumps({"rank": r, "failures": failures, "mismatch": mismatch}), flush=True)
