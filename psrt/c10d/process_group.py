"""`ProcessGroupPsrt`: torch.distributed's ProcessGroup interface over psrt's Communicator.

Every collective is queued, in call order, to one worker thread per group (MPI requires all
ranks to start collectives on a communicator in the same order, MPI 4.1 sec. 6.14) and runs
there as a blocking psrt call; the caller gets a `Work` at once, so DDP's bucket all-reduces
overlap the rest of backward.  Point-to-point calls start non-blocking MPI requests right away
on a communicator of their own, so a paired `batch_isend_irecv` cannot deadlock and user
messages never match the messages of psrt's algorithms; a progress thread completes them
(psrt/c10d/p2p.py).

Tensors of a dtype psrt's transport does not reduce (int16, complex, float8, ...) travel as
bytes for data movement; complex sums reduce as pairs of reals (psrt/c10d/tensors.py).  CUDA tensors are ordered
against the stream that was current at call time: for a collective an event recorded there
is awaited by the worker before MPI touches the memory; a send or receive, which MPI starts
at once, synchronises that stream first.
"""
from __future__ import annotations

import atexit
import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from psrt import env
from psrt.c10d.p2p import P2PWork, Progress, caller_stream, copy_back, store as _store
from psrt.c10d.tensors import allreduce_sparse, flat_numel, flat_view, reduce_op, reducible, split_into
from psrt.c10d.work import Work
from psrt.collectives.communicator import Communicator
from psrt.collectives.executor import Executor
from psrt.errors import PsrtError
from psrt.transport import msg

@dataclass(frozen=True)
class Options:
    """Per-group settings, passed as `pg_options` to init_process_group or new_group.

    algorithm: psrt's algorithm for this group's collectives (default PSRT_ALGORITHM, 'auto').
    check: cross-rank argument checking, 'all', 'cheap' or 'off' (default PSRT_CHECK).
    """
    algorithm: str | None = None
    check: str | None = None

    def __post_init__(self):
        if self.algorithm is not None and self.algorithm not in env.BACKEND_ALGORITHMS:
            raise PsrtError(f"psrt backend: algorithm {self.algorithm!r} is not one of "
                            f"{', '.join(env.BACKEND_ALGORITHMS)}")
        if self.check is not None and self.check not in env.CHECK_MODES:
            raise PsrtError(f"psrt backend: check {self.check!r} is not one of {', '.join(env.CHECK_MODES)}")


class ProcessGroupPsrt(dist.ProcessGroup):
    """A torch.distributed process group whose collectives are psrt's.

    Args:
        comm: the mpi4py communicator of the group's ranks, in group-rank order.
        options: `Options` (algorithm, check).
        timeout: how long any call may wait (torch's `timeout=`; default PSRT_TIMEOUT): a call
            still waiting then fails, naming itself, the group and the ranks it waits for.
        on_shutdown: called once the group is shut down (the first group stops the watchdog).
        ranks: the group's global ranks, in group-rank order (how errors name them).
    """

    def __init__(self, comm, options: Options | None = None, timeout: datetime.timedelta | None = None,
                 on_shutdown=None, ranks: list[int] | None = None):
        super().__init__(comm.Get_rank(), comm.Get_size())
        self._ranks = list(ranks) if ranks else list(range(comm.Get_size()))
        options = options or Options()
        self.algorithm = options.algorithm or env.algorithm()
        self.group = Communicator(comm, algorithm=self.algorithm, check=options.check)
        self._p2p = comm.Dup()      # user messages never match psrt's algorithms' messages
        self._progress = Progress()  # completes sends and receives (and their futures)
        self._worker = Executor(name="psrt-c10d")
        self._timeout = timeout if timeout and timeout.total_seconds() > 0 \
            else datetime.timedelta(seconds=env.timeout_s())
        self._closed = False
        self._wedged: str | None = None    # the call that timed out, if one did
        self._on_shutdown = on_shutdown
        self._group_name = self._group_desc = ""
        # Stop the worker before the interpreter (and then MPI) shuts down, when the program
        # did not call destroy_process_group: a daemon thread cut off inside torch aborts.
        atexit.register(self.shutdown)

    def __repr__(self) -> str:
        return f"ProcessGroupPsrt(rank={self.rank()}, size={self.size()}, algorithm={self.algorithm!r})"

    def getBackendName(self) -> str:
        return "psrt"

    # torch names every group and finds it by name (DeviceMesh, functional collectives).  The
    # C++ base keeps the name in a backend object that a group written in Python does not
    # have, so the name lives here.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return self._group_desc

    @property
    def _device_types(self):
        return [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])

    # ------------------------------------------------------------ running a call
    def _check_open(self, name: str) -> None:
        if self._closed:
            raise PsrtError(f"psrt backend: {name} on a group that was shut down")

    def _describe(self, call: str) -> str:
        """"allreduce on group 0 (global ranks [0, 1, 2])": how errors name a call."""
        return f"{call} on group {self._group_name or '?'} (global ranks {self._ranks})"

    def _others(self) -> str:
        """The ranks a collective of this rank waits for."""
        me = self._ranks[self.rank()]
        return f"global ranks {[r for r in self._ranks if r != me]}"

    def _timed_out(self, what: str) -> None:
        # The worker may sit in an MPI call whose peers never come: shutdown must not wait for it.
        self._wedged = what

    def _call_timeout(self, opts) -> datetime.timedelta:
        """The call's own timeout (torch's per-call `timeout=`, as in `barrier(timeout=)`) when
        it sets one, else the group's."""
        own = getattr(opts, "timeout", None)
        return own if own is not None and own.total_seconds() > 0 else self._timeout

    def _submit(self, name: str, tensors: list, fn, opts=None) -> Work:
        """Queue fn (which does the whole call) and return its Work."""
        self._check_open(name)
        work = Work(tensors, self._call_timeout(opts), self._describe(name), self._others(),
                    on_timeout=self._timed_out)
        device = next((t.device for t in tensors if t.is_cuda), None)
        event = None
        if device is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))   # the caller's stream, at call time

        def job():
            try:
                if device is None:
                    fn()
                else:
                    # the worker thread has its own current device: use the tensors'
                    with torch.cuda.device(device):
                        event.synchronize()
                        fn()
                        torch.cuda.current_stream(device).synchronize()   # copies back are done
            except BaseException as err:  # noqa: BLE001 - handed to Work, raised by wait()
                work._finish(err)
                return
            work._finish()

        self._worker.submit(job)    # a future's callback on the worker runs at once, in order
        return work

    # ------------------------------------------------------------ reductions
    def _allreduce_one(self, t: torch.Tensor, opts_op) -> None:
        op, factor = reduce_op(opts_op)
        work = t if t.is_contiguous() else t.contiguous()
        if factor is not None:
            work.mul_(factor)
        buf = reducible(work, op)
        self.group.allreduce(buf, op, out=buf)
        if work.data_ptr() != t.data_ptr():
            t.copy_(work)

    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceOptions()
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        op = opts.reduceOp

        def run():
            for t in tensors:
                if t.is_sparse:
                    allreduce_sparse(self.group, t, op)
                else:
                    self._allreduce_one(t, op)
        return self._submit("allreduce", tensors, run)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        tensors = list(tensors)
        op = opts.reduceOp

        def run():
            by_dtype: dict = {}
            for t in tensors:
                by_dtype.setdefault((t.dtype, t.device), []).append(t)
            for group in by_dtype.values():
                flat = torch._utils._flatten_dense_tensors(group)
                self._allreduce_one(flat, op)
                for t, r in zip(group, torch._utils._unflatten_dense_tensors(flat, group)):
                    t.copy_(r)
        return self._submit("allreduce_coalesced", tensors, run)

    def reduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.ReduceOptions()
        t, root = tensors[0], opts.rootRank
        op, factor = reduce_op(opts.reduceOp)

        def run():
            work = t.contiguous() if factor is None else t * factor
            buf = reducible(work, op)      # a view of work: reducing buf fills work
            is_root = self.rank() == root
            self.group.reduce(buf, root=root, op=op, out=buf if is_root else None)
            if is_root and work.data_ptr() != t.data_ptr():
                t.copy_(work)
        return self._submit("reduce", [t], run)

    def _reduce_scatter_flat(self, src: torch.Tensor, out: torch.Tensor, counts: list[int], opts_op) -> None:
        op, factor = reduce_op(opts_op)
        if factor is not None:
            src = src * factor
        src = reducible(src.contiguous(), op).reshape(-1)
        scale = src.numel() // max(1, sum(counts))      # 2 for complex viewed as reals
        target = out.reshape(-1) if out.is_contiguous() and not out.is_complex() else None
        result = self.group.reduce_scatter(src, op, counts=[c * scale for c in counts], out=target)
        if target is None:
            out.copy_(torch.view_as_complex(result.view(-1, 2)).view(out.shape) if out.is_complex()
                      else result.view(out.shape))

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        out, parts = output_tensors[0], list(input_tensors[0])

        def run():
            src = torch.cat([p.reshape(-1) for p in parts])
            self._reduce_scatter_flat(src, out, [p.numel() for p in parts], opts.reduceOp)
        return self._submit("reduce_scatter", [out], run)

    def _check_sizes(self, name: str, small: torch.Tensor, large: torch.Tensor, which: str) -> None:
        """The `large` tensor of a *_tensor call holds one `small` per rank."""
        if large.numel() != small.numel() * self.size():
            raise PsrtError(f"psrt backend: {name}: {which} has {large.numel()} elements, "
                            f"expected {self.size()} x {small.numel()}")

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        pairs = list(zip(outputs, inputs))
        for out, src in pairs:
            self._check_sizes("reduce_scatter_tensor", out, src, "input")

        def run():
            for out, src in pairs:
                self._reduce_scatter_flat(src, out, [out.numel()] * self.size(), opts.reduceOp)
        return self._submit("reduce_scatter_tensor", [out for out, _ in pairs], run)

    def reduce_scatter_single(self, output, input, opts=None):
        return self.reduce_scatter_tensor_coalesced([output], [input], opts)

    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # ------------------------------------------------------------ data movement
    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else dist.BroadcastOptions()
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        root = opts.rootRank

        def run():
            for t in tensors:
                flat = flat_view(t)
                self.group.broadcast(flat, root=root)
                _store(flat, t)
        return self._submit("broadcast", tensors, run)

    def _allgather_flat(self, src: torch.Tensor, counts: list[int], out: torch.Tensor | None):
        if out is not None and out.dtype != src.dtype:
            out = None
        return self.group.allgather(src, counts=counts, out=out)

    def allgather(self, output_tensors, input_tensors, opts=None):
        outs, t = list(output_tensors[0]), input_tensors[0]
        if len(outs) != self.size():
            raise PsrtError(f"psrt backend: all_gather needs {self.size()} output tensors, got {len(outs)}")

        def run():
            flat = self._allgather_flat(flat_view(t), [flat_numel(o) for o in outs], None)
            split_into(flat, outs)
        return self._submit("allgather", outs, run)

    def _gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        src = flat_view(input)
        direct = output.view(-1) if output.is_contiguous() else None
        flat = self._allgather_flat(src, [src.numel()] * self.size(), direct)
        if direct is None or flat.data_ptr() != output.data_ptr():
            _store(flat, output)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        pairs = list(zip(outputs, inputs))
        for out, src in pairs:
            self._check_sizes("all_gather_into_tensor", src, out, "output")

        def run():
            for out, src in pairs:
                self._gather_into_tensor(out, src)
        return self._submit("all_gather_into_tensor", [out for out, _ in pairs], run)

    def all_gather_single(self, output, input, opts=None):
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    _allgather_base = all_gather_single
    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """`all_gather_coalesced`: output_lists[r][i] receives rank r's input_list[i] (as gloo's
        ProcessGroupGloo::allgather_coalesced lays them out), in one all-gather of every input's
        bytes."""
        output_lists, inputs = [list(o) for o in output_lists], list(input_list)
        if len(output_lists) != self.size():
            raise PsrtError(f"psrt backend: all_gather_coalesced needs {self.size()} output lists "
                            f"(one per rank), got {len(output_lists)}")
        for r, outs in enumerate(output_lists):
            if [(o.numel(), o.dtype) for o in outs] != [(t.numel(), t.dtype) for t in inputs]:
                raise PsrtError(f"psrt backend: all_gather_coalesced: output list {r} holds "
                                f"{[(tuple(o.shape), o.dtype) for o in outs]}, expected the inputs' "
                                f"{[(tuple(t.shape), t.dtype) for t in inputs]}")

        def run():
            sizes = [t.numel() * t.element_size() for t in inputs]
            mine = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in inputs]) if inputs \
                else torch.empty(0, dtype=torch.uint8)
            every = self._allgather_flat(mine, [mine.numel()] * self.size(), None)
            for r, outs in enumerate(output_lists):
                start = r * mine.numel()
                for o, n in zip(outs, sizes):
                    # cloned: a slice at an odd byte offset cannot be viewed as a wider dtype
                    o.copy_(every[start:start + n].clone().view(o.dtype).view(o.shape))
                    start += n
        return self._submit("allgather_coalesced", [o for outs in output_lists for o in outs], run)

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else dist.GatherOptions()
        root, t = opts.rootRank, input_tensors[0]
        outs = list(output_tensors[0]) if self.rank() == root else []

        def run():
            flat = self.group.gather(flat_view(t), root=root)
            if self.rank() == root:
                split_into(flat, outs)
        return self._submit("gather", outs, run)

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else dist.ScatterOptions()
        root, out = opts.rootRank, output_tensors[0]
        parts = list(input_tensors[0]) if self.rank() == root else []

        def run():
            src = torch.cat([flat_view(p) for p in parts]) if parts else None
            counts = [flat_numel(p) for p in parts] if parts else None
            _store(self.group.scatter(src, root=root, counts=counts), out)
        return self._submit("scatter", [out], run)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        n = self.size()

        def counts(t, splits, what):
            rows = t.shape[0] if t.dim() else 1
            splits = list(splits) if splits else [rows // n] * n
            if sum(splits) != rows:
                raise PsrtError(f"psrt backend: all_to_all_single: {what} splits {splits} do not add "
                                f"up to dim 0 ({rows})")
            row = flat_numel(t) // rows if rows else 0
            return [s * row for s in splits]

        send, recv = counts(input, input_split_sizes, "input"), counts(output, output_split_sizes, "output")

        def run():
            flat = self.group.alltoallv(flat_view(input), send, recv)
            _store(flat, output)
        return self._submit("all_to_all_single", [output], run)

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors, input_tensors, opts=None):
        outs, ins = list(output_tensors), list(input_tensors)

        def run():
            src = torch.cat([flat_view(t) for t in ins])
            flat = self.group.alltoallv(src, [flat_numel(t) for t in ins], [flat_numel(o) for o in outs])
            split_into(flat, outs)
        return self._submit("alltoall", outs, run)

    def barrier(self, opts=None):
        return self._submit("barrier", [], self.group.barrier, opts)

    # ------------------------------------------------------------ point to point
    def send(self, tensors, dst: int, tag: int):
        self._check_open("send")
        t = tensors[0]
        buf = flat_view(t).contiguous()
        if buf.is_cuda and not self.group._staging.direct_cuda:
            buf = buf.cpu()           # waits for the caller's stream itself
        caller_stream(buf, touched=True)
        request = self._p2p.Isend(msg(buf), dst, tag)
        return self._progress.add(P2PWork(request, [t], keep=buf, what=self._describe(f"send to rank {dst} (tag {tag})"),
                                          timeout_s=self._timeout.total_seconds(),
                                          waits_for=f"global rank {self._ranks[dst]}"))

    def recv(self, tensors, src: int, tag: int):
        from mpi4py import MPI
        self._check_open("recv")
        t = tensors[0]
        flat = flat_view(t)
        buf = flat if flat.is_contiguous() and flat.data_ptr() == t.data_ptr() else torch.empty_like(flat)
        if buf.is_cuda and not self.group._staging.direct_cuda:
            buf = torch.empty(buf.shape, dtype=buf.dtype)
        stream = caller_stream(t, touched=buf.is_cuda)
        request = self._p2p.Irecv(msg(buf), MPI.ANY_SOURCE if src < 0 else src, tag)
        what = self._describe(f"recv from {'any rank' if src < 0 else f'rank {src}'} (tag {tag})")
        waits_for = self._others().replace("global ranks", "any of global ranks") if src < 0 \
            else f"global rank {self._ranks[src]}"
        return self._progress.add(P2PWork(request, [t], keep=buf, what=what, timeout_s=self._timeout.total_seconds(),
                                          landed=copy_back(buf, t, stream), source=None if src < 0 else src,
                                          waits_for=waits_for))

    def recv_anysource(self, tensors, tag: int):
        return self.recv(tensors, -1, tag)

    # ------------------------------------------------------------ life cycle
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        self._progress.close()
        if self._wedged is None:
            self._worker.close()
            self.group.close()
        # else the worker (a daemon thread) is left inside the call that timed out, with the
        # communicators it uses: joining it, or freeing them under it, would hang or crash.
        self._p2p.Free()
        if self._on_shutdown is not None:
            self._on_shutdown()

    def abort(self) -> None:
        self.shutdown()
