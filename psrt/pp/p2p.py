"""Point-to-point transfer of activations and gradients between pipeline ranks.

Each tensor travels as two messages with the same tag: a fixed-size header (dtype, shape)
and the payload.  The receiver takes the header with a matched probe (MPI_Improbe/Mrecv,
MPI 4.1 sec. 3.8.2), allocates, then receives the payload: MPI's non-overtaking rule
(sec. 3.5) keeps the two in order, so shapes may change from one micro-batch to the next
with no separate handshake.  Sends are non-blocking (Isend), so two neighbours that both
send before they receive cannot deadlock, and a receive polls with a deadline, so a missing
peer becomes an error naming it instead of a hang.

CUDA tensors go to MPI directly when it is CUDA-aware, else through a fresh host copy (a
pending send needs its own buffer; the cached staging buffers are reused too early).
"""
from __future__ import annotations

import numpy as np
import torch

from psrt import env
from psrt.collectives.p2p import poll
from psrt.errors import PsrtError
from psrt.trace import OFF, Tracer
from psrt.transport import SUPPORTED_DTYPES, Staging, check_dtype, msg

MAX_DIMS = 8
_MAGIC = 0x5053_5254  # "PSRT"
_HEADER = 3 + MAX_DIMS   # magic, dtype code, ndim, dims


def encode_header(t: torch.Tensor) -> np.ndarray:
    if t.dim() > MAX_DIMS:
        raise PsrtError(f"pipeline: cannot send a {t.dim()}-d tensor (at most {MAX_DIMS} dims)")
    check_dtype(t)
    h = np.zeros(_HEADER, dtype=np.int64)
    h[:3] = _MAGIC, SUPPORTED_DTYPES.index(t.dtype), t.dim()
    h[3:3 + t.dim()] = t.shape
    return h


def decode_header(h: np.ndarray) -> tuple[torch.dtype, tuple[int, ...]]:
    if h[0] != _MAGIC or not 0 <= h[1] < len(SUPPORTED_DTYPES) or not 0 <= h[2] <= MAX_DIMS:
        raise PsrtError(f"pipeline: received a malformed tensor header {h.tolist()} "
                        "(the ranks run different schedules or models?)")
    return SUPPORTED_DTYPES[int(h[1])], tuple(int(d) for d in h[3:3 + int(h[2])])


class P2P:
    """Tagged tensor sends and receives on one communicator (the pipeline axis).

    Args:
        comm: mpi4py communicator; ranks are pipeline ranks.
        timeout_s: how long a receive waits before it raises PsrtError (default PSRT_TIMEOUT).
        tracer: a psrt.trace.Tracer: each send (its posting) and each receive (from its wait to
            the payload's arrival) is a span, with the peer and the bytes.
    """

    def __init__(self, comm, timeout_s: float | None = None, staging: Staging | None = None,
                 tracer: Tracer | None = None):
        from mpi4py import MPI
        self._mpi = MPI
        self.tracer = tracer or OFF
        self.comm = comm
        self.rank = comm.Get_rank()
        self.timeout_s = env.timeout_s() if timeout_s is None else timeout_s
        # MPI_TAG_UB is attached to MPI_COMM_WORLD only (MPI 4.1 sec. 9.1.2); on other
        # communicators fall back to the smallest value the standard allows.
        self.tag_ub = comm.Get_attr(MPI.TAG_UB) or 32767
        self._staging = staging or Staging()
        self._pending: list[tuple] = []      # (request, buffers kept alive until it completes)
        self._local: dict[int, torch.Tensor] = {}
        self.bytes_sent = 0

    def _check_tag(self, tag: int) -> None:
        if tag > self.tag_ub:
            raise PsrtError(f"pipeline: message tag {tag} exceeds this MPI's MPI_TAG_UB "
                            f"({self.tag_ub}); use fewer stages or micro-batches")

    def isend(self, t: torch.Tensor, dest: int, tag: int) -> None:
        """Start sending t (detached) to `dest`; a send to this rank itself stays local."""
        self._check_tag(tag)
        t = t.detach()
        if dest == self.rank:
            self._local[tag] = t
            return
        t0 = self.tracer.clock()
        header = encode_header(t)
        if t.is_cuda and self._staging.direct_cuda:
            torch.cuda.current_stream(t.device).synchronize()
            payload = t.contiguous()
        else:
            payload = t.to("cpu").contiguous()
        reqs = [self.comm.Isend(header, dest, tag), self.comm.Isend(msg(payload), dest, tag)]
        self._pending.append((reqs, header, payload))
        nbytes = payload.numel() * payload.element_size()
        self.bytes_sent += nbytes
        self._reap()
        if self.tracer.on:
            self.tracer.add("send", "comm", t0, self.tracer.clock(), peer=dest, tag=tag, bytes=nbytes)

    def recv(self, source: int, tag: int, device, what: str) -> torch.Tensor:
        """Receive the tensor sent to this rank with `tag` by `source`, on `device`."""
        self._check_tag(tag)
        if source == self.rank:
            if tag not in self._local:
                raise PsrtError(f"pipeline: {what} was never produced on this rank")
            return self._local.pop(tag)
        t0 = self.tracer.clock()
        message = self._probe(source, tag, what)
        header = np.empty(_HEADER, dtype=np.int64)
        message.Recv(header)
        dtype, shape = decode_header(header)
        device = torch.device(device)
        on_device = device.type == "cuda" and self._staging.direct_cuda
        buf = torch.empty(shape, dtype=dtype, device=device if on_device else "cpu")
        self.comm.Recv(msg(buf), source, tag)
        if self.tracer.on:
            self.tracer.add("recv", "comm", t0, self.tracer.clock(), peer=source, tag=tag,
                            bytes=buf.numel() * buf.element_size())
        return buf if buf.device == device else buf.to(device)

    def _probe(self, source: int, tag: int, what: str):
        def arrived():
            self._reap()
            return self.comm.Improbe(source, tag)
        return poll(arrived, self.timeout_s, lambda: (
            f"pipeline rank {self.rank}: no {what} from pipeline rank {source} after "
            f"{self.timeout_s:g} s (did it fail or run a different schedule?)"))

    def _reap(self) -> None:
        self._pending = [p for p in self._pending if not self._mpi.Request.Testall(p[0])]

    def wait_all(self) -> None:
        """Finish every pending send (with the same deadline as a receive)."""
        def delivered():
            self._reap()
            return not self._pending
        poll(delivered, self.timeout_s, lambda: f"pipeline rank {self.rank}: {len(self._pending)} "
             f"sends not delivered after {self.timeout_s:g} s")
        if self._local:
            raise PsrtError(f"pipeline rank {self.rank}: {len(self._local)} local messages "
                            "were never consumed (the schedule and the stages disagree)")
