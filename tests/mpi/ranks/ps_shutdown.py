"""Rank side of tests/mpi/test_ps_shutdown.py: workers that stop after different numbers of steps.

Worker i runs STEPS[i % 4] steps then calls finish(); every layout must wind down (the test
runs this under a subprocess timeout).  Each rank records how many steps it ran, how long its
finish() took, and a digest of its final parameters (after ps-async's finish, every worker
holds the same final parameters)."""
import time

import torch

import psrt
from ps_harness import Results, build, digest, flat, make_data, make_model, run_steps

STEPS = [1, 4, 2, 3]      # rank 0, a co-located server in several layouts, stops first

LAYOUTS = [("ps", {}), ("ps", {"servers": 1}), ("ps-sharded", {}), ("ps-sharded", {"shards": 2}),
           ("ps-sharded", {"servers": 2}), ("ps-async", {"staleness": 0}),
           ("ps-async", {"staleness": 2})]


def main() -> None:
    world = psrt.init()
    torch.set_num_threads(1)
    comm = psrt.Communicator(world.comm)
    out = Results(world.comm)
    for dp, options in LAYOUTS:
        model = make_model()
        s = build(dp, model, "sgd", comm, **options)
        steps = STEPS[s.worker_rank % len(STEPS)] if s.is_worker else 0
        if s.is_worker:
            run_steps(s, model, make_data(24, steps), micro=1)
        t0 = time.perf_counter()
        s.finish()       # a dedicated server serves inside finish() until every worker is done
        out.add(case=f"{dp}{options}", rank=comm.rank, worker=s.is_worker, steps=steps,
                finish_s=time.perf_counter() - t0, digest=digest(flat(model)))
    lost_worker(comm, out)
    out.flush()


def lost_worker(comm, out) -> None:
    """Worker 2 of `ps --servers 1` never calls step() nor finish(): instead of hanging, the
    server and the waiting workers raise a PsrtError naming the missing rank after timeout_s."""
    from psrt.errors import PsrtError
    model = make_model()
    s = build("ps", model, "sgd", comm, servers=1, timeout_s=2.0)
    error = None
    t0 = time.perf_counter()
    try:
        if s.is_worker and s.worker_rank != 2:
            run_steps(s, model, make_data(24, 1), micro=1)
            s.finish()
        elif not s.is_worker:
            s.serve()
    except PsrtError as err:
        error = str(err)
    out.add(case="lost-worker", rank=comm.rank, worker=s.is_worker, error=error,
            wait_s=time.perf_counter() - t0)


if __name__ == "__main__":
    main()
