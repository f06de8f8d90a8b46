"""`python -m psrt.bench pingpong`: the one-way time between the first and last rank, and its
alpha-beta fit (the measurement is psrt.collectives.pingpong).  With `--device`, tensors on
that device make the round trips through the pipeline's sends (psrt/pp/p2p.py: a header and
the payload in pieces; on a GPU without a CUDA-aware MPI, staged through pinned slots), the
one-way time of a pipeline's activations."""
from __future__ import annotations

import sys

from psrt.collectives.pingpong import TAG, measure_fit, raw_trips
from psrt.errors import PsrtError


HELP = "one-way time between the first and last rank, and the alpha-beta fit (run under mpirun, one rank per host)"


def add_arguments(p) -> None:
    from psrt.bench.collectives import add_size_arguments
    add_size_arguments(p, "8", "16MiB")
    p.add_argument("--repeats", type=int, default=5)
    from psrt.dp import device
    device.add_argument(p, "ping-pong tensors on this device through the pipeline's sends instead of "
                           "NumPy buffers through MPI", default=None)
    p.add_argument("--json", help="write points and fit as JSON")
    p.add_argument("--quiet", action="store_true")


def check(args) -> None:
    from psrt.bench.report import need
    need(args.repeats >= 1, f"--repeats {args.repeats}: must be at least 1")
    need(args.step >= 2, f"--step {args.step}: the size multiplier must be at least 2")


def command(args) -> int:
    """Ping-pong between the first and the last rank; prints and writes T(m) and the fit."""
    check(args)
    import psrt
    from psrt.bench import report
    from psrt.bench.collectives import sizes_from
    from psrt.train.report import fmt_bytes

    world = psrt.init()
    if world.size < 2:
        raise PsrtError("pingpong needs at least 2 ranks (mpirun -np 2 ...)", everywhere=True)
    trips, through = raw_trips, "MPI_Send/MPI_Recv of NumPy buffers"
    if args.device:
        from psrt.dp.device import pick
        device = pick(args.device, world.local_rank)
        trips, through = TensorTrips(device), f"the pipeline's sends of tensors on {device}"
    points, model, why = measure_fit(world.comm, sizes_from(args), repeats=args.repeats, trips=trips)
    if world.rank != 0:
        return 0
    if model is None:
        print(f"psrt.bench pingpong: no alpha-beta fit: {why}", file=sys.stderr, flush=True)
    if not args.quiet:
        print(f"# ping-pong, rank 0 ({world.hostname}) <-> rank {world.size - 1} through {through}: "
              "one-way time, median")
        report.table([dict(p, size=fmt_bytes(p["nbytes"]), us=p["one_way_s"] * 1e6,
                           mbs=p["nbytes"] / p["one_way_s"] / 1e6) for p in points],
                     [("size", "size", ""), ("us", "one-way(us)", ".1f"), ("mbs", "MB/s", ".1f")])
        if model:
            print(f"# alpha = {model.alpha_s * 1e6:.1f} us, beta = {model.beta_s_per_byte * 1e9:.3f} ns/B "
                  f"({model.bandwidth_bytes_s / 1e6:.1f} MB/s), r2 = {model.r2:.4f}")
    if args.json:
        report.write_json(args.json, {"meta": {"world_size": world.size, "host": world.hostname, "through": through,
                                               "mpi": report.mpi_version()},
                                      "points": points, "fit": model and vars(model)})
    return 0


class TensorTrips:
    """Round trips of a uint8 tensor on `device` through one pipeline P2P (made on the first
    size and kept, so its pinned slots are reused as a pipeline's are); each trip ends when
    the returned tensor is on the device."""

    def __init__(self, device):
        self.device, self.p2p = device, None

    def __call__(self, comm, size: int):
        import torch

        from psrt.pp.p2p import P2P
        self.p2p = self.p2p or P2P(comm)
        me, peer, p2p = comm.rank, comm.size - 1, self.p2p
        held = [torch.zeros(size, dtype=torch.uint8, device=self.device)]

        def trip() -> None:
            if me == 0:
                p2p.isend(held[0], peer, TAG)
                held[0] = p2p.recv(peer, TAG, self.device, "the ping-pong's answer")
            elif me == peer:
                held[0] = p2p.recv(0, TAG, self.device, "the ping-pong's message")
                p2p.isend(held[0], 0, TAG)
            p2p.wait_all()
            if held[0].is_cuda:
                torch.cuda.synchronize(held[0].device)
        return trip
