"""psrt's schedules and all-to-alls post a step's sends before its receives
(psrt/collectives/schedule.py, `post`): a rank late to a two-rank exchange of large messages
then sends its rendezvous header before the go-ahead for its peer's, and the two directions
flow at once instead of one after the other.  Checked on the calls each builder makes, with
a recording comm."""
import numpy as np
import torch

from psrt.collectives import schedule
from psrt.collectives.ring import schedule_allreduce


class Comm:
    """The point-to-point calls of an mpi4py Comm, recorded in order, completing at once."""

    def __init__(self):
        self.calls = []

    def _record(self, name):
        self.calls.append(name)
        return Done()

    def Isend(self, *a):
        return self._record("Isend")

    def Irecv(self, *a):
        return self._record("Irecv")

    def Send_init(self, *a):
        return self._record("Send_init")

    def Recv_init(self, *a):
        return self._record("Recv_init")

    def Sendrecv(self, *a):
        self.calls.append("Sendrecv")

    def Recv(self, *a):
        self.calls.append("Recv")


class Done:
    def Wait(self):
        pass


def test_eager_posts_every_send_before_any_receive(monkeypatch):
    monkeypatch.setattr(schedule, "_waitall", lambda reqs: None)
    comm = Comm()
    b = schedule.Eager(comm, torch.zeros(2 << 20), "sum", 7)
    b.transfer([(b.a[:1 << 20], 1)], [(b.a[1 << 20:], 1)])
    assert comm.calls == ["Isend", "Irecv"]          # not a Sendrecv, which receives first
    comm.calls.clear()
    b.start([(b.a[:10], 1), (b.a[10:20], 0)], [(b.a[20:30], 1)])
    assert comm.calls == ["Isend", "Isend", "Irecv"]


def test_a_two_rank_ring_sends_first_in_every_step(monkeypatch):
    monkeypatch.setattr(schedule, "_waitall", lambda reqs: None)
    comm = Comm()
    schedule_allreduce(schedule.Eager(comm, torch.zeros(1 << 20), "sum", 7), 2, 0)
    assert comm.calls == ["Isend", "Irecv", "Isend", "Irecv"]      # reduce-scatter, then all-gather


def test_a_plan_keeps_sendrecv_below_the_eager_limit_and_sends_first_above_it():
    small = schedule.Recorder(Comm(), np.zeros(1024, np.float32), np.add, 7)
    small.transfer([(small.a[:512], 1)], [(small.a[512:], 1)])
    assert small.steps[0][0] == small.comm.Sendrecv
    big = schedule.Recorder(Comm(), np.zeros(1 << 20, np.float32), np.add, 7)
    big.transfer([(big.a[:1 << 19], 1)], [(big.a[1 << 19:], 1)])
    fn, args = big.steps[0]
    assert fn is schedule._exchange
    posted = Comm()
    schedule._post([], posted, args[1], args[2], 7)           # _exchange's order, as _post's
    assert posted.calls == ["Isend", "Irecv"]
    persistent = schedule.Recorder(Comm(), np.zeros(1 << 20, np.float32), np.add, 7, persistent=True)
    persistent.transfer([(persistent.a[:8], 1)], [(persistent.a[8:16], 1)])
    assert persistent.comm.calls == ["Send_init", "Recv_init"]


def test_eager_keeps_sendrecv_below_the_eager_limit(monkeypatch):
    """The same rule as a plan's: one small exchange is one MPI_Sendrecv."""
    comm = Comm()
    b = schedule.Eager(comm, torch.zeros(16), "sum", 7)
    b.transfer([(torch.zeros(8), 1)], [(torch.zeros(8), 1)])
    assert comm.calls == ["Sendrecv"]


class SizedComm(Comm):
    """A recording comm that knows its rank and size, as the all-to-all asks."""

    def __init__(self, rank, size):
        super().__init__()
        self.rank, self.size = rank, size


def test_the_pairwise_all_to_all_sends_first_for_large_blocks_only(monkeypatch):
    """Its two-rank steps (EP 2's one step, EP 4's middle one) are the exchanges the ring's
    steps are: a Sendrecv there ran the two directions one after the other."""
    from psrt.collectives import alltoall
    monkeypatch.setattr(schedule, "_waitall", lambda reqs: None)
    big = 1 << 20                              # elements: 4 MiB per block, over the eager limit
    comm = SizedComm(0, 4)
    alltoall.pairwise(comm, torch.zeros(4 * big), [big] * 4, torch.zeros(4 * big), [big] * 4)
    assert comm.calls == ["Isend", "Irecv"] * 3
    small = SizedComm(0, 4)
    alltoall.pairwise(small, torch.zeros(64), [16] * 4, torch.zeros(64), [16] * 4)
    assert small.calls == ["Sendrecv"] * 3


def test_the_staged_all_to_all_sends_before_it_receives(monkeypatch):
    """The GPU path's all-to-all piece (staged through host slots) is a two-way step too."""
    from psrt.collectives.staged_plans import Exchange
    monkeypatch.setattr(schedule, "_waitall", lambda reqs: None)
    half = 1 << 15                              # elements: 128 KiB, over the eager limit
    comm = Comm()
    Exchange(comm, half=half, to=1, s=half, frm=1, g=half)(torch.zeros(2 * half))
    assert comm.calls == ["Isend", "Irecv"]
    comm.calls.clear()
    Exchange(comm, half=half, to=1, s=0, frm=1, g=half)(torch.zeros(2 * half))   # nothing to send
    assert comm.calls == ["Recv"]
