"""What a parameter server costs, measured: bytes per rank and time per step of every PS layout
on one model, with `ps` (one co-located server) as the peer every ratio is taken against.

    mpirun -np 4 python tests/mpi/ranks/ps_cost.py --params 1000000 --steps 10

Not a test (timings depend on the machine); docs/parameter_server.md quotes a run.  The model
is one linear layer whose size is --params; the batch is tiny so communication dominates.
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
    args = ap.parse_args()
    world = psrt.init()
    torch.set_num_threads(1)
    comm = psrt.Communicator(world.comm)
    out = Results(world.comm)
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
        out.add(case=f"{dp}{options}", rank=world.rank, worker=s.is_worker,
                params=sum(p.numel() for p in model.parameters()),
                mb_sent_per_step=sent / args.steps / 1e6, step_ms=1e3 * wall / args.steps,
                comm_ms=1e3 * comm_s / args.steps)
    out.flush()


if __name__ == "__main__":
    main()
