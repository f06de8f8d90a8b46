"""What one training step of each data-parallel strategy puts on the network, and what the
alpha-beta model (psrt.collectives.cost) predicts it costs: the numbers `psrt.train` prints
beside its summary when it compares strategies.

A step is a list of phases that run one after the other; a phase is a set of transfers that
run at once, plus the sequential message latencies it pays:

- ring all-reduce (ring, native where the MPI library runs a ring, torch, horovod; zero1's
  and zero2's reduce-scatter +
  all-gather moves the same bytes): one phase, 2(N-1) steps, 2(N-1)/N x M from each rank to
  its successor (Patarasuk & Yuan, JPDC 2009), 2(H-1) of them paying the latency between H
  hosts (cost.ring_latency_steps); zero3 gathers the parameters twice (forward
  and backward) and reduce-scatters once: 3(N-1) steps and 3(N-1)/N x M (Rajbhandari et al.,
  SC 2020, sec. 7.2.2), paid once per wrapped unit in latency, which this per-step total
  leaves out (psrt/bench/step_model.py counts it);
- parameter server (ps, ps-sharded, ps-async): a push phase (every worker sends slice s of
  its gradient, M/S bytes, to each server s) and, after the update, a pull phase (each server
  sends its M/S of parameters to every worker).  The two do not overlap: a server updates
  only once every push is in (ps.py);
- the MPI library's all-reduce (native) where it runs Rabenseifner's algorithm
  (cost.native_allreduce), given both levels of a placement of several hosts: the two-level
  model's price of that algorithm (cost.predict_two_level), its 2 log2 N exchanges as the
  latency steps.

Time of a phase = latency steps x alpha + (bytes over the busiest host link direction) x beta,
the bottleneck-link form of Thakur, Rabenseifner & Gropp (IJHPCA 2005) that cost.py uses.
"""
from __future__ import annotations

from dataclasses import dataclass

from psrt.collectives import cost
from psrt.collectives.cost import Fit, link_load
from psrt.dp.roles import async_layout, ps_layout, sharded_layout

# Ring-shaped strategies and how many passes of (N-1)/N x M each step makes.
RING_PASSES = {"ring": 2, "native": 2, "torch": 2, "horovod": 2, "zero": 2, "zero1": 2, "zero2": 2, "zero3": 3}
RING_LIKE = tuple(RING_PASSES)
PS_LAYOUTS = {"ps": ps_layout, "ps-sharded": sharded_layout, "ps-async": async_layout}


@dataclass(frozen=True)
class Phase:
    transfers: list          # [(src rank, dst rank, bytes)]
    steps: int               # sequential message latencies
    ring_passes: int = 0     # a ring's passes: it pays the latency between hosts fewer times

    def latency_steps(self, host_of: list[int]) -> int:
        """The steps that pay the link's latency: every one, except for a ring, whose hops
        inside a host do not wait for those between (cost.ring_latency_steps)."""
        if not self.ring_passes:
            return self.steps
        return cost.ring_latency_steps(self.transfers, self.ring_passes, host_of)


def phases(strategy: str, size: int, nbytes: float, servers: int | None = None) -> list[Phase] | None:
    """The phases of one step of `strategy` on `size` ranks with nbytes of gradients, or None
    for a strategy the model does not cover."""
    if strategy in RING_LIKE:
        if size < 2:
            return []
        k = RING_PASSES[strategy]
        per = k * (size - 1) / size * nbytes
        return [Phase([(r, (r + 1) % size, per) for r in range(size)], k * (size - 1), k)]
    if strategy in PS_LAYOUTS:
        server_ranks, workers = PS_LAYOUTS[strategy](size, servers)
        part = nbytes / len(server_ranks)
        push = [(w, s, part) for w in workers for s in server_ranks if w != s]
        pull = [(s, w, m) for w, s, m in push]
        return [Phase(push, 1), Phase(pull, 1)]
    return None


@dataclass(frozen=True)
class Prediction:
    latency_s: float         # the alpha part of a step's communication
    bandwidth_s: float       # the beta part
    steps: int = 0           # the sequential message latencies it counts

    @property
    def total_s(self) -> float:
        return self.latency_s + self.bandwidth_s

    @property
    def regime(self) -> str:
        return "latency-bound" if self.latency_s >= self.bandwidth_s else "bandwidth-bound"


def predict(strategy: str, size: int, nbytes: float, host_of: list[int], link: Fit,
            servers: int | None = None, levels: cost.Links | None = None) -> Prediction | None:
    """Predicted communication of one step; None where the model has no phases for it.
    `levels`: both levels of a placement of several hosts (inside a host and `link` between
    them), with which `native` is priced as the algorithm the library runs."""
    library = cost.native_two_level(host_of, nbytes, levels) if strategy == "native" and levels else None
    if library is not None:
        exchanges = 2 * (size.bit_length() - 1)
        return Prediction(exchanges * link.alpha_s, max(0.0, library - exchanges * link.alpha_s), exchanges)
    steps = phases(strategy, size, nbytes, servers)
    if steps is None:
        return None
    return Prediction(sum(p.latency_steps(host_of) for p in steps) * link.alpha_s,
                      sum(link_load(p.transfers, host_of) for p in steps) * link.beta_s_per_byte,
                      sum(p.steps for p in steps))


def crossover(a: str, b: str, size: int, host_of: list[int], link: Fit, servers: int | None = None,
              levels: cost.Links | None = None, hi: float = float(1 << 40)) -> float | None:
    """The gradient size in bytes above which strategy b's step communicates faster than
    a's on this topology (bisection on a log scale): 0.0 when b is faster at every size,
    None when it is faster at none up to `hi`; `levels`: see `predict`."""
    def b_wins(m: float) -> bool:
        return (predict(b, size, m, host_of, link, servers, levels).total_s
                < predict(a, size, m, host_of, link, servers, levels).total_s)
    lo = 1.0
    if not b_wins(hi):
        return None
    if b_wins(lo):
        return 0.0
    while hi / lo > 1.001:
        mid = (lo * hi) ** 0.5
        lo, hi = (lo, mid) if b_wins(mid) else (mid, hi)
    return hi
