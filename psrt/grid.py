"""The DP x PP x TP process grid: one object, built once, passed explicitly.

Layout.  The world is a 3-d Cartesian grid with dims (pp, dp, tp) in row-major order, so
    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank:
TP ranks are adjacent (fastest-varying), then DP, then PP, the order Megatron-LM uses
(Narayanan et al., SC 2021, sec. 3.3 "tensor model parallelism within a server, pipeline
across servers").  The reason is traffic: TP all-reduces activations twice per layer in
forward and backward, on the critical path, so its ranks sit on the same host (consecutive
ranks fill a host first under mpirun's default mapping); DP all-reduces gradients once per
step and can overlap with backward; PP sends one activation per micro-batch to one
neighbour, the least traffic, so it spans hosts.

Built with MPI_Cart_create / MPI_Cart_sub (MPI 4.1 sec. 8.5), reorder=False so ranks keep
their numbers and the formula above holds on any MPI.

Naming rule, everywhere in psrt: `comm` is an mpi4py communicator and `group` a
psrt.Communicator (collectives over torch tensors on one comm); `dp_comm` / `dp_group` are
the two over the same ranks.  An argument named `comm` never accepts anything else.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from psrt.errors import PsrtError

AXES = ("pp", "dp", "tp")   # slowest to fastest varying


def coords_of(rank: int, dp: int, pp: int, tp: int) -> tuple[int, int, int]:
    """(dp_rank, pp_rank, tp_rank) of a world rank (pure; matches Cart_coords)."""
    return (rank // tp) % dp, rank // (dp * tp), rank % tp


def rank_of(dp_rank: int, pp_rank: int, tp_rank: int, dp: int, pp: int, tp: int) -> int:
    """World rank at these coordinates (pure; inverse of `coords_of`)."""
    return (pp_rank * dp + dp_rank) * tp + tp_rank


def check_degrees(dp: int, pp: int, tp: int, world_size: int) -> None:
    """PsrtError (one line, every degree named) unless dp * pp * tp == world_size."""
    degrees = {"dp": dp, "pp": pp, "tp": tp}
    bad = [k for k, v in degrees.items() if not isinstance(v, int) or v < 1]
    if bad or dp * pp * tp != world_size:
        why = f"{', '.join(bad)} must be a positive whole number" if bad else \
            f"dp x pp x tp = {dp * pp * tp}"
        raise PsrtError(f"process grid dp={dp} x pp={pp} x tp={tp} does not fit {world_size} "
                        f"ranks ({why}; it must equal the number of ranks)", everywhere=True)


def check_ep(ep: int, dp: int) -> None:
    """PsrtError unless the expert-parallel degree divides the data-parallel one: EP is carved
    out of DP (DeepSpeed-MoE, Rajbhandari et al., ICML 2022)."""
    if not isinstance(ep, int) or ep < 1 or dp % ep:
        raise PsrtError(f"--ep {ep} must divide the data-parallel degree {dp}: expert parallelism "
                        "is carved out of data parallelism", everywhere=True)


def ep_ranks(rank: int, dp: int, pp: int, tp: int, ep: int) -> list[int]:
    """World ranks of `rank`'s expert-parallel group, in ep_rank order (pure; what
    Grid.ep_comm holds): the block of ep consecutive dp ranks that contains it, at the same
    pipeline stage and TP rank."""
    d, p, t = coords_of(rank, dp, pp, tp)
    first = d - d % ep
    return [rank_of(first + i, p, t, dp, pp, tp) for i in range(ep)]


def edp_ranks(rank: int, dp: int, pp: int, tp: int, ep: int) -> list[int]:
    """World ranks of `rank`'s expert-data-parallel group, in its rank order (pure; what
    Grid.edp_comm holds): the dp ranks with the same place in their expert-parallel block,
    which hold replicas of the same experts."""
    d, p, t = coords_of(rank, dp, pp, tp)
    return [rank_of(i, p, t, dp, pp, tp) for i in range(d % ep, dp, ep)]


def infer_dp(size: int, pp: int, tp: int) -> int:
    """The data-parallel degree that fills `size` ranks with pp x tp; a one-line PsrtError
    when it is not a whole number (pure: psrt.train checks it before starting anything)."""
    if pp < 1 or tp < 1 or size % (pp * tp):
        raise PsrtError(f"process grid pp={pp} x tp={tp} does not divide {size} ranks: "
                        f"dp = {size} / {pp * tp} is not a whole number", everywhere=True)
    return size // (pp * tp)


@dataclass
class Grid:
    """This rank's place in the grid and a communicator per axis.

    Args:
        dp, pp, tp: degrees of data, pipeline and tensor parallelism; dp*pp*tp == world size.
        comm: an mpi4py communicator, usually `world.comm` (psrt's own Dup; never
            COMM_WORLD itself, so grid traffic cannot meet the user's).
        algorithm: default algorithm of the psrt Communicators over each axis.
        tracer: a psrt.trace.Tracer every axis's Communicator records its collectives into
            (default: none), so a timeline holds the DP, TP and expert collectives too.

    Attributes (set on construction):
        rank, size: in `comm`.  dp_rank, pp_rank, tp_rank: coordinates.
        cart_comm: the Cartesian communicator over all ranks (dims pp, dp, tp).
        dp_comm, pp_comm, tp_comm: mpi4py communicators along each axis (rank in them ==
            the coordinate).  dp_group, pp_group, tp_group: psrt Communicators over them.
        pp_prev, pp_next: pp_comm ranks of the previous and next pipeline rank, or
            MPI.PROC_NULL at the ends (a send to PROC_NULL is a no-op, MPI 4.1 sec. 3.11).
        ep: expert-parallel degree, dividing dp.  Each block of ep consecutive dp ranks
            shares one set of experts through all-to-all (ep_comm / ep_group, rank ep_rank);
            ranks with the same ep_rank in different blocks hold replicas of the same
            experts and reduce their gradients together (edp_comm / edp_group, the
            expert-data-parallel group).  Dense parameters reduce over all of dp.
    """

    dp: int
    pp: int
    tp: int
    comm: object = field(repr=False)
    algorithm: str = "auto"
    ep: int = 1
    tracer: object = field(default=None, repr=False)
    rank: int = field(init=False)
    size: int = field(init=False)
    dp_rank: int = field(init=False)
    pp_rank: int = field(init=False)
    tp_rank: int = field(init=False)
    cart_comm: object = field(init=False, repr=False)
    dp_comm: object = field(init=False, repr=False)
    pp_comm: object = field(init=False, repr=False)
    tp_comm: object = field(init=False, repr=False)
    dp_group: object = field(init=False, repr=False)
    pp_group: object = field(init=False, repr=False)
    tp_group: object = field(init=False, repr=False)
    pp_prev: int = field(init=False, repr=False)
    pp_next: int = field(init=False, repr=False)
    ep_rank: int = field(init=False)
    ep_comm: object = field(init=False, repr=False)
    edp_comm: object = field(init=False, repr=False)
    ep_group: object = field(init=False, repr=False)
    edp_group: object = field(init=False, repr=False)

    def __post_init__(self):
        from mpi4py import MPI

        from psrt.collectives import Communicator
        from psrt.collectives.layout import require_mpi_comm

        parent = require_mpi_comm(self.comm, "Grid")
        check_degrees(self.dp, self.pp, self.tp, parent.Get_size())
        self.cart_comm = parent.Create_cart([self.pp, self.dp, self.tp],
                                            periods=[False, False, False], reorder=False)
        self.rank, self.size = self.cart_comm.Get_rank(), self.cart_comm.Get_size()
        self.pp_rank, self.dp_rank, self.tp_rank = self.cart_comm.Get_coords(self.rank)
        self.pp_comm = self.cart_comm.Sub([True, False, False])
        self.dp_comm = self.cart_comm.Sub([False, True, False])
        self.tp_comm = self.cart_comm.Sub([False, False, True])
        # Shift along the pipeline axis of the 1-d pp communicator: PROC_NULL at the ends.
        self.pp_prev = self.pp_rank - 1 if self.pp_rank > 0 else MPI.PROC_NULL
        self.pp_next = self.pp_rank + 1 if self.pp_rank < self.pp - 1 else MPI.PROC_NULL
        def group(comm):
            return Communicator(comm, algorithm=self.algorithm, tracer=self.tracer)
        self.dp_group, self.pp_group, self.tp_group = group(self.dp_comm), group(self.pp_comm), group(self.tp_comm)
        check_ep(self.ep, self.dp)
        # the layout of ep_ranks and edp_ranks (tests/mpi/test_grid.py checks the two agree)
        self.ep_rank = self.dp_rank % self.ep
        self.ep_comm = self.dp_comm.Split(self.dp_rank // self.ep, key=self.dp_rank)
        self.edp_comm = self.dp_comm.Split(self.ep_rank, key=self.dp_rank)
        self.ep_group, self.edp_group = group(self.ep_comm), group(self.edp_comm)

    @classmethod
    def build(cls, comm, pp: int = 1, tp: int = 1, dp: int | None = None,
              algorithm: str = "auto", ep: int = 1, tracer=None) -> "Grid":
        """A grid over `comm` with dp inferred (world size / (pp * tp)) when not given."""
        from psrt.collectives.layout import require_mpi_comm
        size = require_mpi_comm(comm, "Grid.build").Get_size()
        return cls(infer_dp(size, pp, tp) if dp is None else dp, pp, tp, comm, algorithm, ep, tracer)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def coords(self) -> tuple[int, int, int]:
        """(dp_rank, pp_rank, tp_rank)."""
        return self.dp_rank, self.pp_rank, self.tp_rank

    def describe(self) -> str:
        return (f"grid dp={self.dp} x pp={self.pp} x tp={self.tp}"
                + (f" (ep={self.ep} within dp)" if self.ep > 1 else "")
                + f": rank {self.rank} at dp {self.dp_rank}, pp {self.pp_rank}, tp {self.tp_rank}"
                + (f", ep {self.ep_rank}" if self.ep > 1 else ""))

    def free(self) -> None:
        """Stop the Communicators' threads and free the sub-communicators."""
        for g in (self.dp_group, self.pp_group, self.tp_group, self.ep_group, self.edp_group):
            g.close()
        for c in (self.ep_comm, self.edp_comm, self.dp_comm, self.pp_comm, self.tp_comm, self.cart_comm):
            c.Free()
