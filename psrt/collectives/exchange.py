"""All-to-all exchanges of a Communicator (a mixin of communicator.Communicator): every rank
sends a part of its tensor to every other, in equal blocks (`alltoall`) or in counts that may
differ per pair and per call (`alltoallv`, a mixture-of-experts dispatch)."""
from __future__ import annotations

import math

import torch

from psrt.collectives import native, staged_plans
from psrt.collectives.agreement import agree_pairs
from psrt.collectives.algorithms import ALGORITHMS
from psrt.collectives.checks import check_out
from psrt.collectives.implementations import ALLTOALLV as _ALLTOALLV
from psrt.errors import PsrtError
from psrt.transport import Staging, check_dtype


class Exchanges:
    """alltoall and alltoallv over the Communicator's plumbing (_verify, _run, _work, ...)."""

    def alltoall(self, t: torch.Tensor, out: torch.Tensor | None = None, async_op: bool = False):
        """Rank r sends block j of t (dim 0 split in `size` equal blocks) to rank j, and
        receives rank j's block r as its block j."""
        check_dtype(t)
        rows = t.shape[0] if t.dim() else 1
        if rows % self.size:
            raise PsrtError(f"alltoall: dim 0 of the input ({rows}) must divide by the number "
                            f"of ranks ({self.size})")
        check_out(out, t.shape, t.dtype, "alltoall")
        agreed = self._verify("alltoall", dtype=t.dtype, shape=tuple(t.shape))

        def run():
            if self._staged(t, "native"):
                block = [t.numel() // self.size] * self.size
                return staged_plans.alltoallv_call(self, t, block, block, t.shape, out)
            send = self._work(t)
            recv = torch.empty_like(send)
            native.alltoall(self.comm, send, recv)
            result = out if out is not None else torch.empty_like(t, memory_format=torch.contiguous_format)
            return Staging.from_mpi(recv, result)
        return self._run('alltoall', run, async_op, agreed=agreed)

    def alltoallv(self, t: torch.Tensor, send_counts, recv_counts=None, out: torch.Tensor | None = None,
                  algorithm: str | None = None, async_op: bool = False):
        """Rank r sends rows send_counts[j] of t (dim 0, in order) to rank j and receives
        recv_counts[j] rows from it, concatenated in rank order.

        recv_counts=None: the counts are exchanged first (an all-to-all of N integers), as a
        mixture-of-experts dispatch needs when every step routes differently.  Given, nothing
        travels but the rows; on the calls the check mode checks (`check`: every call under
        'all', the first under 'cheap'), every rank's counts are gathered and any pair that
        disagrees, or a rank whose counts are malformed or that gives none where the others
        do, is one CollectiveMismatch on every rank naming them.  Unchecked, a mismatch cannot
        hang silently either: the exchange is a call the watchdog names (psrt.watchdog).
        algorithm: 'pairwise' (psrt's, collectives/alltoall.py) or 'native' (MPI_Alltoallv);
        default: the communicator's, where it is one of these, else native.
        """
        check_dtype(t)
        rows = t.shape[0] if t.dim() else 1
        send_counts = [int(c) for c in send_counts]
        if len(send_counts) != self.size or sum(send_counts) != rows or min(send_counts) < 0:
            raise PsrtError(f"alltoallv: send counts {send_counts} must be {self.size} non-negative "
                            f"numbers adding up to dim 0 of the input ({rows})")
        table = ALGORITHMS["alltoallv"]
        if algorithm is not None and algorithm not in table:
            raise PsrtError(f"algorithm {algorithm!r} does not implement alltoallv; choose one of {', '.join(table)}")
        algo = algorithm or (self.algorithm if self.algorithm in table else "native")
        tail = tuple(t.shape[1:])
        # every rank's counts are compared on the first call under 'cheap', on every one under 'all'
        checked = self.check == "all" or (self.check == "cheap" and "alltoallv" not in self._checked)
        self._checked.add("alltoallv")
        self._agree_now("alltoallv", self._verify("alltoallv", dtype=t.dtype, row=tail, algorithm=algo,
                                     recv_counts="exchanged" if recv_counts is None else "given"))
        if recv_counts is None:
            recv_counts = self._exchange_counts(send_counts)
        else:
            recv_counts = [int(c) for c in recv_counts]
            if checked:       # every rank's counts, so every rank names the same culprits
                agree_pairs(self._meta, send_counts, recv_counts)
            elif len(recv_counts) != self.size or min(recv_counts) < 0:
                raise PsrtError(f"alltoallv: receive counts {recv_counts} must be {self.size} "
                                "non-negative numbers")
        shape = (sum(recv_counts),) + tail
        check_out(out, shape, t.dtype, "alltoallv")
        row = math.prod(tail)
        fn = _ALLTOALLV[algo]

        def run():
            if algo == "pairwise" and self._staged(t, algo):     # native: MPI_Alltoallv on a whole copy
                return staged_plans.alltoallv_call(self, t, [c * row for c in send_counts],
                                                   [c * row for c in recv_counts], shape, out)
            # The input is only read and the output only written: MPI uses their own memory
            # where it can (no copies of a large MoE dispatch), else staged copies.
            send = t.reshape(-1) if t.is_contiguous() and self._on_device_ok(t, algo) else self._work(t)
            result = out if out is not None else torch.empty(shape, dtype=t.dtype, device=t.device)
            direct = result.is_contiguous() and self._on_device_ok(result, algo)
            recv = result.view(-1) if direct else torch.empty(sum(recv_counts) * row, dtype=t.dtype,
                                                               device=send.device)
            fn(self.comm, send, [c * row for c in send_counts], recv, [c * row for c in recv_counts])
            return result if direct else Staging.from_mpi(recv, result)
        return self._run('alltoallv', run, async_op, algo, sum(send_counts) * row * t.element_size(), new=False)

    def _exchange_counts(self, send_counts: list[int]) -> list[int]:
        """What every rank sends to this one, as a call the watchdog sees: a rank that gave
        its receive counts while this one did not is not in this exchange, and the job's
        report then says who waits where instead of hanging without a word."""
        return self._book("alltoallv", self._meta.alltoall, (send_counts,), False, new=False, traced=False)
