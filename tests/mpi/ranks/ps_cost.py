"""What a parameter server costs, measured: bytes per rank and time per step of every PS layout
on one model, with `ps` (one co-located server) as the peer every ratio is taken against.

    ./mpi_launch -np 4 python tests/mpi/ranks/ps_cost.py --params 1000000 --steps 10

Not a test (timings depend on the machine); docs/explanation/parameter_server.md quotes a run.  The model
is one linear layer whose size is --params; the batch is tiny so communication dominates.
Rank 0 prints a table of MB sent per rank per step and the step time (--json: one
PSRT-RESULT line per rank and layout instead).
"""
import argparse
import time

import torch

import psrt
from ps_harness import Results, build

LAYOUTS = [("ps", {}), ("ps", {"servers": 1}), ("ps-sharded", {}), ("ps-sharded", {"servers": 1}),
           ("ps-sharded", {"servers": 2}), ("ps-async", {"staleness": 0}), ("ps-async", {"staleness": 2})]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=1_000_000)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json", action="store_true", help="PSRT-RESULT lines instead of the table")
    args = ap.parse_args()
    world = psrt.init()
    torch.set_num_threads(1)
    comm = psrt.Communicator(world.comm)
    out = Results(world.comm) if args.json else None
    rows = []
    width = max(1, args.params // 1000)
    for dp, options in LAYOUTS:
        if options.get("servers", 0) >= world.size:
            continue
        torch.manual_seed(0)
        model = torch.nn.Linear(1000, width)
        s = build(dp, model, "sgd", comm, **options)
        x, y = torch.randn(4, 1000), torch.randn(4, width)

        def loss_fn(mb):
            return torch.nn.functional.mse_loss(model(mb[0]), mb[1])

        world.comm.Barrier()
        t0 = time.perf_counter()
        sent = comm_s = 0.0
        if s.is_worker:
            for _ in range(args.steps):
                st = s.step(loss_fn, [(x, y)])
                sent += st.bytes_sent
                comm_s += st.comm_s
        s.finish()
        wall = time.perf_counter() - t0
        if not s.is_worker:
            sent = s.server_totals["bytes_sent"]
        record = dict(case=f"{dp}{options}", rank=world.rank, worker=s.is_worker,
                      params=sum(p.numel() for p in model.parameters()),
                      mb_sent_per_step=sent / args.steps / 1e6, step_ms=1e3 * wall / args.steps,
                      comm_ms=1e3 * comm_s / args.steps)
        if out is not None:
            out.add(**record)
        else:
            rows.append((dp, options, world.comm.gather(record, root=0)))
    if out is not None:
        out.flush()
    elif world.rank == 0:
        print(table(rows, world.size, width * 1001))


def table(rows, size: int, params: int) -> str:
    """Markdown: MB each rank sent per step (servers marked), and the slowest rank's step."""
    lines = [f"{params:,} float32 parameters, M = {params * 4 / 1e6:.1f} MB; MB sent per rank per step",
             "", "| layout | " + " | ".join(f"rank {r}" for r in range(size)) + " | step (ms) |",
             "|---|" + "---|" * (size + 1)]
    for dp, options, records in rows:
        name = " ".join([dp] + [f"--{k} {v}" for k, v in options.items()])
        cells = [f"{r['mb_sent_per_step']:.2f}" + ("" if r["worker"] else " (server)") for r in records]
        lines.append(f"| `{name}` | " + " | ".join(cells) + f" | {max(r['step_ms'] for r in records):.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
