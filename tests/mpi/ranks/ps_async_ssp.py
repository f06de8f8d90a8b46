"""Rank side of tests/mpi/test_ps_async.py: bounded staleness with a deliberately slow worker, and
convergence with s > 0.

Phase 1 (staleness --staleness, --steps clocks): worker 0 sleeps --slow seconds in every
step, the others do not, so they run ahead until SSP holds them.  Every worker records, per
step, the clock it computes next and the version (clocks applied) of the parameters it got;
the server records (worker, clock, slowest clock, applied) at every pull it answers.

Phase 2: a least-squares problem (linear model, exact solution exists) trained with the same
staleness and a slow worker; every worker reports the full-data loss before and after.
"""
import argparse
import time

import torch

import psrt
from ps_harness import Results, build, digest, flat, local_microbatches, make_data, make_model, mse


def phase_clocks(comm, out, s: int, steps: int, slow: float) -> None:
    model = make_model()
    data = make_data(24, steps)
    st = build("ps-async", model, "sgd", comm, staleness=s, record_clocks=True)
    if st.is_worker:
        seen = []
        for x, y in data:
            mbs = local_microbatches(x, y, st.worker_rank, st.num_workers, 1)
            if st.worker_rank == 0:
                time.sleep(slow)
            stats = st.step(mse(model), mbs)
            seen.append([stats.extra["clock"], stats.extra["version"], stats.extra["slowest_clock"]])
        st.finish()
        out.add(phase="clocks", staleness=s, rank=comm.rank, worker=True, seen=seen,
                digest=digest(flat(model)))
    else:
        st.serve()
        st.finish()
        out.add(phase="clocks", staleness=s, rank=comm.rank, worker=False, log=st.clock_log,
                totals=st.server_totals, digest=digest(flat(model)))


def phase_converge(comm, out, s: int, steps: int, slow: float) -> None:
    torch.manual_seed(5)
    model = torch.nn.Linear(8, 1)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(48, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.5
    def full() -> float:
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(model(x), y))

    before = full()
    st = psrt.dp.strategy_class("ps-async")(
        model, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.5), comm, staleness=s)
    if st.is_worker:
        mbs = local_microbatches(x, y, st.worker_rank, st.num_workers, 1)
        for _ in range(steps):
            if st.worker_rank == 0:
                time.sleep(slow)
            st.step(mse(model), mbs)
    else:
        st.serve()
    st.finish()
    out.add(phase="converge", staleness=s, rank=comm.rank, worker=st.is_worker, before=before,
            after=full(), digest=digest(flat(model)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--staleness", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--slow", type=float, default=0.03, help="seconds worker 0 sleeps per step")
    ap.add_argument("--converge-steps", type=int, default=150)
    args = ap.parse_args()
    world = psrt.init()
    torch.set_num_threads(1)
    comm = psrt.Communicator(world.comm)
    out = Results(world.comm)
    for s in (0, args.staleness):
        phase_clocks(comm, out, s, args.steps, args.slow)
    phase_converge(comm, out, args.staleness, args.converge_steps, args.slow / 10)
    out.flush()


if __name__ == "__main__":
    main()
