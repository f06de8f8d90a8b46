"""Wire helpers shared by the parameter-server strategies (ps, ps-sharded, ps-async).

Everything here is local (no collective calls): the flat view of a model's parameters, the
message buffers, the partition of the flat vector into server shards, the server-side
optimizer holders and a bounded wait.  The protocols themselves live in ps.py (synchronous,
plain and sharded) and ps_async.py (stale-synchronous); docs/explanation/parameter_server.md draws them.

Message format: one contiguous byte buffer holding the payload (gradient or parameter slice,
in the parameters' dtype) followed by a small float64 header (step / clock numbers, exact up
to 2**53; fp16 loss scales, powers of two), so a push or a pull is exactly one MPI message
and a sentinel can carry the sender's final clock.
"""
from __future__ import annotations

import time
from typing import Callable, Iterable

import torch
from mpi4py import MPI

from psrt import env
from psrt.collectives.layout import offsets
from psrt.collectives.p2p import poll
from psrt.dp.shards import ShardMap
from psrt.errors import PsrtError
from psrt.trace import OFF
from psrt.transport import msg

# Tags of the PS protocol.  They travel on a private Dup of the strategy's communicator, so
# they cannot match psrt's collectives or the user's messages; distinct values per message
# kind still make a protocol bug fail loudly instead of matching the wrong buffer.
TAG_INIT = 301    # rank 0 -> every rank: initial parameters, once, at construction
TAG_PUSH = 302    # worker -> server: gradient (slice) + header [step or clock, loss]
TAG_PULL = 303    # server -> worker: parameters (slice) + header [step or clock, ...]
TAG_DONE = 304    # worker -> server: sentinel "this worker has finished" + header [clock]
TAG_FINAL = 305   # server -> worker (ps-async): final parameters once every worker is done

LEFT_CHECK_S = 0.25   # how often a wait asks the watchdog whether a peer left the job (wait_all)
HEADER = 4        # float64 slots after the payload
# What the slots hold.  A push: [step or clock, local loss, 0, SCALE: the fp16 loss scale
# its gradient was computed with].  A synchronous answer: [step, mean loss, FOUND: the step
# was skipped (an overflow), SCALE: the scale after it].  ps-async answers have ASYNC_HEADER slots: [clock, clocks applied,
# slowest clock, loss of the last applied clock, scale to compute with, clocks skipped].
FOUND, SCALE = 2, 3
ASYNC_HEADER = 6


class Wire:
    """A payload of `numel` elements of `dtype` and a float64 header in one byte buffer.

    Always in host memory: CUDA models are staged through it (copy in, copy out), which works
    with any MPI; pinned when CUDA is present so those copies run at full speed.
    """

    def __init__(self, numel: int, dtype: torch.dtype, header: int = HEADER):
        self.numel = numel
        itemsize = torch.empty(0, dtype=dtype).element_size()
        data_bytes = -(-numel * itemsize // 8) * 8          # pad so the header is 8-aligned
        self.buf = torch.zeros(data_bytes + 8 * header, dtype=torch.uint8,
                               pin_memory=torch.cuda.is_available())
        self.data = self.buf[:numel * itemsize].view(dtype)
        self.head = self.buf[data_bytes:].view(torch.float64)
        self._head_bytes = self.buf[data_bytes:]

    @property
    def nbytes(self) -> int:
        return self.buf.numel()

    def msg(self):
        return msg(self.buf)

    def head_msg(self):
        """The header alone: what a sentinel carries."""
        return msg(self._head_bytes)


class FlatParams:
    """The model's parameters seen as one flat vector (in `model.parameters()` order).

    Copies in and out instead of re-pointing `p.data` into a flat buffer: one memcpy of M
    per step, and the user's model keeps ordinary parameters (optimizers, hooks, `.to()`).
    """

    def __init__(self, params):
        self.params = list(params.parameters() if isinstance(params, torch.nn.Module) else params)
        if not self.params:
            raise PsrtError("parameter-server strategies need a model with parameters")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise PsrtError(f"parameter-server strategies need every parameter in one dtype, "
                            f"the model mixes {sorted(str(d) for d in dtypes)}")
        self.dtype = dtypes.pop()
        self.offsets = offsets([p.numel() for p in self.params])
        self.numel = self.offsets[-1]

    def _pieces(self, lo: int, hi: int):
        """(param, start in param, start in [lo, hi), length) for every piece inside [lo, hi)."""
        for p, a, b in zip(self.params, self.offsets, self.offsets[1:]):
            s, e = max(a, lo), min(b, hi)
            if s < e:
                yield p, s - a, s - lo, e - s

    # Between a GPU model and the pinned wire, each parameter's copy is queued without a
    # wait (non_blocking) and the stream is synchronised once at the end, instead of once per
    # parameter; the wire is only handed to MPI, or written by it, after that wait.
    def grads_into(self, out: torch.Tensor, lo: int = 0, hi: int | None = None) -> None:
        """out <- flat gradient [lo, hi); a parameter without a gradient counts as zeros."""
        hi = self.numel if hi is None else hi
        for p, ps, os_, n in self._pieces(lo, hi):
            if p.grad is None:
                out[os_:os_ + n].zero_()
            else:
                out[os_:os_ + n].copy_(p.grad.detach().reshape(-1)[ps:ps + n], non_blocking=True)
        self._copied()

    def params_into(self, out: torch.Tensor, lo: int = 0, hi: int | None = None) -> None:
        hi = self.numel if hi is None else hi
        for p, ps, os_, n in self._pieces(lo, hi):
            out[os_:os_ + n].copy_(p.detach().reshape(-1)[ps:ps + n], non_blocking=True)
        self._copied()

    @torch.no_grad()
    def load(self, src: torch.Tensor, lo: int = 0, hi: int | None = None) -> None:
        """Flat parameters [lo, hi) <- src."""
        hi = self.numel if hi is None else hi
        for p, ps, os_, n in self._pieces(lo, hi):
            p.view(-1)[ps:ps + n].copy_(src[os_:os_ + n], non_blocking=True)
        self._copied()

    def _copied(self) -> None:
        """Wait once for the copies queued to or from a GPU model."""
        if self.params[0].is_cuda:
            torch.cuda.current_stream(self.params[0].device).synchronize()


def fill_push(wire: Wire, step: int, loss: float, scaler) -> None:
    """A push's header: the step or clock, the local loss, and the fp16 loss scale the
    gradient was computed with (1 without scaling)."""
    wire.head[:SCALE + 1] = wire.head.new_tensor([step, loss, 0.0, scaler.scale if scaler else 1.0])


def shard_ranges(numel: int, shards: int) -> list[tuple[int, int]]:
    """Size-balanced contiguous ranges of the flat vector, one per server (ps-lite's key
    ranges, Li et al. OSDI 2014 sec. 4.3): sizes differ by at most one element, larger first,
    so each server stores and moves ~M/S whatever the parameter shapes are.  The one-unit
    case of the ownership map that zero1/2/3 use too (psrt.dp.shards)."""
    return ShardMap([numel], shards).ranges()


def average_in_order(parts: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """out <- (parts[0] + parts[1] + ...) / len(parts), summed left to right.

    Callers pass the workers' gradients in rank order, so the result is bitwise
    reproducible and the same in ps, ps-sharded and ps-async (s = 0)."""
    out.copy_(parts[0])
    for p in parts[1:]:
        out.add_(p)
    return out.div_(len(parts))


class ModelShard:
    """Server-side optimizer over the model's own parameters (one shard covering all of them).

    Used by ps and ps-async: param groups from `make_optimizer` survive, and the optimizer's
    state_dict is the one a single process would have, so checkpoints move between the two."""

    def __init__(self, flat: FlatParams, make_optimizer: Callable[[Iterable], torch.optim.Optimizer]):
        self.flat = flat
        self.lo, self.hi = 0, flat.numel
        self.optimizer = make_optimizer(flat.params)

    def apply(self, avg_grad: torch.Tensor, out: torch.Tensor) -> None:
        """One optimizer step with gradient `avg_grad` (flat); new parameters into `out`."""
        for p, a, b in zip(self.flat.params, self.flat.offsets, self.flat.offsets[1:]):
            p.grad = avg_grad[a:b].view_as(p).to(p.device)
        self.optimizer.step()
        self.flat.params_into(out)

    def current(self, out: torch.Tensor) -> None:
        """The parameters as they are into `out` (the answer to a skipped step)."""
        self.flat.params_into(out)

    def state_numel(self) -> int:
        return _state_numel(self.optimizer)

    def state_dict(self) -> dict:
        return {"lo": self.lo, "hi": self.hi, "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict, where: str) -> None:
        _check_range(state, self.lo, self.hi, where)
        self.optimizer.load_state_dict(state["optimizer"])


class FlatShard:
    """Server-side optimizer over one contiguous slice [lo, hi) of the flat parameters (ps-sharded).

    The slice may cut through parameter tensors, so the optimizer sees one flat tensor and
    its state (momentum, Adam moments) is exactly hi - lo elements per buffer: each server
    holds only its shard.  Per-parameter option groups cannot survive the cut."""

    def __init__(self, flat: FlatParams, lo: int, hi: int,
                 make_optimizer: Callable[[Iterable], torch.optim.Optimizer]):
        self.lo, self.hi = lo, hi
        device = flat.params[0].device
        init = torch.empty(hi - lo, dtype=flat.dtype)
        flat.params_into(init, lo, hi)
        self.param = torch.nn.Parameter(init.to(device))
        self.optimizer = make_optimizer([self.param])

    def apply(self, avg_grad: torch.Tensor, out: torch.Tensor) -> None:
        self.param.grad = avg_grad.to(self.param.device)
        self.optimizer.step()
        self.current(out)

    def current(self, out: torch.Tensor) -> None:
        out.copy_(self.param.detach())

    def state_numel(self) -> int:
        return _state_numel(self.optimizer)

    def state_dict(self) -> dict:
        return {"lo": self.lo, "hi": self.hi, "param": self.param.detach().cpu().clone(),
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict, where: str) -> None:
        _check_range(state, self.lo, self.hi, where)
        with torch.no_grad():
            self.param.copy_(state["param"])
        self.optimizer.load_state_dict(state["optimizer"])


def _state_numel(optimizer: torch.optim.Optimizer) -> int:
    """Elements of optimizer state held in tensors larger than a scalar (step counters excluded)."""
    return sum(v.numel() for s in optimizer.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0)


def _check_range(state: dict, lo: int, hi: int, where: str) -> None:
    if (state.get("lo"), state.get("hi")) != (lo, hi):
        raise PsrtError(f"{where}: the checkpoint holds parameter range [{state.get('lo')}, "
                        f"{state.get('hi')}) but this rank serves [{lo}, {hi}): resume with the "
                        "same number of ranks and --servers")


def broadcast_initial(pcomm, flat: FlatParams, timeout_s: float, name: str) -> int:
    """Rank 0 sends its parameters to every other rank, which loads them: every replica and
    every server shard starts from rank 0's model, as DDP starts from rank 0's (rank 0 is a
    worker in every PS layout; dedicated servers are the last ranks).  Returns bytes sent."""
    wire = Wire(flat.numel, flat.dtype)
    if pcomm.rank == 0:
        flat.params_into(wire.data)
        reqs = [pcomm.Isend(wire.msg(), r, TAG_INIT) for r in range(1, pcomm.size)]
    else:
        reqs = [pcomm.Irecv(wire.msg(), 0, TAG_INIT)]
    wait_all(reqs, timeout_s, lambda p: f"--dp {name} rank {pcomm.rank}: the initial parameters "
             f"from rank 0 did not arrive within {timeout_s:.0f} s")
    if pcomm.rank != 0:
        flat.load(wire.data)
    return len(reqs) * wire.nbytes if pcomm.rank == 0 else 0


def local_backward(model: torch.nn.Module, loss_fn, microbatches: list, tracer=OFF) -> float:
    """Forward and backward over this rank's micro-batches; returns their mean loss.  Each
    micro-batch's forward and backward is a span of `tracer` (psrt.trace).

    Each loss is divided by the number of micro-batches so the accumulated gradient is that
    of the mean loss over this rank's samples (equal-sized micro-batches)."""
    if not microbatches:
        raise PsrtError("step() needs at least one micro-batch")
    for p in model.parameters():
        p.grad = None
    total = 0.0
    k = len(microbatches)
    for i, mb in enumerate(microbatches):
        with tracer.span("forward", "compute", microbatch=i):
            loss = loss_fn(mb)
        with tracer.span("backward", "compute", microbatch=i):
            (loss / k).backward()
        total += float(loss.detach())
    return total / k


def wait_all(reqs: list, timeout_s: float, what: Callable[[list[int]], str], peers: list[int] | None = None,
             comm=None, who: str = "") -> list:
    """Wait for every request; returns their statuses.

    Polls (psrt.collectives.p2p.poll) instead of blocking in Waitall, so that a peer that
    vanished without its sentinel becomes an error after `timeout_s` rather than a hang.
    `what(pending)` names the wait, given the indices of the requests still open.

    With `peers` (the rank of `comm` each request waits for, None where that does not
    matter) and a watchdog running (psrt.watchdog, started by psrt.init), a peer that left
    the job (its program ended, as a worker that stops without finish() does) is an error
    at once, `who` waiting for it, instead of after `timeout_s`."""
    if not reqs:
        return []
    statuses = [MPI.Status() for _ in reqs]
    dog = None
    if peers is not None and comm is not None:
        from psrt.watchdog import running_for
        dog = running_for(comm)
    checked = [now()]

    def gone() -> None:
        # a few times a second: a Testall is cheap, a look at the watchdog's news is not free
        if dog is None or now() - checked[0] < LEFT_CHECK_S:
            return
        checked[0] = now()
        # Get_status, not Test: a request Test completed would lose its status (the tag
        # that tells a DONE) before Testall reads it
        left = dog.left(comm, sorted({peers[i] for i, r in enumerate(reqs)
                                      if peers[i] is not None and not r.Get_status()}))
        if left:
            raise PsrtError(f"{who} waits for rank(s) {left}, which left the job: their program ended "
                            "before they sent what this rank waits for (a worker must call finish())")

    def done() -> bool:
        gone()
        try:
            return MPI.Request.Testall(reqs, statuses)
        except MPI.Exception as err:
            # MPI_ERR_IN_STATUS says only that some request failed: raise the failure itself
            # (a lost peer, MPI_ERR_PROC_FAILED under ULFM, is what in-job recovery looks for)
            if err.Get_error_class() != MPI.ERR_IN_STATUS:
                raise
            codes = [s.Get_error() for s in statuses if s.Get_error() not in (MPI.SUCCESS, MPI.ERR_PENDING)]
            if not codes:
                raise
            raise MPI.Exception(codes[0]) from err
    poll(done, timeout_s, lambda: what([i for i, r in enumerate(reqs) if not r.Test()]))
    return statuses


def first_pushes(comm, inbox: dict, posted: dict, remote: list[int], need: int, step: int,
                 timeout_s: float, what: Callable[[list[int]], str]) -> dict[int, int]:
    """Backup workers (Chen et al., "Revisiting Distributed Synchronous SGD", 2016): wait for
    the first `need` messages of step `step` (or DONE) from the workers `remote`; returns
    {worker: tag}.  A receive stays posted into inbox[w] across rounds (`posted`), so the push
    of a worker left out arrives there later; a push of an earlier step is such a late one,
    dropped, and the receive posted again."""
    for w in remote:
        if w not in posted:
            posted[w] = comm.Irecv(inbox[w].msg(), w, MPI.ANY_TAG)
    arrived: dict[int, int] = {}

    def enough() -> bool:
        for w in [w for w in posted if w not in arrived]:
            status = MPI.Status()
            if not posted[w].Test(status):
                continue
            del posted[w]
            if status.Get_tag() == TAG_PUSH and int(inbox[w].head[0]) < step:
                posted[w] = comm.Irecv(inbox[w].msg(), w, MPI.ANY_TAG)
                continue
            arrived[w] = status.Get_tag()
        return len(arrived) >= need
    poll(enough, timeout_s, lambda: what(sorted(set(remote) - set(arrived))))
    return arrived


def probe_any(comm, timeout_s: float, what: Callable[[], str]) -> MPI.Status:
    """Wait for any message on `comm` (from any source, any tag); returns its status."""
    status = MPI.Status()
    poll(lambda: comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status), timeout_s, what)
    return status


def timeout_option(timeout_s: float | None, name: str) -> float:
    """A strategy's timeout_s option: PSRT_TIMEOUT when not given, and positive."""
    timeout = env.timeout_s() if timeout_s is None else float(timeout_s)
    if not timeout > 0:
        raise PsrtError(f"--dp {name}: timeout_s must be positive, got {timeout}", everywhere=True)
    return timeout


def check_staleness(staleness: int | None, name: str) -> None:
    """The synchronous strategies accept the CLI's --staleness only as 0 (or unset)."""
    if staleness not in (None, 0):
        raise PsrtError(f"--dp {name} is synchronous; --staleness {staleness} needs --dp ps-async",
                        everywhere=True)


def now() -> float:
    return time.perf_counter()
