"""Collective benchmark: time, algbw and busbw per algorithm and size, nccl-tests style.

Definitions follow nccl-tests' doc/PERFORMANCE.md: algbw = bytes / time; busbw = algbw x
2(N-1)/N for allreduce, x (N-1)/N for reduce_scatter and allgather, x 1 for broadcast and
reduce, so busbw can be compared with the link speed whatever N is.  Each point is the median
of `repeats` timed loops after `warmup` calls; the loop time is the slowest rank's (the
collective is done when the last rank is done), with the fastest rank's shown as spread.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from psrt.collectives import ALGORITHMS, Communicator
from psrt.errors import PsrtError

BUS_FACTOR = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}
RAW = "mpi4py"  # the MPI library called directly on a NumPy buffer, without psrt's API around it
HOROVOD = "horovod"  # horovod.torch's allreduce (op Sum) on the same tensor; needs hvd.init() first
# psrt's all-reduce schedules written directly in mpi4py over NumPy arrays, called bare (no
# Communicator, no tensors): the floor each psrt algorithm's per-call cost is measured against.
FLOORS = {"mpi4py-ring": "ring", "mpi4py-doubling": "doubling",
          "mpi4py-halving-doubling": "halving-doubling", "mpi4py-tree": "tree", "mpi4py-ps": "ps"}
PEERS = (RAW, HOROVOD) + tuple(FLOORS)  # allreduce only; floors by default, the others by name


@dataclass
class Point:
    collective: str
    algorithm: str
    nbytes: int
    dtype: str
    world_size: int
    time_us: float          # median over repeats of the slowest rank's mean time per call
    time_min_us: float      # same, fastest rank
    algbw_gbs: float
    busbw_gbs: float
    wrong: int              # elements that differ from the expected result

    def row(self) -> dict:
        return asdict(self)


def parse_size(text: str) -> int:
    units = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
             "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}
    t = text.strip().upper()
    num = t.rstrip("KMGIB")
    unit = t[len(num):]
    if not num or unit not in units:
        raise ValueError(f"bad size {text!r} (examples: 4, 4B, 64K, 16MiB, 1G)")
    return int(float(num) * units[unit])


def size_sweep(lo: int, hi: int, step: int = 2) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= step
    return out


def _floor(comm, algorithm: str, x: torch.Tensor, out: torch.Tensor):
    """A call of the floor `algorithm` on NumPy views of x and out made once, as a program
    written in mpi4py would hold its arrays: copy the input, run the schedule."""
    import numpy as np

    from psrt.collectives import small
    from psrt.transport import np_view
    src, a = np_view(x), np_view(out)
    tmp, fn = np.empty_like(a), small.ALLREDUCE[FLOORS[algorithm]]

    def call():
        np.copyto(a, src)
        fn(comm, a, tmp, np.add)
        return out
    return call


def _call(group: Communicator, collective: str, algorithm: str, x: torch.Tensor, out: torch.Tensor,
          floors: dict | None = None):
    if floors and algorithm in floors:
        return floors[algorithm]()
    if algorithm == RAW:
        from mpi4py import MPI

        from psrt.transport import np_view
        group.comm.Allreduce(np_view(x), np_view(out), MPI.SUM)
        return out
    if algorithm == HOROVOD:
        import horovod.torch as hvd
        # Out of place, as users call it: horovod allocates the result tensor itself.
        return hvd.allreduce(x, op=hvd.Sum, name="psrt.bench.allreduce")
    if collective == "allreduce":
        return group.allreduce(x, out=out, algorithm=algorithm)
    if collective == "reduce_scatter":
        return group.reduce_scatter(x, algorithm=algorithm)
    if collective == "allgather":
        return group.allgather(x, out=out, algorithm=algorithm)
    if collective == "broadcast":
        return group.broadcast(x, root=0, algorithm=algorithm)
    return group.reduce(x, root=0, algorithm=algorithm)


def _wrong(group: Communicator, collective: str, result, n: int) -> int:
    """Elements that differ from the expected value (inputs are rank+1 everywhere)."""
    if result is None:
        return 0
    want = {"allreduce": n * (n + 1) / 2, "reduce_scatter": n * (n + 1) / 2, "reduce": n * (n + 1) / 2,
            "broadcast": 1.0}.get(collective)
    if collective == "allgather":
        per = result.numel() // n
        want_t = torch.arange(1, n + 1, dtype=result.dtype).repeat_interleave(per)
        return int((result.reshape(-1) != want_t).sum())
    return int((result != want).sum())


def measure(group: Communicator, collective: str, algorithms: list[str], nbytes: int,
            dtype: torch.dtype = torch.float32, warmup: int = 3, repeats: int = 5,
            min_time_s: float = 0.02) -> list[Point]:
    """Time every algorithm at one size.  Repeats are interleaved (A B C, A B C, ...) so a
    change in machine load during the run hits all algorithms alike and the ratios hold."""
    n, rank = group.size, group.rank
    esize = torch.empty(0, dtype=dtype).element_size()
    numel = max(nbytes // esize, 1)
    if collective == "allgather":
        numel = max(numel // n, 1)
    x = torch.full((numel,), float(rank + 1), dtype=dtype)
    out = torch.empty(numel * (n if collective == "allgather" else 1), dtype=dtype)
    fresh = x.clone()
    floors = {a: _floor(group.comm, a, x, out) for a in algorithms if a in FLOORS}
    wrong, iters = {}, {}
    for algo in algorithms:
        x.copy_(fresh)
        wrong[algo] = group.comm.allreduce(_wrong(group, collective, _call(group, collective, algo, x, out, floors), n))
        x.copy_(fresh)
        for _ in range(warmup):
            _call(group, collective, algo, x, out, floors)
        # Iterations so one timed loop lasts about min_time_s (rank 0 decides for all).
        t0 = time.perf_counter()
        _call(group, collective, algo, x, out, floors)
        iters[algo] = group.comm.bcast(max(1, min(1000, int(min_time_s / max(time.perf_counter() - t0, 1e-7)))), root=0)
    slow = {a: [] for a in algorithms}
    fast = {a: [] for a in algorithms}
    for _ in range(repeats):
        for algo in algorithms:
            group.comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(iters[algo]):
                _call(group, collective, algo, x, out, floors)
            times = group.comm.allgather((time.perf_counter() - t0) / iters[algo])
            slow[algo].append(max(times))
            fast[algo].append(min(times))
    total = numel * esize * (n if collective == "allgather" else 1)
    points = []
    for algo in algorithms:
        t = statistics.median(slow[algo])
        algbw = total / t / 1e9
        points.append(Point(collective, algo, total, str(dtype).replace("torch.", ""), n, t * 1e6,
                            statistics.median(fast[algo]) * 1e6, algbw,
                            algbw * BUS_FACTOR[collective](n), wrong[algo]))
    return points


def algorithms_for(collective: str, requested: list[str] | None, torch_ready: bool,
                   dtype: torch.dtype = torch.float32) -> list[str]:
    from psrt.collectives.small import DTYPES
    names = list(requested) if requested else list(ALGORITHMS[collective]) + ["auto"] + list(FLOORS)
    names = [a for a in names if a == "auto" or a in PEERS or a in ALGORITHMS[collective]]
    if not torch_ready:
        names = [a for a in names if a != "torch"]
    if collective != "allreduce":
        names = [a for a in names if a not in PEERS]
    if dtype not in DTYPES:     # NumPy has no bfloat16, and its float16 is not torch's
        names = [a for a in names if a not in FLOORS]
    # native first: every other row is compared with it
    return sorted(names, key=lambda a: a != "native")


def sizes_from(args) -> list[int]:
    try:
        if args.sizes:
            return [parse_size(s) for s in args.sizes.split(",")]
        lo, hi = parse_size(args.min_size), parse_size(args.max_size)
    except ValueError as err:
        raise PsrtError(f"--sizes/--min-size/--max-size: {err}", everywhere=True) from err
    if lo < 1 or hi < lo:
        raise PsrtError(f"--min-size {args.min_size} / --max-size {args.max_size}: need 1 <= min <= max",
                        everywhere=True)
    return size_sweep(lo, hi, args.step)



COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")
HELP = "time, algbw, busbw per algorithm and size (run under mpirun)"


def add_arguments(c) -> None:
    c.add_argument("--collective", default="allreduce", help=f"comma list of {', '.join(COLLECTIVES)}")
    c.add_argument("--algorithms", default=None,
                   help="comma list (default: all for the collective, plus auto); 'mpi4py' adds the "
                        "MPI library called directly, without psrt's API; 'horovod' adds "
                        "horovod's allreduce (scripts/install_horovod.sh)")
    add_size_arguments(c, "4", "64MiB")
    c.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16", "bfloat16"])
    c.add_argument("--warmup", type=int, default=3)
    c.add_argument("--repeats", type=int, default=5)
    c.add_argument("--json", help="write points as JSON")
    c.add_argument("--csv", help="write points as CSV")
    c.add_argument("--plot", help="write a busbw-vs-size PNG")
    c.add_argument("--quiet", action="store_true")


def add_size_arguments(p, lo: str, hi: str) -> None:
    """--sizes, or --min-size/--max-size/--step: the message sizes of a sweep."""
    p.add_argument("--sizes", default=None, help="explicit comma list, e.g. 4,64K,16MiB")
    p.add_argument("--min-size", default=lo)
    p.add_argument("--max-size", default=hi)
    p.add_argument("--step", type=int, default=4, help="size multiplier between points (default 4)")


def check(args) -> None:
    from psrt.bench.report import need
    from psrt.collectives import ALL_ALGORITHMS
    need(args.repeats >= 1, f"--repeats {args.repeats}: must be at least 1")
    need(args.step >= 2, f"--step {args.step}: the size multiplier must be at least 2")
    need(args.warmup >= 0, f"--warmup {args.warmup}: must not be negative")
    bad = [c for c in args.collective.split(",") if c not in COLLECTIVES]
    need(not bad, f"--collective {','.join(bad)}: choose from {', '.join(COLLECTIVES)}")
    if args.algorithms:
        bad = [a for a in args.algorithms.split(",") if a not in ALL_ALGORITHMS + PEERS]
        need(not bad, f"--algorithms {args.algorithms}: unknown {', '.join(bad)} "
                      f"(choose from {', '.join(ALL_ALGORITHMS + PEERS)})")


def command(args) -> int:
    check(args)
    import psrt
    from psrt.bench import report
    from psrt.train.report import Progress, fmt_bytes

    world = psrt.init()
    sizes = sizes_from(args)
    dtype = getattr(torch, args.dtype)
    torch_ready = False
    wanted = args.algorithms.split(",") if args.algorithms else None
    if wanted is None or "torch" in wanted:
        psrt.init_torch_distributed(world)
        torch_ready = True
    group = psrt.Communicator(world.comm)
    # Horovod's background thread runs an MPI negotiation every cycle, even when idle, which
    # slows every other algorithm measured beside it: Horovod is timed in a phase of its own,
    # after the others, and shut down.
    phases = [None] if wanted is None else \
        [p for p in ([a for a in wanted if a != HOROVOD], [a for a in wanted if a == HOROVOD]) if p]
    plan = [(algos, c, s) for algos in phases for c in args.collective.split(",") for s in sizes
            if algorithms_for(c, algos, torch_ready, dtype)]
    progress = Progress(len(plan), f"bench np={world.size}", enabled=world.rank == 0 and not args.quiet,
                        unit="points")
    points, hvd = [], None
    for i, (algos, coll, size) in enumerate(plan, 1):
        if algos == [HOROVOD] and hvd is None:
            from psrt.dp.horovod import init_horovod
            hvd = init_horovod(group)
        points += measure(group, coll, algorithms_for(coll, algos, torch_ready, dtype), size, dtype,
                             warmup=args.warmup, repeats=args.repeats)
        progress.update(i, f"{coll} {fmt_bytes(size)}")
    if hvd is not None:
        hvd.shutdown()
    # one table block per algorithm reads best: sort by collective, algorithm order, size
    order = {a: i for i, a in enumerate(dict.fromkeys(p.algorithm for p in points))}
    rows = [p.row() for p in sorted(points, key=lambda p: (p.collective, order[p.algorithm], p.nbytes))]
    if world.rank != 0:
        group.close()
        return 0
    native = {(r["collective"], r["nbytes"]): r["time_us"] for r in rows if r["algorithm"] == "native"}
    floor = {(r["algorithm"], r["nbytes"]): r["time_us"] for r in rows if r["algorithm"] in FLOORS}
    for r in rows:
        base = native.get((r["collective"], r["nbytes"]))
        r["vs_native"] = base / r["time_us"] if base else None   # >1: faster than the MPI library
        own = floor.get((f"mpi4py-{r['algorithm']}", r["nbytes"])) if r["collective"] == "allreduce" else None
        r["vs_floor"] = r["time_us"] / own if own else None      # psrt's cost over its own schedule's
        r["size"] = fmt_bytes(r["nbytes"])
    wrong = sum(r["wrong"] for r in rows)
    if not args.quiet:
        print(f"# psrt collectives: N={world.size} ranks on {world.num_nodes} host(s), dtype {args.dtype}; "
              f"time = median of {args.repeats} loops, slowest rank; x native = native time / time; "
              f"x own floor = time / time of the same schedule in bare mpi4py (mpi4py-ALGORITHM)")
        for coll in dict.fromkeys(r["collective"] for r in rows):
            print(f"\n## {coll}")
            report.table([r for r in rows if r["collective"] == coll], [
                ("size", "size", ""), ("algorithm", "algorithm", ""), ("time_us", "time(us)", ".1f"),
                ("time_min_us", "fastest rank(us)", ".1f"), ("algbw_gbs", "algbw(GB/s)", ".3f"),
                ("busbw_gbs", "busbw(GB/s)", ".3f"), ("wrong", "#wrong", "d"), ("vs_native", "x native", ".2f"),
                ("vs_floor", "x own floor", ".2f")])
        print(f"\n# {wrong} wrong elements in all")
    meta = {"world_size": world.size, "num_nodes": world.num_nodes, "dtype": args.dtype,
            "mpi": report.mpi_version(), "host": world.hostname}
    if args.json:
        report.write_json(args.json, {"meta": meta, "rows": rows})
    if args.csv:
        report.write_csv(args.csv, rows)
    if args.plot:
        report.plot_busbw([r for r in rows if r["collective"] == args.collective.split(",")[0]], args.plot,
                          f"{args.collective.split(',')[0]}, N={world.size}, {args.dtype}")
    group.close()
    return 1 if wrong else 0
