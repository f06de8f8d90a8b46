"""Where did my ranks land?  Each rank prints its place in the world; optionally an allreduce.

    mpi_launch -np 4 python -m psrt.info
    mpi_launch --emulate --hostfile hostfiles/two_nodes -np 8 python -m psrt.info --allreduce 16MiB

Every rank prints one `[rank N@host]` line (with --json, one `PSRT-RESULT {json}` line);
rank 0 then prints a summary of the layout and the slowest rank's allreduce time.
"""
from __future__ import annotations

import json
import os
import re
import statistics
import sys
import time

from psrt.errors import ArgumentParser, PsrtError, cli_main

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9,
          "ki": 2**10, "mi": 2**20, "gi": 2**30}


def parse_size(text: str) -> int:
    """Bytes from `4096`, `64KiB`, `16MiB`, `1GiB` (powers of 2) or `16MB` (powers of 10)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmg]i?)?b?\s*", text, re.I)
    if not m:
        raise PsrtError(f"--allreduce {text!r}: expected a byte count such as 4096 or 16MiB",
                        everywhere=True)
    unit = (m.group(2) or "").lower()
    if unit in ("k", "m", "g") and not text.strip().lower().endswith("b"):
        unit += "i"  # a bare 16M means 16 MiB, as in dd and most MPI benchmarks
    return int(m.group(1)) * _UNITS[unit]


SLURM_FACTS = {"job_id": "SLURM_JOB_ID", "nodelist": "SLURM_JOB_NODELIST", "procid": "SLURM_PROCID",
               "nodeid": "SLURM_NODEID", "localid": "SLURM_LOCALID", "nodename": "SLURMD_NODENAME"}


def facts(world, environ=os.environ) -> dict:
    from psrt.world import mpi_yields_when_idle
    out = {"rank": world.rank, "size": world.size, "local_rank": world.local_rank,
           "local_size": world.local_size, "node_rank": world.node_rank,
           "num_nodes": world.num_nodes, "hostname": world.hostname,
           "launcher": world.launcher,
           # whether this rank's MPI gives up the core while it waits (None: it cannot say)
           "yields_when_idle": mpi_yields_when_idle()}
    if "SLURM_JOB_ID" in environ:
        out["slurm"] = {k: environ.get(v) for k, v in SLURM_FACTS.items()}
    out.update(cuda_facts())
    return out


def cuda_facts() -> dict:
    """The GPUs this rank sees and how its CUDA tensors would meet MPI: straight to the
    library (a CUDA-aware MPI, or PSRT_CUDA_AWARE=1) or staged through pinned host memory."""
    import torch

    from psrt import env
    from psrt.transport import cuda_aware, cuda_support
    forced = env.cuda_aware()
    how = f"PSRT_CUDA_AWARE={int(forced)}" if forced is not None else cuda_support()[1]
    return {"gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "cuda_direct": cuda_aware(), "cuda_support": how}


def cuda_line(records: list[dict]) -> str | None:
    """Rank 0's line on CUDA tensors, where any rank sees a GPU."""
    if not any(r.get("gpus") for r in records):
        return None
    direct = {r["rank"] for r in records if r["cuda_direct"]}
    how = "; ".join(sorted({r["cuda_support"] for r in records}))
    if len(direct) == len(records):
        return f"CUDA tensors go straight to MPI: the library is CUDA-aware ({how})"
    if not direct:
        return f"CUDA tensors are staged through pinned host memory: the MPI is not CUDA-aware ({how})"
    return (f"CUDA tensors go straight to MPI on ranks {_ranges(sorted(direct))} only, staged elsewhere "
            f"({how}): the ranks disagree on their MPI")


def slurm_line(records: list[dict]) -> str | None:
    """Whether psrt's placement is Slurm's: rank = SLURM_PROCID, host = SLURMD_NODENAME,
    local rank = SLURM_LOCALID and node rank = SLURM_NODEID on every rank (ranks srun
    started; others, such as mpirun's inside an allocation, have no task ids of their own)."""
    if not all("slurm" in r for r in records):
        return None
    s0 = records[0]["slurm"]
    head = f"Slurm job {s0['job_id']} on {s0['nodelist']}: "
    others = sorted({r["launcher"] for r in records if r["launcher"] != "srun"})
    if others:
        # mpirun inside an allocation: the ranks' SLURM_* describe mpirun's daemons, not them
        return head + f"ranks started by {', '.join(others)} inside the allocation, not by srun"
    differ = [f"rank {r['rank']} ({r['hostname']}, local {r['local_rank']}, node {r['node_rank']}) is "
              f"Slurm's task {r['slurm']['procid']} ({r['slurm']['nodename']}, local {r['slurm']['localid']}, "
              f"node {r['slurm']['nodeid']})"
              for r in records
              if (str(r["rank"]), r["hostname"], str(r["local_rank"]), str(r["node_rank"]))
              != (r["slurm"]["procid"], r["slurm"]["nodename"], r["slurm"]["localid"], r["slurm"]["nodeid"])]
    return head + ("placement matches Slurm's (rank, host, local rank, node rank)" if not differ
                   else "placement differs from Slurm's: " + "; ".join(differ[:4]))


def time_allreduce(world, nbytes: int, iters: int) -> dict:
    """Sum float32 buffers of `nbytes` over `world.comm`; check the sum; time `iters` runs.

    Rank r contributes r + 1 everywhere, so every element must come out n(n+1)/2.
    """
    import numpy as np

    if nbytes % 4:
        raise PsrtError(f"--allreduce {nbytes}: must be a multiple of 4 bytes (float32)",
                        everywhere=True)
    send = np.full(nbytes // 4, world.rank + 1, dtype=np.float32)
    recv = np.empty_like(send)
    world.comm.Allreduce(send, recv)  # warm-up: connections are made on first use
    expected = world.size * (world.size + 1) / 2
    wrong = np.flatnonzero(recv != expected)
    if wrong.size:
        i = int(wrong[0])
        raise PsrtError(f"allreduce on rank {world.rank}: element {i} is {recv[i]}, "
                        f"expected {expected}")
    times = []
    for _ in range(iters):
        world.comm.Barrier()
        t0 = time.perf_counter()
        world.comm.Allreduce(send, recv)
        times.append(time.perf_counter() - t0)
    return {"allreduce_bytes": nbytes, "allreduce_iters": iters,
            "allreduce_s": statistics.median(times), "allreduce_min_s": min(times)}


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(f"{start}-{r}" if r != start else f"{r}")
            start = None
    return ",".join(out)


def summary(records: list[dict]) -> list[str]:
    """Rank 0's lines: which ranks sit on which host, and the slowest allreduce."""
    by_host: dict[str, list[int]] = {}
    for rec in sorted(records, key=lambda r: r["rank"]):
        by_host.setdefault(rec["hostname"], []).append(rec["rank"])
    n = len(records)
    lines = [f"{n} rank{'s' * (n != 1)} on {len(by_host)} host{'s' * (len(by_host) != 1)}: "
             + "; ".join(f"{h} ranks {_ranges(r)}" for h, r in by_host.items())]
    lines += [line for line in (slurm_line(records), cuda_line(records)) if line]
    if "allreduce_s" in records[0]:
        nbytes = records[0]["allreduce_bytes"]
        t = max(r["allreduce_s"] for r in records)
        # Bus bandwidth: what each rank must move in a bandwidth-optimal allreduce,
        # 2(n-1)/n bytes per byte (the convention of nccl-tests).
        bus = 2 * (n - 1) / n * nbytes / t / 1e9 if t > 0 else 0.0
        lines.append(f"allreduce {nbytes} bytes: {t * 1e3:.3f} ms (slowest rank, median of "
                     f"{records[0]['allreduce_iters']}), bus bandwidth {bus:.3f} GB/s")
    return lines


def _say(line: str) -> None:
    # One write per line, so that lines of different ranks cannot interleave.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m psrt.info", description=__doc__.split("\n")[0])
    p.add_argument("--allreduce", metavar="BYTES", type=parse_size,
                   help="time an allreduce of this many bytes of float32 (e.g. 16MiB)")
    p.add_argument("--iters", type=int, default=5, help="timed allreduce runs (default 5)")
    p.add_argument("--json", action="store_true", help="one PSRT-RESULT {json} line per rank")
    return p


@cli_main("psrt.info")
def main(argv: list[str] | None = None, parser: ArgumentParser | None = None, more=None) -> int:
    """`parser`: build_parser()'s, or one that adds options; `more(records, args)`: lines rank 0
    prints after the summary (psrt.info adds the predicted table of psrt.bench this way)."""
    args = (parser or build_parser()).parse_args(argv)
    if args.iters < 1:
        raise PsrtError(f"--iters {args.iters}: needs at least 1", everywhere=True)

    from psrt.world import init

    world = init()
    record = facts(world)
    if args.allreduce is not None:
        record.update(time_allreduce(world, args.allreduce, args.iters))
    if args.json:
        _say("PSRT-RESULT " + json.dumps(record, sort_keys=True))
    else:
        line = (f"{world.prefix()} rank {world.rank}/{world.size} local {world.local_rank}/"
                f"{world.local_size} node {world.node_rank}/{world.num_nodes} "
                f"launcher {world.launcher}")
        if "allreduce_s" in record:
            line += f" allreduce {record['allreduce_s'] * 1e3:.3f} ms"
        _say(line)
    records = world.comm.gather(record, root=0)
    if world.rank == 0 and not args.json:
        for line in summary(records) + (more(records, args) if more else []):
            _say(f"{world.prefix()} {line}")
    world.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
