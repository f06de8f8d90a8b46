"""Point-to-point transfer of activations and gradients between pipeline ranks.

Each tensor travels as two messages with the same tag: a fixed-size header (dtype, shape)
and the payload.  The receiver takes the header with a matched probe (MPI_Improbe/Mrecv,
MPI 4.1 sec. 3.8.2), allocates, then receives the payload: MPI's non-overtaking rule
(sec. 3.5) keeps the two in order, so shapes may change from one micro-batch to the next
with no separate handshake.  Sends are non-blocking (Isend), so two neighbours that both
send before they receive cannot deadlock, and a receive polls with a deadline, so a missing
peer becomes an error naming it instead of a hang.

The payload travels as messages of at most one host slot (4 MiB) each, in order.  CUDA
tensors go to MPI directly when it is CUDA-aware; otherwise they are staged through pinned
host slots (collectives/staged.py `Slots`), taken from a pool that grows only to the largest
number in flight and is reused after that, and moved in pieces so that copies and transfers
overlap: a send copies piece i+1 down on a copy stream while piece i is already on its way;
a receive copies piece i up while piece i+1 still arrives.  A send's slots go back to the
pool when its transfer is done, a receive's once their copy up has run.
"""
from __future__ import annotations

import numpy as np
import torch

from psrt import env
from psrt.collectives.p2p import poll
from psrt.collectives.staged import Slots, Stager, chunks
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
        self._stager = Stager()              # the copy streams of each GPU
        self._slots = Slots()                # pinned host slots of staged payloads
        self._pending: list[tuple] = []      # (requests, buffers kept alive, slots to give back)
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
        payload = t.contiguous().view(-1)
        reqs = [self.comm.Isend(header, dest, tag)]
        if self._staged(payload.device):
            slots = self._send_staged(payload, dest, tag, reqs)
        else:
            slots = []
            reqs += [self.comm.Isend(msg(payload[s:s + n]), dest, tag) for s, n in self._pieces(payload)]
        self._pending.append((reqs, (header, payload), slots))
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
        buf = torch.empty(shape, dtype=dtype, device=device)
        if self._staged(buf.device):
            self._recv_staged(buf.view(-1), source, tag, what)
        else:
            for s, n in self._pieces(buf.view(-1)):
                self._arrived(self.comm.Irecv(msg(buf.view(-1)[s:s + n]), source, tag), source, what)
        if self.tracer.on:
            self.tracer.add("recv", "comm", t0, self.tracer.clock(), peer=source, tag=tag,
                            bytes=buf.numel() * buf.element_size())
        return buf

    # ------------------------------------------------------------ payloads in pieces
    def _staged(self, device: torch.device) -> bool:
        """Whether a payload on `device` moves through pinned host slots."""
        return device.type == "cuda" and not self._staging.direct_cuda

    def _pieces(self, flat: torch.Tensor) -> list[tuple[int, int]]:
        """(start, length) of each message of a payload: at most one slot each, so that
        both ends, staged or not, cut it the same way."""
        return chunks(flat.numel(), max(1, self._slots.chunk_bytes // flat.element_size()))

    def _send_staged(self, flat: torch.Tensor, dest: int, tag: int, reqs: list) -> list:
        """Queue every piece's copy down, then send each as soon as its copy is done (the
        next copies run meanwhile); returns the slots, given back when the sends are done."""
        lanes = self._stager.lanes(flat.device)
        lanes.begin()
        slots, copied = [], []
        for s, n in self._pieces(flat):
            slots.append(self._slots.take())
            host = slots[-1].view(flat.dtype)[:n]
            copied.append((host, lanes.copy("down", host, flat[s:s + n])))
        for host, event in copied:
            lanes.wait(event)
            reqs.append(self.comm.Isend(msg(host), dest, tag))
        return slots

    def _arrived(self, req, source: int, what: str) -> None:
        """Wait for one piece of a payload whose header came, with the receive's deadline: a
        sender lost between its header and its payload is an error naming it, not a hang."""
        poll(req.Test, self.timeout_s, lambda: (
            f"pipeline rank {self.rank}: {what} from pipeline rank {source} stopped arriving after "
            f"{self.timeout_s:g} s (did it fail?)"))

    def _recv_staged(self, flat: torch.Tensor, source: int, tag: int, what: str) -> None:
        """Receive every piece into a slot at once, and copy each up as soon as it is in."""
        lanes = self._stager.lanes(flat.device)
        lanes.begin()
        parts = self._pieces(flat)
        slots = [self._slots.take() for _ in parts]
        hosts = [slot.view(flat.dtype)[:n] for slot, (_, n) in zip(slots, parts)]
        reqs = [self.comm.Irecv(msg(host), source, tag) for host in hosts]
        for (s, n), slot, host, req in zip(parts, slots, hosts, reqs):
            self._arrived(req, source, what)
            self._slots.give(slot, lanes.copy("up", flat[s:s + n], host), lanes)
        lanes.finish(flat)

    def _probe(self, source: int, tag: int, what: str):
        def arrived():
            self._reap()
            return self.comm.Improbe(source, tag)
        return poll(arrived, self.timeout_s, lambda: (
            f"pipeline rank {self.rank}: no {what} from pipeline rank {source} after "
            f"{self.timeout_s:g} s (did it fail or run a different schedule?)"))

    def _reap(self) -> None:
        still = []
        for pending in self._pending:
            if self._mpi.Request.Testall(pending[0]):
                for slot in pending[2]:
                    self._slots.give(slot)
            else:
                still.append(pending)
        self._pending = still

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
