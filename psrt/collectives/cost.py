"""What a collective costs: the bytes each rank sends (`wire_bytes`, the strategies' and the
summary's count), and the alpha-beta (Hockney) model fitted to a ping-pong that predicts PS
and ring all-reduce times.

A message of m bytes costs alpha + m * beta (latency alpha, inverse bandwidth beta).  For a
collective, the time is modelled as

    T = steps * alpha + beta * (bytes over the busiest link direction)

that is, latency once per sequential step, and bandwidth limited by the one link (a host's
uplink or downlink) that carries the most.  Only links between hosts count: on the
emulated cluster the hosts' links are shaped and a host's loopback is not.  This is the
model of Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations
in MPICH", IJHPCA 19(1), 2005, with the bottleneck link made explicit so that placement
(8 hosts of one rank, or 2 hosts of 4) changes the prediction as it changes the traffic.

All-reduce of M bytes over N ranks:
- ring (Patarasuk & Yuan 2009): each rank sends 2(N-1)/N x M to its successor in 2(N-1)
  steps; a host boundary the ring crosses carries 2(N-1)/N x M each way.
- parameter server (psrt.collectives.ps, pipelined): every worker sends M to the server and
  receives M back; the server's link carries (workers on other hosts) x M each way, the two
  directions at once, plus the time to return the last pipeline segment.

All-to-all of M bytes per rank over a group of N (psrt.collectives.alltoall, pairwise
exchange): N-1 steps; at step k each rank sends its M/N block to rank r+k and receives one
from r-k, so a step costs alpha + beta x (its busiest link's bytes); with one rank per host
that is (N-1)(alpha + beta M/N) (Thakur, Rabenseifner & Gropp 2005, sec. 3.5).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Fit:
    alpha_s: float          # one-way latency of a small message
    beta_s_per_byte: float  # inverse bandwidth of large messages
    r2: float               # goodness of the bandwidth fit (1 is a straight line)

    @property
    def bandwidth_bytes_s(self) -> float:
        return 1.0 / self.beta_s_per_byte

    def time(self, nbytes: float) -> float:
        return self.alpha_s + nbytes * self.beta_s_per_byte


def fit(points: list[dict], large_bytes: int = 1 << 20) -> Fit:
    """alpha from the smallest message, beta by least squares over messages >= large_bytes.

    The two come from different sizes on purpose: a token-bucket shaper lets small
    messages through at the speed of the machine (they fit in its burst), so one straight
    line through every size would describe neither end well.
    """
    pts = sorted((p["nbytes"], p["one_way_s"]) for p in points)
    if len(pts) < 3:
        raise ValueError("fitting alpha and beta needs at least 3 ping-pong sizes")
    alpha = pts[0][1]
    big = [(m, t) for m, t in pts if m >= large_bytes]
    if len(big) < 2:
        big = pts[-2:]
    mx = statistics.fmean(m for m, _ in big)
    my = statistics.fmean(t for _, t in big)
    sxx = sum((m - mx) ** 2 for m, _ in big)
    beta = sum((m - mx) * (t - my) for m, t in big) / sxx
    if beta <= 0:
        raise ValueError("ping-pong times do not grow with message size; cannot fit beta")
    intercept = my - beta * mx
    ss_res = sum((t - intercept - beta * m) ** 2 for m, t in big)
    ss_tot = sum((t - my) ** 2 for _, t in big)
    return Fit(alpha, beta, 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0)


def link_load(transfers: list[tuple[int, int, float]], host_of: list[int]) -> float:
    """Bytes over the busiest host link direction: max over hosts of what leaves it and
    what enters it, counting only transfers between different hosts."""
    out: dict[int, float] = {}
    into: dict[int, float] = {}
    for src, dst, nbytes in transfers:
        a, b = host_of[src], host_of[dst]
        if a != b:
            out[a] = out.get(a, 0.0) + nbytes
            into[b] = into.get(b, 0.0) + nbytes
    return max(list(out.values()) + list(into.values()) + [0.0])


def transfers(algorithm: str, n: int, nbytes: float, root: int = 0) -> tuple[list, int]:
    """([(src, dst, bytes)], sequential steps) of one all-reduce."""
    if algorithm == "ring":
        per = 2 * (n - 1) / n * nbytes
        return [(r, (r + 1) % n, per) for r in range(n)], 2 * (n - 1)
    if algorithm == "ps":
        workers = [r for r in range(n) if r != root]
        return [(w, root, nbytes) for w in workers] + [(root, w, nbytes) for w in workers], 2
    raise ValueError(f"no alpha-beta model for {algorithm!r} (ring, ps)")


def predict(algorithm: str, n: int, nbytes: float, host_of: list[int], model: Fit,
            segment_bytes: int | None = None) -> float | None:
    """Predicted all-reduce time in seconds, or None when no rank pair crosses a link."""
    if n < 2 or len(set(host_of[:n])) < 2:
        return None
    moves, steps = transfers(algorithm, n, nbytes)
    busiest = link_load(moves, host_of)
    extra = 0.0
    if algorithm == "ps":
        # The last segment still has to go back once everything has arrived.
        from psrt.collectives.ps import PIPELINE_BYTES
        seg = min(segment_bytes or PIPELINE_BYTES, nbytes)
        remote = sum(1 for r in range(1, n) if host_of[r] != host_of[0])
        extra = remote * seg * model.beta_s_per_byte
    return steps * model.alpha_s + busiest * model.beta_s_per_byte + extra


def predict_alltoall(groups: list[list[int]], nbytes: float, host_of: list[int], model: Fit) -> float | None:
    """Predicted time in seconds of the pairwise all-to-all of `nbytes` per rank in every
    group of `groups` at once (equal sizes; world ranks in group order), or None when no
    step crosses a link: each step is charged alpha + beta x the bytes of the busiest host
    link direction, counting every group's transfers of that step."""
    n = len(groups[0])
    total, crossed = 0.0, False
    for k in range(1, n):
        moves = [(g[i], g[(i + k) % n], nbytes / n) for g in groups for i in range(n)]
        busiest = link_load(moves, host_of)
        crossed |= busiest > 0
        total += model.alpha_s + busiest * model.beta_s_per_byte
    return total if crossed else None


def wire_bytes(collective: str, algorithm: str, nbytes: int, size: int, rank: int) -> int:
    """Bytes `rank` sends in one `collective` of an `nbytes` buffer over `size` ranks.

    Counted from each algorithm's schedule as psrt/collectives writes it out (the extra
    fold step of recursive doubling on a non-power-of-two size is left out).  For the MPI
    library ('native') and gloo ('torch'), whose choice of algorithm is internal, the
    bandwidth-optimal ring figure is used, which is what both pick for large messages.
    """
    n, m = size, nbytes
    if n == 1 or m == 0:
        return 0
    part = m / n
    if collective in ("reduce_scatter", "allgather"):
        if algorithm == "ps":   # everything through rank 0 (see ps.py)
            if collective == "reduce_scatter":   # reduce to 0, 0 sends each rank its part
                return int((n - 1) * part) if rank == 0 else m
            return (n - 1) * m if rank == 0 else int(part)   # gather to 0, 0 broadcasts
        return int((n - 1) * part)
    if collective != "allreduce":
        raise ValueError(f"wire_bytes: unknown collective {collective!r}")
    if algorithm == "ps":      # reduce to rank 0, then rank 0 sends the result to each worker
        return (n - 1) * m if rank == 0 else m
    if algorithm == "doubling":
        return (n - 1).bit_length() * m
    if algorithm == "tree":    # binomial reduce (send once) + broadcast (send to each child)
        vr, children, mask = rank, 0, 1
        while mask < n and not vr & mask:
            children += vr + mask < n
            mask <<= 1
        return (m if rank else 0) + children * m
    return int(2 * (n - 1) * part)   # ring, halving-doubling, native, torch


# ------------------------------------------------------------------ two levels
# A rank waiting for a message on a host running more ranks than it has cores often waits
# for its sender to be scheduled: each sequential step of a collective pays (ranks per core
# - 1) x WAIT_S.  The constant is fitted to the training step, where it matters: ZeRO-3's
# step on crowded hosts is nearly all its per-layer gathers and reduce-scatters in a row, so
# its cells in `psrt.bench scaling` measure the wait best.  Over a full run of that table and
# a second run of its ZeRO-3 cells (ResNet-50 and VGG-16, 2x2 to 4x4 emulated hosts with
# shared memory inside each, on 2 cores), 125-135 us kept every ZeRO-3 cell within about 15%
# of the step model; 200 us put ResNet-50's 8- and 16-rank cells 20-34% under it, 100 us
# VGG-16's 16-rank cell 25% over.  The same cells moved by up to 15% between the two runs.
# A collective alone waits less than inside a training step (the flat ring's per-step excess
# at 16 KiB, benched alone, was about 20 us on 2 hosts of 4 ranks and 200 us on 4 hosts of
# 4: 7 and 29 us per rank too many), so the model over-charges many small collectives run
# by themselves (the small-bucket table in docs/explanation/scaling.md).
# `Links(wait_s=...)` takes another value.
WAIT_S = 0.13e-3


@dataclass(frozen=True)
class Links:
    """The two levels of a placement: `intra` fitted between two ranks of one host, `inter`
    between two hosts; `crowd` = ranks per core on the busiest host (1 when none waits);
    `wait_s` = what each sequential step waits per rank too many on a core."""
    intra: Fit
    inter: Fit
    crowd: float = 1.0
    wait_s: float = WAIT_S

    def step_wait(self) -> float:
        return max(0.0, self.crowd - 1.0) * self.wait_s


# Below this psrt.collectives.hierarchical all-reduces through one rank per host, above it
# through a shard per local rank (why: there).
LEADER_BYTES = 1 << 20
# ... and among the hosts' first ranks, psrt's recursive doubling below this, psrt's ring
# from it.  Where latency rules, log2(H) rounds between hosts are what the hierarchical
# all-reduce saves: a flat ring pays the latency between hosts 2(H-1) times (`_ring_rounds`),
# as many times as a ring among the first ranks would.  Where bytes rule, doubling puts
# log2(H) x M on each host's link against the ring's 2(H-1)/H x M.  The whole hierarchical
# all-reduce on 4 emulated hosts at 250 Mbit/s, calls back to back without the agreement
# (PSRT_CHECK=off), doubling against the ring among the first ranks: 4 hosts of 4 ranks,
# 32 KiB 2.12 against 2.65 ms, 64 KiB 4.42 against 3.27 ms, 512 KiB 35.5 against 26.9 ms;
# 4 hosts of 2, 32 KiB 2.20 against 1.99 ms, 64 KiB 4.43 against 3.31 ms.  With a one-way
# delay of 5 ms on every link, 4 hosts of 4, 32 KiB: 13.3 ms, against 24.7 ms for the MPI
# library's all-reduce among them (its ring from 10,000 bytes).
LEADERS_RING_BYTES = 64 << 10

# The MPI library's own all-reduce ('native'), as Open MPI 4.1's fixed rules choose it
# (ompi/mca/coll/tuned/coll_tuned_decision_fixed.c, ompi_coll_tuned_allreduce_intra_dec_fixed,
# v4.1.4): Rabenseifner's algorithm for a commutative all-reduce of at least these bytes on
# at most these ranks; the model charges the ring elsewhere.
RABENSEIFNER_FROM = ((3, 256 << 10), (15, 8 << 10), (31, 4 << 10))
# Rabenseifner's steps are two-way exchanges; the links are full duplex, so each is charged
# one direction's bytes where every rank has a core of its own (2 hosts of one rank,
# 250 Mbit/s: the library's all-reduce at the link's rate each way, as psrt's ring).  Where
# ranks share cores, each exchange waits for the later of its two ranks, and a rank late to
# one exchange between hosts comes late to the next: the drift grows with the levels of
# hosts the algorithm crosses (log2 of the hosts: one exchange between hosts each way on 2
# hosts, two on 4).  The model charges each exchange between hosts 1 + DRIFT x those levels
# times its bytes on crowded hosts (`exchange_charge`).  Chosen on `psrt.bench scaling`'s
# `native` cells (ResNet-50 and VGG-16, 2x2 to 4x4 at 250 Mbit/s, each layout's link backed
# out of its ring cell): one direction left the 2-host cells 7-20% over and the 4-host ones
# 34-51% over; 0.25 puts all eight within 10% (-9% to +10%), 0.3 within 12% (-12% to +4%),
# and one charge of 1.4 on every layout left two of them beyond 15%.
DRIFT = 0.25


def exchange_charge(links: "Links", hosts: int) -> float:
    """What an exchange between hosts is charged, in one direction's bytes (see DRIFT)."""
    return 1.0 + DRIFT * math.log2(hosts) if links.crowd > 1.0 else 1.0


def native_allreduce(n: int, nbytes: float) -> str:
    """The schedule the model charges the MPI library's all-reduce of `nbytes` on `n` ranks:
    'rabenseifner' where Open MPI 4.1's fixed rules run it on a power of two of ranks,
    else 'ring'."""
    if n < 2 or n & (n - 1):
        return "ring"
    for most, least in RABENSEIFNER_FROM:
        if n <= most:
            return "rabenseifner" if nbytes >= least else "ring"
    return "ring"


def native_two_level(host_of: list[int], nbytes: float, links: Links) -> float | None:
    """The two-level model's price of the MPI library's all-reduce where the library runs
    Rabenseifner's algorithm (`native_allreduce`) on a placement of several hosts; None
    elsewhere, where the flat models charge it the ring."""
    if len(set(host_of)) < 2 or native_allreduce(len(host_of), nbytes) != "rabenseifner":
        return None
    return predict_two_level("rabenseifner", host_of, nbytes, links)


def _rabenseifner_rounds(host_of: list[int], nbytes: float, charge: float) -> list[tuple[list, int]]:
    """Reduce-scatter by recursive halving (rank r exchanges half of what it holds with r ^ 1,
    then a quarter with r ^ 2, ...), then all-gather by recursive doubling, the same
    exchanges in reverse (Thakur, Rabenseifner & Gropp 2005, sec. 4.4; Open MPI's
    allreduce_intra_redscat_allgather).  A power of two of ranks; the exchanges between
    hosts carry `charge` x their bytes."""
    n = len(host_of)
    out, m, mask = [], nbytes / 2, 1
    while mask < n:
        out.append(([(r, r ^ mask, m * (charge if host_of[r] != host_of[r ^ mask] else 1.0))
                     for r in range(n)], 1))
        m, mask = m / 2, mask << 1
    return out + out[::-1]


# Assumed when nothing was measured ('auto' decides before any ping-pong): a gigabit
# Ethernet link between hosts and shared memory inside one.
DEFAULT_LINKS = Links(Fit(2e-6, 1 / 4e9, 1.0), Fit(50e-6, 1 / 125e6, 1.0))


def _round_time(moves: list, host_of: list[int], links: Links) -> float:
    """One round of transfers that run at once, less the latency between hosts (`rounds`
    says how many times that is paid): the slower of its two levels, each charged beta x the
    bytes of its busiest link direction (a host's uplink or downlink between hosts; one
    rank's send or receive inside a host, with alpha and slowed by crowding)."""
    inter = link_load(moves, host_of)
    per_rank: dict = {}
    for src, dst, m in moves:
        if host_of[src] == host_of[dst] and src != dst:
            per_rank[("out", src)] = per_rank.get(("out", src), 0.0) + m
            per_rank[("in", dst)] = per_rank.get(("in", dst), 0.0) + m
    t = inter * links.inter.beta_s_per_byte
    if per_rank:
        t = max(t, links.intra.alpha_s + max(per_rank.values()) * links.intra.beta_s_per_byte * max(links.crowd, 1.0))
    return t + (links.step_wait() if moves else 0.0)


def _ring_rounds(members: list[int], nbytes: float, passes: int, host_of: list[int]) -> list[tuple]:
    """A ring's rounds, and how many of them pay the latency between hosts.  Each rank sends
    on what it received in the round before, and rounds of successive chunks overlap, so a
    hop inside a host does not wait for one between hosts: of the passes x (n-1) rounds, a
    ring whose n edges cross a host boundary c times pays passes x (c-1) of them between
    hosts, 2(H-1) for an all-reduce over H hosts of ranks in host order, as NCCL's tuning
    model charges a ring (src/graph/tuning.cc: nInterSteps = 2(nNodes-1) of the 2(nRanks-1)
    steps); every round when each edge crosses one."""
    n = len(members)
    if n < 2:
        return []
    moves = [(members[i], members[(i + 1) % n], nbytes / n) for i in range(n)]
    return [(moves, passes * (n - 1), ring_latency_steps(moves, passes, host_of))]


def ring_latency_steps(edges: list, passes: int, host_of: list[int]) -> int:
    """How many of a ring's rounds pay the latency between hosts (`_ring_rounds`): passes x
    (c-1) for c of its edges (src, dst, ...) crossing a host boundary, 0 when none does."""
    crossing = sum(host_of[e[0]] != host_of[e[1]] for e in edges)
    return passes * (crossing - 1) if crossing else 0


def _doubling_rounds(members: list[int], nbytes: float, charge: float) -> list[tuple]:
    """Recursive doubling among `members` (psrt.collectives.recursive: N not a power of two is
    folded onto p = 2**k first and unfolded after); exchanges carry `charge` x their bytes."""
    n = len(members)
    if n < 2:
        return []
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    fold = [(members[2 * i], members[2 * i + 1], nbytes) for i in range(rem)]
    live = [members[2 * i + 1] for i in range(rem)] + members[2 * rem:]
    out = [(fold, 1, 1)] if fold else []
    mask = 1
    while mask < p:
        out.append(([(live[i], live[i ^ mask], nbytes * charge) for i in range(p)], 1, 1))
        mask <<= 1
    return out + ([([(d, s, m) for s, d, m in fold], 1, 1)] if fold else [])


def _by_host(host_of: list[int]) -> list[list[int]]:
    hosts: dict = {}
    for r, h in enumerate(host_of):
        hosts.setdefault(h, []).append(r)
    return list(hosts.values())


def rounds(algorithm: str, host_of: list[int], nbytes: float, pipelined: bool = True,
           charge: float = 1.0) -> list[tuple[list, int, float]]:
    """[(transfers of one round, times it repeats, times it pays the latency between hosts)]
    of one all-reduce of `nbytes` on the placement `host_of` (rank -> host): flat ring (its
    latency between hosts paid 2(H-1) times, `_ring_rounds`), hierarchical
    (psrt.collectives.hierarchical: inside each host, a ring per shard between hosts, inside
    again; below LEADER_BYTES through each host's first rank, recursive doubling among those
    below LEADERS_RING_BYTES), ps
    (everything through rank 0, pipelined so both directions run at once), ps-local (the
    same between one rank per host after a reduction inside each host, psrt.dp.ps's
    --local-aggregation), tree (binomial reduce then broadcast) and rabenseifner (the MPI
    library's, `native_allreduce`; `charge`: what each of its exchanges between hosts is
    charged, `exchange_charge`).  `pipelined` False: the
    ps family's push and pull one after the other, as psrt.dp.ps trains (its server updates
    between them)."""
    n = len(host_of)
    hosts = _by_host(host_of)
    if algorithm == "ring":
        return _ring_rounds(list(range(n)), nbytes, 2, host_of)
    if algorithm == "hierarchical" and nbytes < LEADER_BYTES:
        leaders = [h[0] for h in hosts]
        gather = [(r, h[0], nbytes) for h in hosts for r in h[1:]]
        out = [(gather, 1, 1)] if gather else []
        out += (_doubling_rounds(leaders, nbytes, charge) if nbytes < LEADERS_RING_BYTES
                else _ring_rounds(leaders, nbytes, 2, host_of))
        return out + ([([(d, s, m) for s, d, m in gather], 1, 1)] if gather else [])
    if algorithm == "hierarchical":
        shards = max(len(h) for h in hosts)
        inside = [r[0] for h in hosts for r in _ring_rounds(h, nbytes, 1, host_of)]
        inside_moves = [x for m in inside for x in m]
        steps_in = max(len(h) for h in hosts) - 1
        cross = []
        for s in range(shards):
            holders = [h[s % len(h)] for h in hosts]
            cross += [x for r in _ring_rounds(holders, nbytes / shards, 2, host_of) for x in r[0]]
        out = [(inside_moves, steps_in, steps_in)] if steps_in else []
        out += [(cross, 2 * (len(hosts) - 1), 2 * (len(hosts) - 1))] if len(hosts) > 1 else []
        return out + out[:1] if steps_in else out
    if algorithm in ("ps", "ps-local"):
        lead = [h[0] for h in hosts] if algorithm == "ps-local" else list(range(n))
        gather = [(r, h[0], nbytes) for h in hosts for r in h[1:]] if algorithm == "ps-local" else []
        push = [(w, lead[0], nbytes) for w in lead[1:]]
        pull = [(d, s, m) for s, d, m in push]
        spread = [(d, s, m) for s, d, m in gather]
        middle = [push + pull] if pipelined else [push, pull]
        return [(r, 1, 1) for r in (gather, *middle, spread) if r]
    if algorithm == "rabenseifner":
        if n & (n - 1):
            raise ValueError(f"rabenseifner: {n} ranks, not a power of two")
        return [(moves, times, times) for moves, times in _rabenseifner_rounds(host_of, nbytes, charge)]
    if algorithm == "tree":
        out, mask = [], 1
        while mask < n:
            out.append(([(r, r - mask, nbytes) for r in range(n) if r & mask and not r & (mask - 1)], 1, 1))
            mask <<= 1
        return out + [([(d, s, m) for s, d, m in moves], 1, 1) for moves, _, _ in reversed(out)]
    raise ValueError(f"no two-level model for {algorithm!r} (ring, hierarchical, ps, ps-local, tree, rabenseifner)")


TWO_LEVEL = ("ring", "hierarchical", "ps", "ps-local", "tree")


def predict_two_level(algorithm: str, host_of: list[int], nbytes: float, links: Links,
                      pipelined: bool = True) -> float:
    """Predicted all-reduce time in seconds on this placement: the sum over rounds of the
    slower level's alpha + beta x busiest link (Thakur, Rabenseifner & Gropp 2005, with the
    host boundary of Sack & Gropp's two-level model, "Collective algorithms for multiported
    torus networks", TOPC 2015, sec. 2) plus the crowding wait per round.  The ps family
    adds the return of its last pipeline segment, as `predict` does (`pipelined`: see rounds)."""
    charge = exchange_charge(links, len(set(host_of)))
    total = sum(_round_time(moves, host_of, links) * times
                + (links.inter.alpha_s * hops if any(host_of[s] != host_of[d] for s, d, _ in moves) else 0.0)
                for moves, times, hops in rounds(algorithm, host_of, nbytes, pipelined, charge))
    if algorithm in ("ps", "ps-local") and pipelined and len(set(host_of)) > 1:
        from psrt.collectives.ps import PIPELINE_BYTES
        lead = [h[0] for h in _by_host(host_of)] if algorithm == "ps-local" else range(len(host_of))
        remote = sum(1 for r in lead if host_of[r] != host_of[0])
        total += remote * min(PIPELINE_BYTES, nbytes) * links.inter.beta_s_per_byte
    return total
