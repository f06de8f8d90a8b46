"""The ways of running an all-reduce, as an ordered table: the first entry enabled for a call
runs it (Horovod's OperationManager: an ordered list of implementations, each with Enabled()).

An entry is any object with

- `name`: a short word, the `path` of the trace span of every call it runs (a call made
  ready before is traced as 'ready');
- `enabled(group, call) -> bool`: whether it runs this `Call` on `group` (a Communicator).
  Cheap (attribute checks, a dict lookup): it is asked on every call.  It runs in the
  caller's thread, so it may prepare what `run` needs and keep it on the call (`call.ready`);
- `run(group, call)`: move the data and return the result.  Nothing else: the Communicator
  wraps whichever entry runs, once, in its bookkeeping (the call's number, `state` for the
  watchdog, the trace span, the agreement of every rank on the call, and running it now,
  after the calls queued before it, or queued when `async_op`).

A call that an entry made ready before (psrt/collectives/ready.py) skips the table and its
argument checks, which it passed when it was made, as Horovod's response cache skips the
negotiation: `Communicator.allreduce` looks it up first, and asks its table (`group.paths`,
`ALLREDUCE` unless replaced) in order only on a miss; the last entry, `General`, takes every
call.  A new way of running an all-reduce (a GPU staging path, a two-level path for several
hosts) is one more entry in `ALLREDUCE`, placed before the entries it must overtake; for an
algorithm of its own, `enabled` answers `call.algo == "NAME"`.  The other collectives have
one way each (their algorithm's function, in implementations.py), run through the same
bookkeeping; one that gains a second way gets a table of its own, the same way.
"""
from __future__ import annotations

from functools import partial

import numpy as np
import torch

from psrt.collectives import native, small, staged_plans
from psrt.collectives.algorithms import THROUGH_TORCH
from psrt.collectives.implementations import ALLGATHER as _GATHER, ALLREDUCE as _FUNCTIONS, READS_SOURCE
from psrt.collectives.ready import ReadyCache
from psrt.transport import Staging, np_view

# dtypes the MPI library reduces itself (no user-defined op), eligible for the lean path
_MPI_TYPED = frozenset({torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8, torch.int8})


class Call:
    """One all-reduce as the entries see it.  `algo` and `nbytes` are set once the arguments
    are checked (or by the entry that ran a prepared call); `agreed` is what the ranks agree
    on before the call moves data (None: nothing)."""

    __slots__ = ("t", "out", "op", "algorithm", "async_op", "algo", "nbytes", "agreed", "ready")

    def __init__(self, t: torch.Tensor, out, op: str, algorithm, async_op: bool):
        self.t, self.out, self.op, self.algorithm, self.async_op = t, out, op, algorithm, async_op
        self.algo = self.nbytes = self.agreed = self.ready = None

    def cpu_contiguous(self) -> bool:
        t, out = self.t, self.out
        return (t.is_contiguous() and not t.is_cuda
                and (out is None or out.is_contiguous() and not out.is_cuda))


def _small(c: Call) -> bool:
    """A CPU all-reduce the NumPy schedules take (collectives/small.py)."""
    return not c.t.is_cuda and c.t.dtype in small.DTYPES and small.takes(c.algo, c.nbytes)


class MakeReady:
    """A small CPU all-reduce the ready cache does not hold yet: made ready (kept for the calls
    after it, which find it before the table is asked), then run.  Not under check='all',
    whose every call gathers its arguments anyway."""

    name = "make-ready"

    def enabled(self, group, c: Call) -> bool:
        if not (c.algo in small.FAST and group.check != "all" and _small(c) and c.cpu_contiguous()):
            return False
        key = ReadyCache.key(c.t, c.out, c.op, c.algorithm)
        c.ready = group._ready.add(key, c.t, c.out, c.op, c.algorithm, c.algo, c.agreed)
        return True

    def run(self, group, c: Call):
        return c.ready.call(c.t, c.out)


class SmallOnce:
    """A small CPU all-reduce not made ready (non-contiguous tensors, check='all'): psrt's
    schedule on NumPy views, once."""

    name = "small"

    def enabled(self, group, c: Call) -> bool:
        return c.algo in small.ALLREDUCE and _small(c)

    def run(self, group, c: Call):
        t = c.t
        result = c.out if c.out is not None else torch.empty_like(t, memory_format=torch.contiguous_format)
        target = result if result.is_contiguous() else torch.empty_like(result, memory_format=torch.contiguous_format)
        if target.data_ptr() != t.data_ptr() or not t.is_contiguous():
            target.copy_(t)
        a = np_view(target).reshape(-1)
        small.allreduce(c.algo, group.comm, a, small.UFUNCS[c.op])
        if c.op == "avg":
            np.divide(a, group.size, out=a)
        if target is not result:
            result.copy_(target)
        return result


class NativeInto:
    """The MPI library's all-reduce writing the output tensor directly (no staging copy), for
    contiguous CPU tensors of a type MPI reduces itself: what keeps it close to the bare call."""

    name = "native"

    def enabled(self, group, c: Call) -> bool:
        return c.algo == "native" and c.t.dtype in _MPI_TYPED and c.cpu_contiguous()

    def run(self, group, c: Call):
        result = c.out if c.out is not None else torch.empty_like(c.t)
        native.allreduce_into(group.comm, c.t, result, c.op)
        return result.div_(group.size) if c.op == "avg" else result


class Staged:
    """A CUDA all-reduce through an MPI that cannot read GPU memory: chunks through pinned
    host slots, copies down and up overlapping the host reduction of the chunk between them
    (collectives/staged.py).  Each chunk is reduced with the call's algorithm; or, with
    PSRT_STAGED_REDUCE=gpu, all-gathered by the algorithm's all-gather (the MPI library's for
    one that has none) and summed on the GPU."""

    name = "staged"

    def enabled(self, group, c: Call) -> bool:
        return c.t.is_cuda and c.algo not in THROUGH_TORCH and not group._staging.direct_cuda

    def run(self, group, c: Call):
        t, op, size = c.t, c.op, group.size
        fn, comm = _FUNCTIONS[c.algo], group._backend_comm(c.algo)
        result = c.out if c.out is not None else torch.empty_like(t, memory_format=torch.contiguous_format)
        dst = result.view(-1) if result.is_contiguous() else torch.empty(t.numel(), dtype=t.dtype, device=t.device)

        def reduce_chunk(host: torch.Tensor) -> None:
            fn(comm, host, op)
            if op == "avg":
                host.div_(size)

        src, stager = t.contiguous().view(-1), group._stager
        per = stager.pool.elements(t.dtype)
        if stager.reduce_on == "gpu":       # PSRT_STAGED_REDUCE=gpu: the host only moves data
            gather = _GATHER.get(c.algo)
            gather = partial(gather, comm) if gather else partial(native.allgather, group.comm)
            pieces = staged_plans.allreduce_on_gpu(src, dst, per, group.rank, size, op, gather,
                                                   partial(stager.scratch, t.device, t.dtype))
        else:
            pieces = staged_plans.allreduce(src, dst, per, reduce_chunk)
        stager.run(pieces, t.dtype, t.device, dst)
        return Staging.from_mpi(dst, result)


class General:
    """Every other call: the algorithm's torch implementation on a flat buffer (the tensor's
    own memory where it can, else a copy staged for it; see Communicator._work)."""

    name = "general"

    def enabled(self, group, c: Call) -> bool:
        return True

    def run(self, group, c: Call):
        t, algo, op = c.t, c.algo, c.op
        fn = _FUNCTIONS[algo]
        result = c.out if c.out is not None else torch.empty_like(t, memory_format=torch.contiguous_format)
        if (algo in READS_SOURCE and t.is_contiguous() and result.is_contiguous()
                and group._on_device_ok(t, algo) and t.data_ptr() != result.data_ptr()):
            flat = result.view(-1)   # out of place without a staging copy of the input
            fn(group.comm, flat, op, src=t.reshape(-1))
        else:
            flat = group._work(t, algo, direct=result)
            fn(group._backend_comm(algo), flat, op)
        if op == "avg":
            flat.div_(group.size)
        return Staging.from_mpi(flat, result)


ALLREDUCE = (MakeReady(), SmallOnce(), NativeInto(), Staged(), General())
