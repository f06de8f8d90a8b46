"""Collective benchmark: time, algbw and busbw per algorithm and size, nccl-tests style.

Definitions follow nccl-tests' doc/PERFORMANCE.md: algbw = bytes / time; busbw = algbw x
2(N-1)/N for allreduce, x (N-1)/N for reduce_scatter and allgather, x 1 for broadcast and
reduce, so busbw can be compared with the link speed whatever N is.  Each point is the median
of `repeats` timed loops after `warmup` calls; the loop time is the slowest rank's (the
collective is done when the last rank is done), with the fastest rank's shown as spread.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import partial

import torch

from psrt.bench import timing
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
# Each psrt all-reduce schedule written directly in mpi4py over NumPy arrays by a program
# without psrt (psrt/bench/floors.py): the floor each psrt algorithm's per-call cost is
# measured against.
FLOORS = {f"mpi4py-{name}": name for name in ("ring", "doubling", "halving-doubling", "tree", "ps")}
PEERS = (RAW, HOROVOD) + tuple(FLOORS)  # allreduce only; floors by default, the others by name
# How an all-reduce is called (--calls), each beside its floor called the same way: into a
# held result (out, the default), in place (inplace), into a fresh result (new), or in place,
# non-blocking and waited on, as DDP's buckets are (async); persistent: in place on a
# Communicator whose ready calls use persistent requests (psrt only; its floor is inplace's).
# Row names: ALGORITHM+CALL.
CALLS = ("out", "inplace", "new", "async", "persistent")
FLOOR_CALL = {"persistent": "inplace"}


def split_name(name: str) -> tuple[str, str]:
    """("ring", "async") for "ring+async"; the call is "out" without a suffix."""
    base, _, call = name.partition("+")
    return base, call or "out"


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
    # staged rows on a CUDA-aware MPI: elements whose result differs from the direct path's on
    # the same random input (bench/cuda.py ForceStaged)
    differ: int | None = None

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


def against_floors(rows: list[dict]) -> None:
    """Add vs_floor to each all-reduce row of psrt's with a floor called the same way in the
    same run (time over the floor's: the cost of psrt's call over its bare schedule), and to
    an async row vs_sync_floor, its time over the blocking in-place floor's."""
    floor = {(r["world_size"], r["algorithm"], r["nbytes"]): r["time_us"]
             for r in rows if split_name(r["algorithm"])[0] in FLOORS}
    for r in rows:
        if r["collective"] != "allreduce" or split_name(r["algorithm"])[0] in FLOORS:
            continue
        base, call = split_name(r["algorithm"])
        same = FLOOR_CALL.get(call, call)
        own = floor.get((r["world_size"], f"mpi4py-{base}" + ("" if same == "out" else f"+{same}"), r["nbytes"]))
        r["vs_floor"] = r["time_us"] / own if own else None
        if call == "async":
            sync = floor.get((r["world_size"], f"mpi4py-{base}+inplace", r["nbytes"]))
            r["vs_sync_floor"] = r["time_us"] / sync if sync else None


def caller(group: Communicator, collective: str, name: str, x: torch.Tensor, out: torch.Tensor,
           own: torch.Tensor, worker=None, twin: Communicator | None = None):
    """A zero-argument call of row `name` (an algorithm, a peer or a floor, +CALL for an
    all-reduce called another way) made once: x is the input, out a held result, own the
    buffer of in-place calls; worker runs the async floors, twin is the Communicator with
    persistent requests."""
    base, call = split_name(name)
    if call == "persistent":
        group, call = twin, "inplace"
    if base in FLOORS:
        from psrt.bench import floors
        from psrt.transport import np_view
        into = np_view(own if call in ("inplace", "async") else out)
        fn = floors.call(group.comm, FLOORS[base], call, np_view(x) if call in ("out", "new") else into,
                         into, worker)
        return lambda: torch.from_numpy(fn())
    if base == RAW:
        from mpi4py import MPI

        from psrt.transport import np_view
        src, dst = np_view(x), np_view(out)
        return lambda: group.comm.Allreduce(src, dst, MPI.SUM) or out
    if base == HOROVOD:
        import horovod.torch as hvd
        # Out of place, as users call it: horovod allocates the result tensor itself.
        return lambda: hvd.allreduce(x, op=hvd.Sum, name="psrt.bench.allreduce")
    if collective == "allreduce":
        return {"out": lambda: group.allreduce(x, out=out, algorithm=base),
                "inplace": lambda: group.allreduce(own, out=own, algorithm=base),
                "new": lambda: group.allreduce(x, algorithm=base),
                "async": lambda: group.allreduce(own, out=own, algorithm=base, async_op=True).wait()}[call]
    if collective == "reduce_scatter":
        return lambda: group.reduce_scatter(x, algorithm=base)
    if collective == "allgather":
        return lambda: group.allgather(x, out=out, algorithm=base)
    if collective == "broadcast":
        return lambda: group.broadcast(x, root=0, algorithm=base)
    return lambda: group.reduce(x, root=0, algorithm=base)


def call_once(group: Communicator, collective: str, name: str, x: torch.Tensor):
    """Row `name` called once on x (in place where the call is), its result returned."""
    out = torch.empty(x.numel() * (group.size if collective == "allgather" else 1), dtype=x.dtype, device=x.device)
    return caller(group, collective, name, x, out, x)()


def _wrong(group: Communicator, collective: str, result, n: int) -> int:
    """Elements that differ from the expected value (inputs are rank+1 everywhere)."""
    if result is None:
        return 0
    want = {"allreduce": n * (n + 1) / 2, "reduce_scatter": n * (n + 1) / 2, "reduce": n * (n + 1) / 2,
            "broadcast": 1.0}.get(collective)
    if collective == "allgather":
        per = result.numel() // n
        want_t = torch.arange(1, n + 1, dtype=result.dtype, device=result.device).repeat_interleave(per)
        return int((result.reshape(-1) != want_t).sum())
    return int((result != want).sum())


def measure(group: Communicator, collective: str, algorithms: list[str], nbytes: int,
            dtype: torch.dtype = torch.float32, warmup: int = 3, repeats: int = 5,
            min_time_s: float = 0.02, device: torch.device = torch.device("cpu")) -> list[Point]:
    """Time every algorithm at one size (psrt.bench.timing: interleaved rounds of about
    min_time_s each, slowest rank), after checking each one's result; on CUDA each call
    ends when the GPU is done."""
    n = group.size
    esize = torch.empty(0, dtype=dtype).element_size()
    numel = max(nbytes // esize, 1)
    if collective == "allgather":
        numel = max(numel // n, 1)
    x = torch.full((numel,), float(group.rank + 1), dtype=dtype, device=device)
    out = torch.empty(numel * (n if collective == "allgather" else 1), dtype=dtype, device=device)
    fresh = x.clone()
    worker = None
    if any(a in FLOORS for a in (split_name(a)[0] for a in algorithms if split_name(a)[1] == "async")):
        from psrt.bench.floors import Worker
        worker = Worker()
    own = {a: x.clone() for a in algorithms}     # each in-place row reduces its own buffer
    twin = None
    if any(split_name(a)[1] == "persistent" for a in algorithms):
        twin = Communicator(group.comm, persistent=True)
    calls = {a: caller(group, collective, a, x, out, own[a], worker, twin) for a in algorithms}
    if device.type == "cuda":
        from psrt.bench.cuda import synchronised
        calls = {a: synchronised(c) for a, c in calls.items()}
    wrong = {}
    for algo in algorithms:
        x.copy_(fresh)
        own[algo].copy_(fresh)
        wrong[algo] = group.comm.allreduce(_wrong(group, collective, calls[algo](), n))
        x.copy_(fresh)
        own[algo].zero_()      # in-place rows sum it again and again: zeros cannot overflow
    timings = timing.interleaved(group.comm, calls, repeats, warmup, min_time_s=min_time_s)
    if worker is not None:
        worker.close()
    if twin is not None:
        twin.close()
    total = numel * esize * (n if collective == "allgather" else 1)
    return [point(collective, algo, total, dtype, n, timings[algo], wrong[algo]) for algo in algorithms]


def point(collective: str, algorithm: str, total: int, dtype: torch.dtype, n: int, t: timing.Timing,
          wrong: int) -> Point:
    algbw = total / t.median / 1e9
    return Point(collective, algorithm, total, str(dtype).replace("torch.", ""), n, t.median * 1e6,
                 t.fastest_median * 1e6, algbw, algbw * BUS_FACTOR[collective](n), wrong)


def algorithms_for(collective: str, requested: list[str] | None, torch_ready: bool,
                   dtype: torch.dtype = torch.float32, calls=("out",), cuda: bool = False) -> list[str]:
    """The rows to time: the requested names (default: every algorithm, auto and the floors)
    that apply, each psrt algorithm and floor of an all-reduce once per call in `calls`.
    nccl only on CUDA (where bench/cuda.py keeps it if each rank has a GPU of its own); the
    peers called on host buffers only on the CPU."""
    from psrt.collectives.small import DTYPES
    names = list(requested) if requested else list(ALGORITHMS[collective]) + ["auto"] + list(FLOORS)
    names = [a for a in names if a == "auto" or a in PEERS or a in ALGORITHMS[collective]]
    if not torch_ready:
        names = [a for a in names if a != "torch"]
    names = [a for a in names if a not in (PEERS if cuda else ("nccl",))]
    if collective != "allreduce":
        names = [a for a in names if a not in PEERS]
    if dtype not in DTYPES:     # NumPy has no bfloat16, and its float16 is not torch's
        names = [a for a in names if a not in FLOORS]
    if collective == "allreduce":
        names = [a if call == "out" else f"{a}+{call}" for a in names
                 for call in (calls if a not in (RAW, HOROVOD) else ("out",))
                 if not (a in FLOORS and call in FLOOR_CALL)]
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
    c.add_argument("--calls", default="out",
                   help="comma list of how psrt's all-reduces (and their floors) are called: out "
                        "(into a held result, default), inplace, new (a fresh result per call), async "
                        "(in place, non-blocking, waited on), persistent (in place, with persistent "
                        "requests; its floor is inplace's): rows ALGORITHM+CALL")
    add_size_arguments(c, "4", "64MiB")
    c.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16", "bfloat16"])
    from psrt.dp import device
    device.add_argument(c, "where the tensors live; cuda adds the copy bandwidth, each algorithm on host "
                           "tensors (host:ALGO), the staged model and torch.distributed's rows (bench/cuda.py)")
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
    bad = [c for c in args.calls.split(",") if c not in CALLS]
    need(not bad, f"--calls {','.join(bad)}: choose from {', '.join(CALLS)}")
    args.calls = args.calls.split(",")


def command(args) -> int:
    check(args)
    import psrt
    world = psrt.init()
    group = psrt.Communicator(world.comm)
    try:
        rows = measure_all(args, world, group)
    finally:
        group.close()
    if world.rank != 0:
        return 0
    add_ratios(rows)
    gpu = None
    if args.device.type == "cuda":
        from psrt.bench import cuda
        gpu = cuda.Gpu(args.device, *cuda.copy_bandwidth(args.device), staged=not group._staging.direct_cuda)
        cuda.add_models(rows, gpu)
    wrong = sum(r["wrong"] for r in rows)
    if not args.quiet:
        print_rows(rows, args, world, gpu)
    write(rows, args, world, gpu)
    return 1 if wrong else 0


def measure_all(args, world, group: Communicator) -> list[dict]:
    """Every point the arguments ask for, as rows sorted for the table (every rank)."""
    import psrt
    from psrt.dp.device import pick
    from psrt.train.report import Progress, fmt_bytes
    sizes = sizes_from(args)
    dtype = getattr(torch, args.dtype)
    device = args.device = pick(args.device, world.local_rank)
    cuda = device.type == "cuda"
    wanted = args.algorithms.split(",") if args.algorithms else None
    torch_ready = wanted is None or "torch" in wanted or "nccl" in wanted
    if torch_ready:
        psrt.init_torch_distributed(world)
    # Horovod's background thread runs an MPI negotiation every cycle, even when idle, which
    # slows every other algorithm measured beside it: Horovod is timed in a phase of its own,
    # after the others, and shut down.
    phases = [None] if wanted is None else \
        [p for p in ([a for a in wanted if a != HOROVOD], [a for a in wanted if a == HOROVOD]) if p]
    plan = [(algos, c, s) for algos in phases for c in args.collective.split(",") for s in sizes
            if algorithms_for(c, algos, torch_ready, dtype, args.calls, cuda)]
    progress = Progress(len(plan), f"bench np={world.size}", enabled=world.rank == 0 and not args.quiet,
                        unit="points")
    points, hvd = [], None
    rows_at = on_device(group) if cuda else None
    for i, (algos, coll, size) in enumerate(plan, 1):
        if algos == [HOROVOD] and hvd is None:
            from psrt.dp.horovod import init_horovod
            hvd = init_horovod(group)
        names = algorithms_for(coll, algos, torch_ready, dtype, args.calls, cuda)
        if rows_at is None:
            points += measure(group, coll, names, size, dtype, warmup=args.warmup, repeats=args.repeats)
        else:
            points += rows_at(coll, names, size, dtype, args)
        progress.update(i, f"{coll} {fmt_bytes(size)}")
    if hvd is not None:
        hvd.shutdown()
    # one table block per algorithm reads best: sort by collective, algorithm order, size
    order = {a: i for i, a in enumerate(dict.fromkeys(p.algorithm for p in points))}
    return [p.row() for p in sorted(points, key=lambda p: (p.collective, order[p.algorithm], p.nbytes))]


def on_device(group: Communicator):
    """`(collective, names, size, dtype, args) -> points` for --device cuda: the rows on CUDA
    tensors, then psrt's algorithms on host tensors as rows host:ALGO (bench/cuda.py)."""
    from dataclasses import replace

    from psrt.bench import cuda
    from psrt.collectives import nccl
    own_gpu = nccl.sharing(nccl.gpus(group.comm)) is None

    other = cuda.other_path(group)
    chunked = set()      # collectives whose host rows at the staged chunk's size are measured

    def rows(coll: str, names: list[str], size: int, dtype, args) -> list[Point]:
        on_gpu = measure(group, coll, cuda.device_rows(names, own_gpu), size, dtype, args.warmup,
                         args.repeats, device=args.device)
        on_host = measure(group, coll, cuda.host_rows(names), size, dtype, args.warmup, args.repeats)
        chunk = cuda.chunk_size(sizes_from(args))
        if chunk and coll not in chunked and not group._staging.direct_cuda:   # for the model
            chunked.add(coll)
            on_host += measure(group, coll, cuda.host_rows(names), chunk, dtype, args.warmup, args.repeats)
        points = on_gpu + [replace(p, algorithm=cuda.HOST + p.algorithm) for p in on_host]
        if other.applies(coll):     # the staged sum on the other side, or staged at all
            psrt_rows = cuda.host_rows(names)
            differ = other.differences(partial(call_once, group, coll), psrt_rows, size, dtype, args.device)
            with other as label:
                again = measure(group, coll, psrt_rows, size, dtype, args.warmup, args.repeats,
                                device=args.device)
            points += [replace(p, algorithm=label + p.algorithm, differ=differ.get(p.algorithm)) for p in again]
        return points
    return rows


def add_ratios(rows: list[dict]) -> None:
    """x native (native time over the row's: > 1 is faster than the MPI library), the size
    as text, and the ratios to the floors (against_floors)."""
    from psrt.train.report import fmt_bytes
    native = {(r["collective"], r["nbytes"]): r["time_us"] for r in rows if r["algorithm"] == "native"}
    for r in rows:
        base = native.get((r["collective"], r["nbytes"]))
        r["vs_native"] = base / r["time_us"] if base else None
        r["size"] = fmt_bytes(r["nbytes"])
    against_floors(rows)


def print_rows(rows: list[dict], args, world, gpu=None) -> None:
    from psrt.bench import report
    if gpu is not None:
        print(gpu.heading())
    print(f"# psrt collectives: N={world.size} ranks on {world.num_nodes} host(s), dtype {args.dtype}; "
          f"time = median of {args.repeats} loops, slowest rank; x native = native time / time; "
          f"x own floor = time / time of the same schedule in bare mpi4py called the same way "
          f"(mpi4py-ALGORITHM[+CALL]); x sync floor: an async row over the blocking floor's time")
    columns = [("size", "size", ""), ("algorithm", "algorithm", ""), ("time_us", "time(us)", ".1f"),
               ("time_min_us", "fastest rank(us)", ".1f"), ("algbw_gbs", "algbw(GB/s)", ".3f"),
               ("busbw_gbs", "busbw(GB/s)", ".3f"), ("wrong", "#wrong", "d"), ("vs_native", "x native", ".2f"),
               ("vs_floor", "x own floor", ".2f")]
    if any(r.get("vs_sync_floor") for r in rows):
        columns.append(("vs_sync_floor", "x sync floor", ".2f"))
    if gpu is not None:
        from psrt.bench.cuda import COLUMNS, DIFFER
        columns += COLUMNS + ([DIFFER] if any(r.get("differ") is not None for r in rows) else [])
    for coll in dict.fromkeys(r["collective"] for r in rows):
        print(f"\n## {coll}")
        report.table([r for r in rows if r["collective"] == coll], columns)
    print(f"\n# {sum(r['wrong'] for r in rows)} wrong elements in all")


def write(rows: list[dict], args, world, gpu=None) -> None:
    """--json, --csv and --plot."""
    from psrt.bench import report
    meta = {"world_size": world.size, "num_nodes": world.num_nodes, "dtype": args.dtype,
            "mpi": report.mpi_version(), "host": world.hostname}
    if gpu is not None:
        meta.update(device=torch.cuda.get_device_name(gpu.device), cuda_direct=not gpu.staged,
                    d2h_gbs=gpu.down_bps / 1e9, h2d_gbs=gpu.up_bps / 1e9)
    if args.json:
        report.write_json(args.json, {"meta": meta, "rows": rows})
    if args.csv:
        report.write_csv(args.csv, rows)
    if args.plot:
        first = args.collective.split(",")[0]
        report.plot_busbw([r for r in rows if r["collective"] == first], args.plot,
                          f"{first}, N={world.size}, {args.dtype}")
