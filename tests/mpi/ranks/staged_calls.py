"""Rank-side helper: every collective's staged path (psrt/collectives/staged_plans.py) on the
CPU, its copy lanes running every copy late (late_lanes.py) through host slots of 256 bytes,
so each call runs as many pieces with partial last columns and blocks split into several
messages.  Each staged call is compared with the same call on a Communicator that does not
stage (itself checked against references elsewhere): reduce-scatter and all-gather with
uneven counts (a rank with none included), broadcast and reduce from each root, all-to-all
and all-to-all-v (pairwise; native stays whole) with empty and large blocks, in three dtypes, out of place, into a held
output and from a non-contiguous input."""
import torch

import psrt
from psrt.collectives.algorithms import ALGORITHMS, THROUGH_TORCH
from psrt.collectives.staged import Pool, Stager
from late_lanes import LateLanes


class StagingOnCpu(psrt.Communicator):
    """Stages every call that is not torch's, CPU tensors included, so its pieces run here."""

    def _staged(self, t, algo) -> bool:
        return algo not in THROUGH_TORCH


def _rows(rank: int, rows: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 101 + rank)
    return torch.randint(-4, 5, (rows, 3), generator=g).to(dtype)


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=1e-2, atol=1e-2)


def check(comm) -> tuple[list[str], int]:
    """(failures, calls compared)."""
    staged = StagingOnCpu(comm)
    staged._stager = Stager(Pool(chunk_bytes=256, pin=False), lanes_for=LateLanes)
    plain = psrt.Communicator(comm)
    r, n = staged.rank, staged.size
    failures, checked = [], 0

    def compare(name, call):
        nonlocal checked
        checked += 1
        want, got = call(plain), call(staged)
        if not _same(got, want):
            failures.append(name)

    counts = [0 if j == 1 else 7 + 13 * j for j in range(n)]   # uneven, one rank with none
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        ops = ("sum", "max") + (("avg",) if dtype.is_floating_point else ())
        whole = _rows(r, sum(counts), dtype, 1)
        wide = torch.zeros(sum(counts), 6, dtype=dtype)
        wide[:, ::2] = whole                                      # the same values, not contiguous
        for algo in ALGORITHMS["reduce_scatter"]:
            if algo in THROUGH_TORCH:
                continue
            for op in ops:
                compare(f"reduce_scatter {algo} {op} {dtype}",
                        lambda g: g.reduce_scatter(wide[:, ::2], op=op, counts=counts, algorithm=algo))
                held = torch.empty(counts[r], 3, dtype=dtype)
                compare(f"reduce_scatter out {algo} {op} {dtype}",
                        lambda g: g.reduce_scatter(whole, op=op, out=held, counts=counts, algorithm=algo).clone())
        mine = _rows(r, counts[r], dtype, 2)
        for algo in ALGORITHMS["allgather"]:
            if algo not in THROUGH_TORCH:
                compare(f"allgather {algo} {dtype}", lambda g: g.allgather(mine, counts=counts, algorithm=algo))
        x = _rows(r, 40, dtype, 3)
        for root in range(n):
            for algo in (a for a in ALGORITHMS["broadcast"] if a not in THROUGH_TORCH):
                compare(f"broadcast {algo} root {root} {dtype}", lambda g: g.broadcast(x.clone(), root=root, algorithm=algo))
            for algo in (a for a in ALGORITHMS["reduce"] if a not in THROUGH_TORCH):
                for op in ops:
                    compare(f"reduce {algo} {op} root {root} {dtype}",
                            lambda g: g.reduce(x, root=root, op=op, algorithm=algo))
        # all-to-all-v: rank r sends (r + j) % 3 * 9 rows to rank j (none, 9 or 18 rows of 3:
        # blocks up to 216 bytes of int64, several messages through half a 256-byte slot)
        send_counts = [(r + j) % 3 * 9 for j in range(n)]
        recv_counts = [(j + r) % 3 * 9 for j in range(n)]
        t = _rows(r, sum(send_counts), dtype, 4)
        for algo in ALGORITHMS["alltoallv"]:
            compare(f"alltoallv {algo} {dtype}", lambda g: g.alltoallv(t, send_counts, algorithm=algo))
            compare(f"alltoallv given {algo} {dtype}",
                    lambda g: g.alltoallv(t, send_counts, recv_counts, algorithm=algo))
        compare(f"alltoall {dtype}", lambda g: g.alltoall(_rows(r, 5 * n, dtype, 5)))
    staged.close()
    plain.close()
    return failures, checked
