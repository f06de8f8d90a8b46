"""A training step's predicted time on a placement: a profile's compute plus the strategy's
communication from psrt's alpha-beta models, with the overlap of backward the strategy has.

    step = forward + max(backward, comm)   ring-like with overlap, given only the total
                                           (DDP buckets reduce while backward runs: Li et al.,
                                           "PyTorch Distributed", VLDB 2020, sec. 3.2.3)
    step = forward + max(backward, end)    the same given the buckets: gradients grouped in
                                           backward order into buckets of at least the bucket
                                           size (psrt.collectives.layout.group_by_size), each ready when
                                           its last gradient appears and reduced after the one
                                           before it (one stream), so `end` = the last bucket's
                                           end; a model whose gradients fit one bucket hides
                                           nothing
    step = forward + backward + comm       the parameter servers (a worker pushes after its
                                           backward and waits for the pull: psrt/dp/ps.py)
    step = the end of a timeline           zero3: unit by unit, each unit's compute waits
                                           for its all-gather, the next unit's gather starts
                                           as it computes (prefetch), each unit's reduce-
                                           scatter starts after its backward, at most two in
                                           flight, all of them on one queue in call order
                                           (psrt.dp.zero3, psrt.collectives.executor)

comm: the flat strategies from psrt.dp.traffic (bottleneck link per phase, Thakur,
Rabenseifner & Gropp 2005); the hierarchical all-reduce, the parameter server with local
aggregation and the MPI library's all-reduce where it runs Rabenseifner's algorithm
(cost.native_allreduce) from the two-level model (psrt.collectives.cost.predict_two_level).  Per-host
NIC sharing is in both: every transfer leaving a host is charged to that host's link.  Both
charge each sequential message the wait for a core on a crowded host (cost.Links.step_wait).
zero3 runs its three collectives once per unit (psrt.dp.zero3: each layer of a profile), so
it pays their sequential messages once per unit: units x 3(N-1) of them; what its prefetch
hides behind compute is what the timeline (`zero3_step`) leaves out of the step.

No torch and no MPI here: tests/unit/test_scaling_model.py checks it alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from psrt.collectives import cost
from psrt.collectives.layout import group_by_size
from psrt.dp import DEFAULT_BUCKET_MB, traffic

# psrt.train's default --bucket-mb, which the scaling bench's runs keep.
BUCKET_BYTES = DEFAULT_BUCKET_MB * 2 ** 20


def bucket_bytes(bucket_mb: float | None) -> float:
    """DDP's bucket size in bytes for a --bucket-mb (None: psrt.train's default)."""
    return BUCKET_BYTES if bucket_mb is None else bucket_mb * 2 ** 20


OVERLAPPED = ("ring", "native", "zero1", "zero2", "ring-hier", "ring-auto")
# The cells' names for the strategies that need a flag besides --dp.
VARIANTS = {"ring-hier": ("ring", ["--algorithm", "hierarchical"]),
            "ps-local": ("ps", ["--local-aggregation"]),
            "ring-auto": ("ring", ["--algorithm", "auto"])}


@dataclass(frozen=True)
class Step:
    compute_s: float
    comm_s: float
    step_s: float

    @property
    def bound(self) -> str:
        """What the model says sets the step: the link or the compute."""
        return "link" if self.comm_s > self.compute_s else "compute"


def comm_time(strategy: str, host_of: list[int], grad_bytes: float, links: cost.Links,
              units: int = 1) -> float | None:
    """Predicted communication of one step of `strategy` (a cell name: ring-hier, ps-local
    included) on the placement host_of (rank -> host), or None where no model covers it;
    `units`: zero3's number of units (`units`)."""
    n = len(host_of)
    if n < 2:
        return 0.0
    if strategy == "ring-auto":             # the model's own choice: the faster of the two
        return min(comm_time("ring", host_of, grad_bytes, links), comm_time("ring-hier", host_of, grad_bytes, links))
    if strategy == "ring-hier":
        return cost.predict_two_level("hierarchical", host_of, grad_bytes, links)
    if strategy == "ps-local":            # the server updates between the push and the pull
        return cost.predict_two_level("ps-local", host_of, grad_bytes, links, pipelined=False)
    library = cost.native_two_level(host_of, grad_bytes, links) if strategy == "native" else None
    if library is not None:
        return library
    one_node = len(set(host_of)) == 1
    # one node: every rank's bytes cross its own link inside the node (NVLink, PCIe, shared
    # memory), which the flat models would not charge (they count only links between hosts)
    where = list(range(n)) if one_node else host_of
    p = traffic.predict(strategy, n, grad_bytes, where, links.intra if one_node else links.inter)
    if p is None:
        return None
    calls = units if strategy == "zero3" else 1
    return p.bandwidth_s + calls * (p.latency_s + p.steps * links.step_wait())


def predict_step(strategy: str, forward_s: float, backward_s: float, host_of: list[int], grad_bytes: float,
                 links: cost.Links, buckets: list[tuple[float, int]] | None = None,
                 units: list[Unit] | None = None) -> Step | None:
    """The step of `strategy` (see the module); None where no model covers it.  `buckets`:
    (seconds from the start of backward at which it is ready, bytes) of each gradient bucket in
    launch order (`gradient_buckets`); without them the overlapped strategies hide all of
    their communication behind backward that backward's length allows; `units`: zero3's
    (`units`), without which zero3 is one unit that hides nothing."""
    comm = comm_time(strategy, host_of, grad_bytes, links, len(units) if units else 1)
    if comm is None:
        return None
    if strategy == "zero3" and units and len(host_of) > 1:
        return Step(forward_s + backward_s, comm, zero3_step(host_of, units, links))
    if strategy not in OVERLAPPED:
        return Step(forward_s + backward_s, comm, forward_s + backward_s + comm)
    if not buckets:
        return Step(forward_s + backward_s, comm, forward_s + max(backward_s, comm))
    end, total = 0.0, 0.0
    for ready_s, nbytes in buckets:
        each = comm_time(strategy, host_of, nbytes, links)
        end, total = max(end, ready_s) + each, total + each
    return Step(forward_s + backward_s, total, forward_s + max(backward_s, end))


def gradient_buckets(profile, bucket_bytes: float, itemsize: int = 4) -> list[tuple[float, int]]:
    """(ready seconds from the start of backward, bytes) of each bucket psrt's DDP makes of a
    profile's gradients: tensors in backward order (the last layer's first) grouped by DDP's
    rule (psrt.collectives.layout.group_by_size), each bucket ready when its last tensor's
    layer has finished its backward (Profile.gradient_times)."""
    tensors = [(at, math.prod(shape) * itemsize)
               for layer, at in reversed(list(zip(profile.layers, profile.gradient_times())))
               for _, shape in reversed(layer.params)]
    return [(tensors[idx[-1]][0], sum(tensors[i][1] for i in idx))
            for idx in group_by_size([n for _, n in tensors], bucket_bytes)]


@dataclass(frozen=True)
class Unit:
    """One of zero3's units: its forward and backward seconds and its parameters' bytes."""
    forward_s: float
    backward_s: float
    nbytes: float


def units(profile, itemsize: int = 4) -> list[Unit]:
    """zero3's units on a profile's model, in forward order: each layer holding parameters
    (psrt.dp.zero3.wrap_units).  A layer without parameters computes between two units, so
    its times join the unit before it (the first unit, where none is before it)."""
    out: list[Unit] = []
    lead_f = lead_b = 0.0
    for layer in profile.layers:
        if layer.params:
            out.append(Unit(layer.forward_s + lead_f, layer.backward_s + lead_b, layer.numel * itemsize))
            lead_f = lead_b = 0.0
        elif out:
            last = out[-1]
            out[-1] = Unit(last.forward_s + layer.forward_s, last.backward_s + layer.backward_s, last.nbytes)
        else:
            lead_f, lead_b = lead_f + layer.forward_s, lead_b + layer.backward_s
    return out


# psrt.dp.zero3's gradient reduce-scatters in flight at once (Zero3.IN_FLIGHT).
ZERO3_IN_FLIGHT = 2


def zero3_step(host_of: list[int], units: list[Unit], links: cost.Links,
               in_flight: int = ZERO3_IN_FLIGHT) -> float:
    """zero3's step on a timeline, as psrt.dp.zero3 runs it: forward gathers unit 0, then
    each unit waits for its gather, starts the next unit's (prefetch) and computes; backward
    gathers the last unit again (forward freed it), then each unit waits for its gather,
    starts the previous unit's, computes, and starts its reduce-scatter, waiting first for
    the oldest while `in_flight` are pending; the step ends when the last reduce-scatter
    does.  Every collective runs on one queue in call order (psrt.collectives.executor), an
    all-gather or a reduce-scatter of a unit taking a third of zero3's traffic for its bytes
    (psrt.dp.traffic: three ring passes a unit)."""
    def each(u: Unit) -> float:
        return comm_time("zero3", host_of, u.nbytes, links) / 3
    free = 0.0                                  # when the queue has run what it was given

    def start(at: float, seconds: float) -> float:
        nonlocal free
        free = max(free, at) + seconds
        return free
    last = len(units) - 1
    t = 0.0
    ready = start(t, each(units[0]))
    for k, u in enumerate(units):
        t = max(t, ready)
        if k < last:
            ready = start(t, each(units[k + 1]))
        t += u.forward_s
    ready = start(t, each(units[last]))
    pending: list[float] = []
    for k in range(last, -1, -1):
        t = max(t, ready)
        if k > 0:
            ready = start(t, each(units[k - 1]))
        t += units[k].backward_s
        while len(pending) >= in_flight:
            t = max(t, pending.pop(0))
        pending.append(start(t, each(units[k])))
    return max([t] + pending)


def placement(hosts: int, per_host: int) -> list[int]:
    """rank -> host for `hosts` hosts of `per_host` ranks, ranks filling a host first."""
    return [r // per_host for r in range(hosts * per_host)]


def speedup(workers: int, one_s: float, step_s: float) -> float:
    """Weak scaling (each worker its own batch): samples per second against one worker's."""
    return workers * one_s / step_s
