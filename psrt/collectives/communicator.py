"""`Communicator`: psrt's collectives over torch tensors, with a choice of algorithm.

Every reduction algorithm has one signature, `fn(comm, flat_buffer, op, ...)` working in
place, so ring, recursive doubling, halving-doubling, tree, parameter server, the MPI
library's own and torch.distributed are interchangeable and each can be checked against the
others.  The Communicator does the rest once: argument checks, staging of non-contiguous
and CUDA tensors (see transport.Staging), 'avg' as a sum divided by N, out-of-place results,
and non-blocking calls (see executor).
"""
from __future__ import annotations

import contextlib
import math
import time

import numpy as np
import torch

from psrt import env
from psrt.collectives import alltoall, hierarchical, native, ps, recursive, ring, small, torch_backend, tree
from psrt.collectives.agreement import Agreement
from psrt.collectives.executor import Executor, Handle
from psrt.collectives.ready import ReadyCache
from psrt.collectives.algorithms import ALGORITHMS, ALL_ALGORITHMS
from psrt.collectives.layout import even_counts, offsets, require_mpi_comm
from psrt.collectives.tuning import Tuning
from psrt.errors import CollectiveMismatch, PsrtError
from psrt.trace import OFF, Tracer
from psrt.transport import Staging, check_dtype, check_op, np_view

# collective -> algorithm -> implementation (comm, buf, ...) in place on a flat buffer.
_ALLREDUCE = {
    "ring": lambda c, b, op, src=None: ring.allreduce(c, b, op, even_counts(b.numel(), c.size), src=src),
    "doubling": recursive.allreduce_doubling,
    "halving-doubling": recursive.allreduce_halving_doubling,
    "tree": tree.allreduce,
    "ps": ps.allreduce,
    "hierarchical": hierarchical.allreduce,
    "native": native.allreduce,
    "torch": torch_backend.allreduce,
}
_REDUCE_SCATTER = {"ring": ring.reduce_scatter, "ps": ps.reduce_scatter,
                   "hierarchical": hierarchical.reduce_scatter, "native": native.reduce_scatter, "torch": torch_backend.reduce_scatter}
_ALLGATHER = {"ring": ring.allgather, "ps": ps.allgather, "hierarchical": hierarchical.allgather,
              "native": native.allgather,
              "torch": torch_backend.allgather}
_BROADCAST = {"tree": tree.broadcast, "ps": ps.broadcast, "hierarchical": hierarchical.broadcast,
              "native": native.broadcast,
              "torch": torch_backend.broadcast}
_REDUCE = {"tree": tree.reduce, "ps": ps.reduce, "native": native.reduce,
           "torch": torch_backend.reduce}

# allreduce algorithms that can read their input from a separate source tensor
_READS_SOURCE = frozenset({"ring"})
# dtypes the MPI library reduces itself (no user-defined op), eligible for the lean path
_MPI_TYPED = frozenset({torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8, torch.int8})

_ALLTOALLV = {"pairwise": alltoall.pairwise, "native": native.alltoallv}
_IMPLEMENTATIONS = {"allreduce": _ALLREDUCE, "reduce_scatter": _REDUCE_SCATTER, "allgather": _ALLGATHER,
                    "broadcast": _BROADCAST, "reduce": _REDUCE, "alltoallv": _ALLTOALLV}


class Communicator:
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
        self._staging = Staging()
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
        self._agreement = Agreement(self._meta, self.check)
        # Hosts of the ranks now; the two levels' communicators on the first hierarchical call.
        self.topology = hierarchical.Topology.of(self.comm, self._meta)
        self.calls = 0
        self.state: tuple = (0, "", None)
        self._ready = ReadyCache(self, self._executor, persistent)    # small all-reduces made ready

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

    def _verify(self, name: str, shown: tuple = (), **signature):
        """Count this call and return its agreement (collectives/agreement.py): a function that
        returns once every rank makes the same call, or raises CollectiveMismatch on every
        rank; None under check='off'.  It runs where the call runs, in order with the calls
        queued before it, so a non-blocking call returns at once and fails at its wait();
        `shown` pairs are named in the error only."""
        self.calls += 1
        if self.check == "off":
            return None
        return self._agreeing(self._agreement.signature(name, signature), shown)

    def _agreeing(self, sig: tuple, shown: tuple = (), fp: int | None = None):
        seq, agreement = self.calls, self._agreement

        def agree():
            # Where a rank whose peer never makes the call waits: the watchdog names it.
            self.state = (seq, sig[0], time.monotonic())
            agreement.agree(seq, sig, shown, fp)
        return agree

    def _agree_now(self, agree) -> None:
        """Run an agreement in this thread, after the calls queued before it (for collectives
        that exchange more on the metadata communicator right after it)."""
        if agree is not None:
            self._executor.run(agree)
            self.state = (self.state[0], self.state[1], None)

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
                                                            self.topology.placement.sizes)
        return name

    def _backend_comm(self, algorithm: str):
        if algorithm == "hierarchical":
            return self.topology
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
        """Whether the algorithm can work on t's memory where it is (CPU, CUDA-aware MPI, nccl)."""
        return not t.is_cuda or algo == "torch" or self._staging.direct_cuda

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
             agree=None):
        seq = self.calls
        # A call on CUDA tensors is ordered on the stream current where it is made (as
        # torch.distributed's are): the worker thread runs its copies on that stream, so a
        # caller may gather on a side stream while its own stream computes (zero3's prefetch).
        stream = torch.cuda.current_stream() if torch.cuda.is_initialized() else None

        def tracked():
            self.state = (seq, name, time.monotonic())
            t0 = self.tracer.clock()
            try:
                if agree is not None:
                    agree()
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    return fn()
            finally:
                self.state = (seq, name, None)
                if self.tracer.on:
                    self.tracer.add(name, "comm", t0, self.tracer.clock(), algorithm=algo, bytes=nbytes)
        return self._executor.submit(tracked) if async_op else self._executor.run(tracked)

    @staticmethod
    def _check_out(out: torch.Tensor | None, shape, dtype, what: str) -> None:
        if out is not None and (tuple(out.shape) != tuple(shape) or out.dtype != dtype):
            raise PsrtError(f"{what}: out has shape {tuple(out.shape)} and dtype {out.dtype}, "
                            f"expected {tuple(shape)} and {dtype}")

    def _rows(self, t: torch.Tensor, counts, what: str) -> list[int]:
        rows = t.shape[0] if t.dim() else 1
        counts = list(counts) if counts is not None else even_counts(rows, self.size)
        if len(counts) != self.size or sum(counts) != rows or min(counts) < 0:
            raise PsrtError(f"{what}: counts {counts} must be {self.size} non-negative numbers "
                            f"adding up to dim 0 of the input ({rows})")
        return counts

    def _shapes(self, t: torch.Tensor, what: str) -> list[tuple]:
        """Every rank's (shape, dtype), checking that all but dim 0 agree."""
        mine = (tuple(t.shape), str(t.dtype))
        shapes = self._meta.allgather(mine)
        ref_tail, ref_dtype = shapes[0][0][1:], shapes[0][1]
        bad = [r for r, (s, d) in enumerate(shapes) if s[1:] != ref_tail or d != ref_dtype or not s]
        if bad:
            listing = ", ".join(f"rank {r}: {s} {d}" for r, (s, d) in enumerate(shapes))
            raise CollectiveMismatch(f"{what}: ranks {bad} disagree with rank 0 on trailing shape or "
                                     f"dtype ({listing})")
        return [s for s, _ in shapes]

    # ------------------------------------------------------------ reductions
    def allreduce(self, t: torch.Tensor, op: str = "sum", out: torch.Tensor | None = None,
                  algorithm: str | None = None, async_op: bool = False):
        """Reduce t over all ranks; every rank gets the result.

        Out of place by default; `out=t` reduces in place.  Returns the result, or a Handle
        whose wait() returns it when async_op.
        """
        # A small CPU all-reduce made ready before (psrt/collectives/ready.py) runs at once.
        key = ReadyCache.key(t, out, op, algorithm)
        ready = self._ready.get(key, out is not None)
        if (ready is not None and t.is_contiguous() and not t.is_cuda
                and (out is None or out.is_contiguous() and not out.is_cuda)):
            self.calls += 1      # what _verify counts on the full path
            return self._start(ready.call, t, out, async_op,
                               None if self.check == "off" else self._agreeing(*ready.agreed))
        check_dtype(t)
        check_op(op, t.dtype)
        self._check_out(out, t.shape, t.dtype, "allreduce")
        nbytes = t.numel() * t.element_size()
        algo = self._pick("allreduce", algorithm, nbytes)
        sig = dict(op=op, dtype=t.dtype, numel=t.numel(), algorithm=algo)
        agree = self._verify("allreduce", (("shape", tuple(t.shape)),), **sig)
        small_cpu = not t.is_cuda and t.dtype in small.DTYPES and small.takes(algo, nbytes)
        if (small_cpu and algo in small.FAST and t.is_contiguous() and self.check != "all"
                and (out is None or out.is_contiguous() and not out.is_cuda)):
            ready = self._ready.add(key, t, out, op, algorithm, algo)
            agreed = self._agreement.signature("allreduce", sig)
            ready.agreed = (agreed, (("shape", tuple(t.shape)),), self._agreement.fingerprint_of(agreed))
            return self._start(ready.call, t, out, async_op, agree)
        if small_cpu and algo in small.ALLREDUCE:
            return self._run("allreduce", lambda: self._small_allreduce(t, op, out, algo), async_op, algo, nbytes,
                             agree)
        if (algo == "native" and not async_op and self._executor.idle() and not t.is_cuda
                and t.dtype in _MPI_TYPED and t.is_contiguous()
                and (out is None or out.is_contiguous())):
            result = out if out is not None else torch.empty_like(t)
            if agree is not None:
                agree()
            self.state = (self.calls, "allreduce", time.monotonic())
            t0 = self.tracer.clock()
            native.allreduce_into(self.comm, t, result, op)
            if self.tracer.on:
                self.tracer.add("allreduce", "comm", t0, self.tracer.clock(), algorithm=algo, bytes=nbytes)
            self.state = (self.calls, "allreduce", None)
            return result.div_(self.size) if op == "avg" else result
        fn = _ALLREDUCE[algo]

        def run():
            result = out if out is not None else torch.empty_like(t, memory_format=torch.contiguous_format)
            if (algo in _READS_SOURCE and t.is_contiguous() and result.is_contiguous()
                    and self._on_device_ok(t, algo) and t.data_ptr() != result.data_ptr()):
                flat = result.view(-1)   # out of place without a staging copy of the input
                fn(self.comm, flat, op, src=t.reshape(-1))
            else:
                flat = self._work(t, algo, direct=result)
                fn(self._backend_comm(algo), flat, op)
            if op == "avg":
                flat.div_(self.size)
            return Staging.from_mpi(flat, result)
        return self._run('allreduce', run, async_op, algo, nbytes, agree)

    def _start(self, call, t, out, async_op: bool, agree=None):
        """Run a ready call now (nothing queued), after what is queued, or queued (async_op),
        its agreement first."""
        if agree is not None:
            ready = call

            def call(x, o):
                agree()
                return ready(x, o)
        if async_op:
            return self._executor.submit(call, t, out)
        if self._executor.idle():
            return call(t, out)
        return self._executor.run(call, t, out)

    def _small_allreduce(self, t: torch.Tensor, op: str, out, algo: str) -> torch.Tensor:
        """All-reduce of a small CPU tensor on NumPy views, once (see collectives/small.py):
        what the ready-made calls do not take (non-contiguous tensors, check='all')."""
        result = out if out is not None else torch.empty_like(t, memory_format=torch.contiguous_format)
        target = result if result.is_contiguous() else torch.empty_like(result, memory_format=torch.contiguous_format)
        if target.data_ptr() != t.data_ptr() or not t.is_contiguous():
            target.copy_(t)
        a = np_view(target).reshape(-1)
        small.allreduce(algo, self.comm, a, small.UFUNCS[op])
        if op == "avg":
            np.divide(a, self.size, out=a)
        if target is not result:
            result.copy_(target)
        return result

    def reduce_scatter(self, t: torch.Tensor, op: str = "sum", out: torch.Tensor | None = None,
                       counts=None, algorithm: str | None = None, async_op: bool = False):
        """Reduce t over all ranks and leave rank r with rows counts[r] of the result.

        t is split along dim 0 (default: as evenly as possible, larger parts first).
        """
        check_dtype(t)
        check_op(op, t.dtype)
        counts = self._rows(t, counts, "reduce_scatter")
        row = math.prod(t.shape[1:]) if t.dim() > 1 else 1
        elems = [c * row for c in counts]
        shape = (counts[self.rank],) + tuple(t.shape[1:])
        self._check_out(out, shape, t.dtype, "reduce_scatter")
        algo = self._pick("reduce_scatter", algorithm, t.numel() * t.element_size())
        agree = self._verify("reduce_scatter", op=op, dtype=t.dtype, shape=tuple(t.shape), counts=tuple(counts),
                     algorithm=algo)
        fn = _REDUCE_SCATTER[algo]

        def run():
            flat = self._work(t, algo)
            fn(self._backend_comm(algo), flat, elems, op)
            off = offsets(elems)
            mine = flat[off[self.rank]:off[self.rank + 1]].view(shape)
            if op == "avg":
                mine.div_(self.size)
            result = out if out is not None else torch.empty(shape, dtype=t.dtype, device=t.device)
            return result.copy_(mine)
        return self._run('reduce_scatter', run, async_op, algo, agree=agree)

    def reduce(self, t: torch.Tensor, root: int = 0, op: str = "sum", out: torch.Tensor | None = None,
               algorithm: str | None = None, async_op: bool = False):
        """Reduce t onto `root`; returns the result there and None elsewhere."""
        check_dtype(t)
        check_op(op, t.dtype)
        self._check_root(root, "reduce")
        self._check_out(out, t.shape, t.dtype, "reduce")
        algo = self._pick("reduce", algorithm, t.numel() * t.element_size())
        agree = self._verify("reduce", (("shape", tuple(t.shape)),), op=op, root=root, dtype=t.dtype, numel=t.numel(), algorithm=algo)
        fn = _REDUCE[algo]

        def run():
            result = out if (out is not None and self.rank == root) else None
            flat = self._work(t, algo, direct=result)
            fn(self._backend_comm(algo), flat, root, op)
            if self.rank != root:
                return None
            if op == "avg":
                flat.div_(self.size)
            return Staging.from_mpi(flat, result if result is not None else torch.empty_like(t))
        return self._run('reduce', run, async_op, algo, agree=agree)

    # ------------------------------------------------------------ data movement
    def broadcast(self, t: torch.Tensor, root: int = 0, algorithm: str | None = None,
                  async_op: bool = False):
        """Copy root's t into t on every rank (in place); returns t."""
        check_dtype(t)
        self._check_root(root, "broadcast")
        algo = self._pick("broadcast", algorithm, t.numel() * t.element_size())
        agree = self._verify("broadcast", (("shape", tuple(t.shape)),), root=root, dtype=t.dtype, numel=t.numel(), algorithm=algo)
        fn = _BROADCAST[algo]

        def run():
            flat = self._work(t, algo, direct=t)
            fn(self._backend_comm(algo), flat, root)
            return Staging.from_mpi(flat, t)
        return self._run('broadcast', run, async_op, algo, agree=agree)

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
        agree = self._verify("allgather", (("shape", tuple(t.shape)),), dtype=t.dtype, row=tuple(t.shape[1:]),
                             counts="exchanged" if counts is None else tuple(counts),
                             algorithm=algorithm or self.algorithm)
        if counts is None:
            self._agree_now(agree)
            agree = None
            counts = [s[0] for s in self._shapes(t, "allgather")]
        row = math.prod(t.shape[1:])
        elems = [c * row for c in counts]
        shape = (sum(counts),) + tuple(t.shape[1:])
        self._check_out(out, shape, t.dtype, "allgather")
        algo = self._pick("allgather", algorithm, sum(elems) * t.element_size())
        fn = _ALLGATHER[algo]

        def run():
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
        return self._run('allgather', run, async_op, algo, agree=agree)

    def gather(self, t: torch.Tensor, root: int = 0, async_op: bool = False):
        """Concatenate every rank's t along dim 0 on `root` (uneven rows allowed); None elsewhere."""
        check_dtype(t)
        self._check_root(root, "gather")
        if t.dim() == 0:
            t = t.reshape(1)
        self._agree_now(self._verify("gather", root=root, dtype=t.dtype, row=tuple(t.shape[1:])))
        shapes = self._shapes(t, "gather")
        row = math.prod(t.shape[1:])
        elems = [s[0] * row for s in shapes]

        def run():
            send = self._work(t)
            recv = torch.empty(sum(elems), dtype=t.dtype, device=send.device) if self.rank == root else None
            native.gather(self.comm, send, recv, elems, root)
            if recv is None:
                return None
            return recv.view((sum(s[0] for s in shapes),) + tuple(t.shape[1:])).to(t.device)
        return self._run('gather', run, async_op)

    def scatter(self, t: torch.Tensor | None, root: int = 0, counts=None, async_op: bool = False):
        """Split root's t along dim 0 (by `counts` rows, default even) and give rank r part r.

        Only the root's t is read; other ranks may pass None."""
        self._check_root(root, "scatter")
        self._agree_now(self._verify("scatter", root=root))
        meta = None
        if self.rank == root:
            if t is None:
                raise PsrtError(f"scatter: the root (rank {root}) must pass a tensor")
            check_dtype(t)
            counts = self._rows(t, counts, "scatter")
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
        return self._run('scatter', run, async_op)

    def alltoall(self, t: torch.Tensor, out: torch.Tensor | None = None, async_op: bool = False):
        """Rank r sends block j of t (dim 0 split in `size` equal blocks) to rank j, and
        receives rank j's block r as its block j."""
        check_dtype(t)
        rows = t.shape[0] if t.dim() else 1
        if rows % self.size:
            raise PsrtError(f"alltoall: dim 0 of the input ({rows}) must divide by the number "
                            f"of ranks ({self.size})")
        self._check_out(out, t.shape, t.dtype, "alltoall")
        agree = self._verify("alltoall", dtype=t.dtype, shape=tuple(t.shape))

        def run():
            send = self._work(t)
            recv = torch.empty_like(send)
            native.alltoall(self.comm, send, recv)
            result = out if out is not None else torch.empty_like(t, memory_format=torch.contiguous_format)
            return Staging.from_mpi(recv, result)
        return self._run('alltoall', run, async_op, agree=agree)

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
        self._agree_now(self._verify("alltoallv", dtype=t.dtype, row=tail, algorithm=algo,
                                     recv_counts="exchanged" if recv_counts is None else "given"))
        if recv_counts is None:
            recv_counts = self._exchange_counts(send_counts)
        else:
            recv_counts = [int(c) for c in recv_counts]
            if checked:       # every rank's counts, so every rank names the same culprits
                self._check_pairs(send_counts, recv_counts)
            elif len(recv_counts) != self.size or min(recv_counts) < 0:
                raise PsrtError(f"alltoallv: receive counts {recv_counts} must be {self.size} "
                                "non-negative numbers")
        shape = (sum(recv_counts),) + tail
        self._check_out(out, shape, t.dtype, "alltoallv")
        row = math.prod(tail)
        fn = _ALLTOALLV[algo]

        def run():
            # The input is only read and the output only written: MPI uses their own memory
            # where it can (no copies of a large MoE dispatch), else staged copies.
            send = t.reshape(-1) if t.is_contiguous() and self._on_device_ok(t, algo) else self._work(t)
            result = out if out is not None else torch.empty(shape, dtype=t.dtype, device=t.device)
            direct = result.is_contiguous() and self._on_device_ok(result, algo)
            recv = result.view(-1) if direct else torch.empty(sum(recv_counts) * row, dtype=t.dtype,
                                                               device=send.device)
            fn(self.comm, send, [c * row for c in send_counts], recv, [c * row for c in recv_counts])
            return result if direct else Staging.from_mpi(recv, result)
        return self._run('alltoallv', run, async_op, algo, sum(send_counts) * row * t.element_size())

    def _exchange_counts(self, send_counts: list[int]) -> list[int]:
        """What every rank sends to this one, as a call the watchdog sees: a rank that gave
        its receive counts while this one did not is not in this exchange, and the job's
        report then says who waits where instead of hanging without a word."""
        self.state = (self.calls, "alltoallv", time.monotonic())
        try:
            return self._meta.alltoall(send_counts)
        finally:
            self.state = (self.calls, "alltoallv", None)

    def _check_pairs(self, send_counts: list[int], recv_counts: list[int]) -> None:
        """Every rank's receive counts are N non-negative numbers, and what rank i sends to j
        is what j expects from i."""
        every = self._meta.allgather((send_counts, recv_counts))
        sends, recvs = [s for s, _ in every], [r for _, r in every]
        malformed = [r for r, c in enumerate(recvs) if len(c) != self.size or min(c, default=0) < 0]
        if malformed:
            listing = "; ".join(f"rank {r}: {recvs[r]}" for r in malformed)
            raise CollectiveMismatch(f"alltoallv: receive counts must be {self.size} non-negative numbers "
                                     f"on every rank ({listing})", everywhere=True)
        bad = [(i, j) for i in range(self.size) for j in range(self.size) if sends[i][j] != recvs[j][i]]
        if bad:
            listing = "; ".join(f"rank {i} sends {sends[i][j]} rows to rank {j}, which expects "
                                f"{recvs[j][i]}" for i, j in bad[:4])
            raise CollectiveMismatch(f"alltoallv: counts disagree between ranks ({listing})",
                                     everywhere=True)

    def barrier(self, async_op: bool = False):
        agree = self._verify("barrier")

        def run():
            self.comm.Barrier()
        return self._run('barrier', run, async_op, agree=agree)

    def _check_root(self, root: int, what: str) -> None:
        if not 0 <= root < self.size:
            raise PsrtError(f"{what}: root {root} is not a rank of this communicator (0..{self.size - 1})")


__all__ = ["Communicator", "Handle", "ALGORITHMS", "ALL_ALGORITHMS"]
