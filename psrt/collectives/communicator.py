"""`Communicator`: psrt's collectives over torch tensors, with a choice of algorithm.

Every reduction algorithm has one signature, `fn(comm, flat_buffer, op, ...)` working in
place, so ring, recursive doubling, halving-doubling, tree, parameter server, the MPI
library's own and torch.distributed are interchangeable and each can be checked against the
others (the table is implementations.py).  The Communicator does the rest once: argument
checks, staging of non-contiguous and CUDA tensors (see transport.Staging), 'avg' as a sum
divided by N, out-of-place results, and non-blocking calls (see executor).  An all-reduce
runs through the first enabled entry of an ordered table of ways to run it (paths.py); every
call, whatever runs it, goes through one bookkeeping wrapper (`_book`).
"""
from __future__ import annotations

import math
import time
from functools import partial

import torch

from psrt import env
from psrt.collectives import hierarchical, native, paths
from psrt.collectives.implementations import (ALLGATHER as _ALLGATHER,
                                               BROADCAST as _BROADCAST, REDUCE as _REDUCE,
                                               REDUCE_SCATTER as _REDUCE_SCATTER)
from psrt.collectives.agreement import Agreement, agree_shapes
from psrt.collectives.checks import check_out, check_root, row_counts
from psrt.collectives.exchange import Exchanges
from psrt.collectives.executor import Executor, Handle
from psrt.collectives.paths import Call
from psrt.collectives.ready import ReadyCache
from psrt.collectives import nccl, staged_plans
from psrt.collectives.algorithms import ALGORITHMS, ALL_ALGORITHMS, THROUGH_TORCH
from psrt.collectives.layout import offsets, require_mpi_comm
from psrt.collectives.staged import Stager
from psrt.collectives.tuning import Tuning
from psrt.errors import PsrtError
from psrt.trace import OFF, Tracer
from psrt.world import revoke
from psrt.transport import Staging, check_dtype, check_op, mpi_datatype

# the algorithms whose sums the MPI library computes (its own collectives, inside or across hosts)
USER_OP_ALGORITHMS = ("native", "hierarchical")


class Communicator(Exchanges):
    """Collectives over torch tensors on one MPI communicator.

    Args:
        comm: an mpi4py communicator (psrt uses it as given; pass `world.comm`, a private Dup).
        algorithm: default algorithm for every collective ('auto' picks by message size and
            world size from a measured table).  A collective the chosen algorithm does not
            implement uses 'auto'; an algorithm named in a call must implement it.
        tuning: crossover table for 'auto' (default: the one shipped with psrt, or the file
            named by PSRT_TUNING).
        torch_group: torch.distributed group for the 'torch' algorithm (default: the default
            group, which must span the same ranks).
        check: how much to verify that all ranks called the same collective with agreeing
            arguments before it moves data (collectives/agreement.py): 'cheap' (every call
            agrees on a fingerprint of its arguments: one 16-byte all-reduce; default),
            'all' (every call gathers every rank's arguments: a debugging mode) or 'off'.
            PSRT_CHECK overrides the default.  A disagreement raises CollectiveMismatch on
            every rank, naming the ranks and what each passed, instead of hanging, crashing
            or returning garbage.
        tracer: a psrt.trace.Tracer recording every collective as a span (default: none).
        persistent: the small CPU all-reduces made ready once (psrt/collectives/ready.py)
            move their messages with persistent requests (MPI_Send_init / MPI_Recv_init,
            started together) instead of MPI_Sendrecv, MPI_Send and MPI_Recv.  Off by
            default: through mpi4py, MPI_Startall plus MPI_Waitall cost more than the calls
            they replace (`bench collectives --calls inplace,persistent`, Open MPI 4.1, one
            host: 1.1-1.4x the time per call at N = 2 for 4 B and 1 KiB, up to 1.5x at N = 4;
            only ps at N = 4 gained, by under 10%).

    `state` is (call number, collective name, start time or None when idle): a watchdog
    thread may read it to say which rank is stuck where.
    """

    def __init__(self, comm, algorithm: str = "auto", tuning: Tuning | None = None,
                 torch_group=None, check: str | None = None, tracer: Tracer | None = None,
                 persistent: bool = False):
        self.comm = require_mpi_comm(comm, "Communicator")
        self.tracer = tracer or OFF     # every collective a span when on (psrt.trace)
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        if algorithm not in ALL_ALGORITHMS:
            raise PsrtError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALL_ALGORITHMS)}",
                            everywhere=True)
        self.algorithm = algorithm
        self.tuning = tuning or Tuning.load()
        self._torch_group = torch_group
        self._nccl_group = None
        self._staging = Staging()
        self._stager = Stager()
        self._executor = Executor()
        self._auto: dict = {}   # (collective, nbytes) -> algorithm picked by 'auto'
        self.check = check or env.check_mode()
        if self.check not in env.CHECK_MODES:
            raise PsrtError(f"check={self.check!r}: must be one of {', '.join(env.CHECK_MODES)}",
                            everywhere=True)
        # Fingerprints and shape exchanges travel on their own communicator, so they never
        # interleave with the data of a collective still running on the worker thread.
        self._meta = self.comm.Dup()
        self._checked: set = set()
        # Hosts of the ranks now; the two levels' communicators on the first hierarchical call.
        self.topology = hierarchical.Topology.of(self.comm, self._meta)
        self._agreement = Agreement(self._meta, self.check, self.topology.crowd)
        self.calls = 0
        self.state: tuple = (0, "", None)
        self._ready = ReadyCache(self.comm, self._executor, persistent)    # small all-reduces made ready
        self.paths = paths.ALLREDUCE        # the ways of running an all-reduce, asked in order
        # Watched by the process's watchdog (psrt.init starts it): a rank of this group that
        # leaves (sys.exit, an unfinished loop) or stops calling is then named, and the job
        # ends, instead of the others waiting in a call of this group for ever.
        from psrt.watchdog import running_for
        dog = running_for(self.comm)
        if dog is not None:
            dog.watch(self)

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, size={self.size}, algorithm={self.algorithm!r})"

    def close(self) -> None:
        """Stop the worker thread used by non-blocking calls and free the metadata communicator."""
        self._executor.close()
        self._ready.close()
        self.topology.free()
        if self._meta is not None:
            self._meta.Free()
            self._meta = None

    def revoke(self) -> None:
        """After a lost rank (ULFM, psrt.train.in_job): revoke every MPI communicator this one
        uses, so that a rank still waiting in one of them for a live peer returns with
        MPI_ERR_REVOKED instead of waiting for ever (MPI_Comm_revoke reaches every rank of a
        communicator; a Dup is a communicator of its own and is revoked on its own)."""
        for c in [self.comm, self._meta, *self.topology.comms()]:
            if c is not None:
                revoke(c)

    def _verify(self, name: str, shown: tuple = (), **signature):
        """What every rank agrees on before this call moves data (collectives/agreement.py):
        (signature, shown, fingerprint), or None under check='off'.  `shown` pairs are named
        in a mismatch's error only."""
        if self.check == "off":
            return None
        sig = self._agreement.signature(name, signature)
        return sig, shown, self._agreement.fingerprint_of(sig)

    def _agree_now(self, name: str, agreed) -> None:
        """Count a call and run its agreement in this thread, after the calls queued before it
        (for collectives that exchange more on the metadata communicator right after it; their
        data then moves as the same call: `_book(..., new=False)`)."""
        self._book(name, _nothing, (), False, agreed=agreed, traced=False)

    def _book(self, name: str, run, args: tuple, async_op: bool, algo: str | None = None,
              nbytes: int | None = None, agreed=None, path: str | None = None, new: bool = True,
              traced: bool = True):
        """Every call's bookkeeping, once, around whatever moves its data (`run(*args)`): its
        number, then `_tracked` now (nothing queued), after what is queued, or queued (async_op)."""
        if new:
            self.calls += 1
        # A call on CUDA tensors is ordered on the stream current where it is made (as
        # torch.distributed's are): the worker thread runs its copies on that stream, so a
        # caller may gather on a side stream while its own stream computes (zero3's prefetch).
        stream = torch.cuda.current_stream() if async_op and torch.cuda.is_initialized() else None
        if async_op:
            return self._executor.submit(self._tracked, self.calls, name, run, args, algo, nbytes, agreed,
                                         path, traced, stream)
        if self._executor.idle():
            return self._tracked(self.calls, name, run, args, algo, nbytes, agreed, path, traced, None)
        return self._executor.run(self._tracked, self.calls, name, run, args, algo, nbytes, agreed, path,
                                  traced, None)

    def _tracked(self, seq: int, name: str, run, args: tuple, algo, nbytes, agreed, path, traced, stream):
        """The one writer of `state` (what a watchdog reads: a rank waiting in the agreement for
        a peer that never makes the call is named there) and of the call's trace span."""
        self.state = (seq, name, time.monotonic())
        tracer = self.tracer
        t0 = tracer.clock()
        try:
            if agreed is not None:
                self._agreement.agree(seq, *agreed)
            if stream is None:
                return run(*args)
            with torch.cuda.stream(stream):
                return run(*args)
        finally:
            self.state = (seq, name, None)
            if tracer.on and traced:
                extra = {"path": path} if path else {}
                tracer.add(name, "comm", t0, tracer.clock(), algorithm=algo, bytes=nbytes, **extra)

    def pick(self, collective: str, nbytes: int, algorithm: str | None = None) -> str:
        """The algorithm a call of `collective` on `nbytes` runs here (what 'auto' chooses on
        this placement; `algorithm` as a call would name it)."""
        return self._pick(collective, algorithm, nbytes)

    # ------------------------------------------------------------ plumbing
    def _pick(self, collective: str, algorithm: str | None, nbytes: int) -> str:
        table = ALGORITHMS[collective]
        name = algorithm or self.algorithm
        if name != "auto" and name not in table:
            if algorithm is not None:
                raise PsrtError(f"algorithm {name!r} does not implement {collective}; "
                                f"choose one of auto, {', '.join(table)}")
            name = "auto"
        if name == "auto":
            key = (collective, nbytes)
            name = self._auto.get(key)
            if name is None:
                name = self._auto[key] = self.tuning.choose(collective, nbytes, self.size, table,
                                                            self.topology.placement.sizes,
                                                            self.topology.placement.host_of, self.topology.crowd)
        return name

    def _backend_comm(self, algorithm: str):
        if algorithm == "hierarchical":
            return self.topology
        if algorithm == "nccl":
            if self._nccl_group is None:
                self._nccl_group = nccl.group(self._meta or self.comm)
            return self._nccl_group
        if algorithm != "torch":
            return self.comm
        import torch.distributed as dist
        if not dist.is_initialized():
            raise PsrtError("algorithm 'torch' needs torch.distributed: call "
                            "psrt.init_torch_distributed(world) first")
        group = self._torch_group or dist.group.WORLD
        if dist.get_world_size(group) != self.size:
            raise PsrtError(f"algorithm 'torch' needs a torch group of {self.size} ranks "
                            f"(pass torch_group=); the default group has {dist.get_world_size(group)}")
        return group

    def _on_device_ok(self, t: torch.Tensor, algo: str) -> bool:
        """Whether the algorithm can work on t's memory where it is (CPU, CUDA-aware MPI, nccl).

        A 16-bit float summed by the MPI library itself runs psrt's user-defined op
        (transport.mpi_op), whose body reads host memory: such calls stay staged."""
        if not t.is_cuda or algo in THROUGH_TORCH:
            return True
        return self._staging.direct_cuda and not (algo in USER_OP_ALGORITHMS and mpi_datatype(t.dtype) is None)

    def _staged(self, t: torch.Tensor, algo: str) -> bool:
        """Whether a call on t runs in pieces through pinned host slots (staged_plans.py)."""
        return not self._on_device_ok(t, algo)

    def _work(self, src: torch.Tensor, algo: str = "native", direct: torch.Tensor | None = None):
        """A flat buffer the algorithm can use holding src's values: `direct`'s own memory when
        it is usable, else a copy (staged to pinned host memory for CUDA without CUDA-aware MPI)."""
        if direct is not None and direct.is_contiguous() and self._on_device_ok(direct, algo):
            flat = direct.view(-1)
            if flat.data_ptr() != src.data_ptr() or not src.is_contiguous():
                flat.copy_(src.reshape(-1))
            return flat
        if not self._on_device_ok(src, algo):
            return self._staging.host_buffer(src).copy_(src.reshape(-1))
        return src.reshape(-1).clone() if src.is_contiguous() else src.contiguous().view(-1)

    def _run(self, name: str, fn, async_op: bool, algo: str | None = None, nbytes: int | None = None,
             agreed=None, new: bool = True):
        return self._book(name, fn, (), async_op, algo, nbytes, agreed, new=new)

    # ------------------------------------------------------------ reductions
    def allreduce(self, t: torch.Tensor, op: str = "sum", out: torch.Tensor | None = None,
                  algorithm: str | None = None, async_op: bool = False):
        """Reduce t over all ranks; every rank gets the result.

        Out of place by default; `out=t` reduces in place.  Returns the result, or a Handle
        whose wait() returns it when async_op.
        """
        ready = self._ready.lookup(t, out, op, algorithm)     # made ready by an earlier call
        if ready is not None:
            return self._book("allreduce", ready.call, (t, out), async_op, ready.algo, ready.bytes,
                              ready.agreed, "ready")
        check_dtype(t)
        check_op(op, t.dtype)
        check_out(out, t.shape, t.dtype, "allreduce")
        c = Call(t, out, op, algorithm, async_op)
        c.nbytes = t.numel() * t.element_size()
        c.algo = self._pick("allreduce", algorithm, c.nbytes)
        c.agreed = self._verify("allreduce", (("shape", tuple(t.shape)),), op=op, dtype=t.dtype,
                                numel=t.numel(), algorithm=c.algo)
        path = next(p for p in self.paths if p.enabled(self, c))
        return self._book("allreduce", path.run, (self, c), async_op, c.algo, c.nbytes, c.agreed, path.name)

    def reduce_scatter(self, t: torch.Tensor, op: str = "sum", out: torch.Tensor | None = None,
                       counts=None, algorithm: str | None = None, async_op: bool = False):
        """Reduce t over all ranks and leave rank r with rows counts[r] of the result.

        t is split along dim 0 (default: as evenly as possible, larger parts first).
        """
        check_dtype(t)
        check_op(op, t.dtype)
        counts = row_counts(t, counts, self.size, "reduce_scatter")
        row = math.prod(t.shape[1:]) if t.dim() > 1 else 1
        elems = [c * row for c in counts]
        shape = (counts[self.rank],) + tuple(t.shape[1:])
        check_out(out, shape, t.dtype, "reduce_scatter")
        algo = self._pick("reduce_scatter", algorithm, t.numel() * t.element_size())
        agreed = self._verify("reduce_scatter", op=op, dtype=t.dtype, shape=tuple(t.shape), counts=tuple(counts),
                     algorithm=algo)
        fn = _REDUCE_SCATTER[algo]

        def run():
            if self._staged(t, algo):
                return staged_plans.reduce_scatter_call(self, t, elems, shape, op,
                                                        partial(fn, self._backend_comm(algo)), out)
            flat = self._work(t, algo)
            fn(self._backend_comm(algo), flat, elems, op)
            off = offsets(elems)
            mine = flat[off[self.rank]:off[self.rank + 1]].view(shape)
            if op == "avg":
                mine.div_(self.size)
            result = out if out is not None else torch.empty(shape, dtype=t.dtype, device=t.device)
            return result.copy_(mine)
        return self._run('reduce_scatter', run, async_op, algo, agreed=agreed)

    def reduce(self, t: torch.Tensor, root: int = 0, op: str = "sum", out: torch.Tensor | None = None,
               algorithm: str | None = None, async_op: bool = False):
        """Reduce t onto `root`; returns the result there and None elsewhere."""
        check_dtype(t)
        check_op(op, t.dtype)
        check_root(root, self.size, "reduce")
        check_out(out, t.shape, t.dtype, "reduce")
        algo = self._pick("reduce", algorithm, t.numel() * t.element_size())
        agreed = self._verify("reduce", (("shape", tuple(t.shape)),), op=op, root=root, dtype=t.dtype, numel=t.numel(), algorithm=algo)
        fn = _REDUCE[algo]

        def run():
            if self._staged(t, algo):
                return staged_plans.reduce_call(self, t, root, op, partial(fn, self._backend_comm(algo)), out)
            result = out if (out is not None and self.rank == root) else None
            flat = self._work(t, algo, direct=result)
            fn(self._backend_comm(algo), flat, root, op)
            if self.rank != root:
                return None
            if op == "avg":
                flat.div_(self.size)
            return Staging.from_mpi(flat, result if result is not None else torch.empty_like(t))
        return self._run('reduce', run, async_op, algo, agreed=agreed)

    # ------------------------------------------------------------ data movement
    def broadcast(self, t: torch.Tensor, root: int = 0, algorithm: str | None = None,
                  async_op: bool = False):
        """Copy root's t into t on every rank (in place); returns t."""
        check_dtype(t)
        check_root(root, self.size, "broadcast")
        algo = self._pick("broadcast", algorithm, t.numel() * t.element_size())
        agreed = self._verify("broadcast", (("shape", tuple(t.shape)),), root=root, dtype=t.dtype, numel=t.numel(), algorithm=algo)
        fn = _BROADCAST[algo]

        def run():
            if self._staged(t, algo):
                return staged_plans.broadcast_call(self, t, root, partial(fn, self._backend_comm(algo)))
            flat = self._work(t, algo, direct=t)
            fn(self._backend_comm(algo), flat, root)
            return Staging.from_mpi(flat, t)
        return self._run('broadcast', run, async_op, algo, agreed=agreed)

    def allgather(self, t: torch.Tensor, out: torch.Tensor | None = None, counts=None,
                  algorithm: str | None = None, async_op: bool = False):
        """Concatenate every rank's t along dim 0, in rank order, on every rank.

        Ranks may contribute different numbers of rows; pass `counts` (rows per rank) to skip
        the exchange of shapes, or leave it None to have psrt exchange and check them.
        """
        check_dtype(t)
        if t.dim() == 0:
            t = t.reshape(1)
        if counts is not None and (len(counts) != self.size or counts[self.rank] != t.shape[0]):
            raise PsrtError(f"allgather: counts {list(counts)} do not fit {self.size} ranks with "
                            f"this rank's {t.shape[0]} rows")
        # Agreed first (dim 0 may differ), so that the shapes exchange below is the same call
        # on every rank; then the agreed counts make the transfer safe.
        agreed = self._verify("allgather", (("shape", tuple(t.shape)),), dtype=t.dtype, row=tuple(t.shape[1:]),
                             counts="exchanged" if counts is None else tuple(counts),
                             algorithm=algorithm or self.algorithm)
        new = True
        if counts is None:
            self._agree_now("allgather", agreed)
            agreed, new = None, False
            counts = [s[0] for s in agree_shapes(self._meta, t, "allgather")]
        row = math.prod(t.shape[1:])
        elems = [c * row for c in counts]
        shape = (sum(counts),) + tuple(t.shape[1:])
        check_out(out, shape, t.dtype, "allgather")
        algo = self._pick("allgather", algorithm, sum(elems) * t.element_size())
        fn = _ALLGATHER[algo]

        def run():
            if self._staged(t, algo):
                return staged_plans.allgather_call(self, t, elems, shape, partial(fn, self._backend_comm(algo)), out)
            result = out if out is not None else torch.empty(shape, dtype=t.dtype, device=t.device)
            if result.is_contiguous() and self._on_device_ok(result, algo):
                flat = result.view(-1)
            elif result.is_cuda:
                flat = self._staging.host_buffer(result)
            else:
                flat = torch.empty(sum(elems), dtype=t.dtype)
            off = offsets(elems)
            flat[off[self.rank]:off[self.rank + 1]].copy_(t.reshape(-1))
            fn(self._backend_comm(algo), flat, elems)
            return Staging.from_mpi(flat, result)
        return self._run('allgather', run, async_op, algo, agreed=agreed, new=new)

    def gather(self, t: torch.Tensor, root: int = 0, async_op: bool = False):
        """Concatenate every rank's t along dim 0 on `root` (uneven rows allowed); None elsewhere."""
        check_dtype(t)
        check_root(root, self.size, "gather")
        if t.dim() == 0:
            t = t.reshape(1)
        self._agree_now("gather", self._verify("gather", root=root, dtype=t.dtype, row=tuple(t.shape[1:])))
        shapes = agree_shapes(self._meta, t, "gather")
        row = math.prod(t.shape[1:])
        elems = [s[0] * row for s in shapes]

        def run():
            send = self._work(t)
            recv = torch.empty(sum(elems), dtype=t.dtype, device=send.device) if self.rank == root else None
            native.gather(self.comm, send, recv, elems, root)
            if recv is None:
                return None
            return recv.view((sum(s[0] for s in shapes),) + tuple(t.shape[1:])).to(t.device)
        return self._run('gather', run, async_op, new=False)

    def scatter(self, t: torch.Tensor | None, root: int = 0, counts=None, async_op: bool = False):
        """Split root's t along dim 0 (by `counts` rows, default even) and give rank r part r.

        Only the root's t is read; other ranks may pass None."""
        check_root(root, self.size, "scatter")
        self._agree_now("scatter", self._verify("scatter", root=root))
        meta = None
        if self.rank == root:
            if t is None:
                raise PsrtError(f"scatter: the root (rank {root}) must pass a tensor")
            check_dtype(t)
            counts = row_counts(t, counts, self.size, "scatter")
            meta = (counts, tuple(t.shape[1:]), t.dtype)
        counts, tail, dtype = self._meta.bcast(meta, root=root)
        row = math.prod(tail)
        elems = [c * row for c in counts]

        def run():
            send = self._work(t) if self.rank == root else None
            recv = torch.empty(elems[self.rank], dtype=dtype)
            native.scatter(self.comm, send, recv, elems, root)
            device = t.device if t is not None else "cpu"
            return recv.view((counts[self.rank],) + tail).to(device)
        return self._run('scatter', run, async_op, new=False)

    def barrier(self, async_op: bool = False):
        agreed = self._verify("barrier")

        def run():
            self.comm.Barrier()
        return self._run('barrier', run, async_op, agreed=agreed)



def _nothing() -> None:
    return None


__all__ = ["Communicator", "Handle", "ALGORITHMS", "ALL_ALGORITHMS"]
