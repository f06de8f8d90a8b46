"""Rank side of tests/mpi/test_ps.py: every parameter-server layout that fits N ranks, for N in
--sizes, with SGD+momentum and Adam, k steps, compared with one process on the whole global
batch; then a checkpoint/resume check.

Rank 0 prints one PSRT-RESULT per (size, case, rank): max |difference| to the reference on
workers, a digest of the final parameters (for bitwise comparisons between cases), the shard
range and the size of the optimizer state on servers, and the bytes, losses and times each
step reported.  Ranks other than 0 perturb their replica first: the strategy must start every
rank from rank 0's parameters."""
import argparse
import copy
import time

import torch
from mpi4py import MPI

import psrt
from psrt.dp.ps_protocol import TAG_PULL, TAG_PUSH
from ps_harness import (Results, build, digest, flat, local_microbatches, make_data, make_model, mse, perturb,
                        reference, run_steps)


class Recording:
    """A strategy's communicator that notes its Isend and Irecv calls in order: 'p' a push
    sent, 'a' an answer (parameters) sent, 'r' the receive of an answer posted."""

    CODES = {("Isend", TAG_PUSH): "p", ("Isend", TAG_PULL): "a", ("Irecv", TAG_PULL): "r"}

    def __init__(self, comm):
        self._comm, self.calls = comm, []

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def Isend(self, buf, dest, tag):
        self.calls.append(self.CODES.get(("Isend", tag), "."))
        return self._comm.Isend(buf, dest, tag)

    def Irecv(self, buf, source, tag):
        self.calls.append(self.CODES.get(("Irecv", tag), "."))
        return self._comm.Irecv(buf, source, tag)


def cases(n: int):
    for optim in ("sgd", "adam"):
        yield "ps", {}, optim
        if n >= 2:
            yield "ps", {"servers": 1}, optim
        yield "ps-sharded", {}, optim
        if n >= 3:
            yield "ps-sharded", {"shards": 2}, optim
        if n >= 2:
            yield "ps-sharded", {"servers": 1}, optim
        if n >= 3:
            yield "ps-sharded", {"servers": 2}, optim
        if n >= 2:
            yield "ps-async", {"staleness": 0}, optim


def name_of(dp, options, optim):
    opts = ",".join(f"{k}={v}" for k, v in sorted(options.items()))
    return f"{dp}[{opts}]/{optim}"


def equivalence(comm, out, n: int, steps: int, batch: int, micro: int) -> None:
    data = make_data(batch, steps)
    for dp, options, optim in cases(comm.size):
        t_case = time.perf_counter()
        model = make_model()
        want, want_losses = reference(model, optim, data)
        perturb(model, comm.rank)
        s = build(dp, model, optim, comm, **options)
        if dp == "ps-sharded" and not options:
            s.pcomm = Recording(s.pcomm)
        stats = run_steps(s, model, data, micro) if s.is_worker else []
        if not s.is_worker:
            s.serve()
        record = dict(size=n, micro=micro, case=name_of(dp, options, optim), rank=comm.rank,
                      worker=s.is_worker, state_numel=s.optimizer_state_numel(),
                      numel=s.flat.numel)
        shard = getattr(s, "shard_range", None)
        record["shard"] = list(shard) if shard else None
        if isinstance(s.pcomm, Recording):
            record["calls"] = "".join(s.pcomm.calls)
        s.finish()
        if s.is_worker:
            got = flat(model)
            record.update(maxdiff=float((got - want).abs().max()), maxref=float(want.abs().max()),
                          digest=digest(got), bitwise=bool(torch.equal(got, want)),
                          bytes=[st.bytes_sent for st in stats],
                          losses=[st.loss for st in stats], ref_losses=want_losses,
                          compute_s=sum(st.compute_s for st in stats),
                          comm_s=sum(st.comm_s for st in stats))
        else:
            record.update(server_totals=s.server_totals)
        record["wall_s"] = time.perf_counter() - t_case
        out.add(**record)


def resume(comm, out, batch: int) -> None:
    """2 steps, state_dict, 2 more steps; then a model built from another seed loads the
    state_dict and runs the same 2 steps: the parameters must agree bit for bit."""
    data = make_data(batch, 4, seed=7)
    layouts = [("ps", {}), ("ps-sharded", {})]
    if comm.size >= 2:
        layouts += [("ps", {"servers": 1}), ("ps-sharded", {"servers": 1}),
                    ("ps-async", {"staleness": 0})]
    for dp, options in layouts:
        model = make_model()
        s = build(dp, model, "adam", comm, **options)
        if s.is_worker:
            run_steps(s, model, data[:2])
        state = copy.deepcopy(s.state_dict()) if s.is_worker else None
        if s.is_worker:
            run_steps(s, model, data[2:])
        else:
            # a dedicated server checkpoints between two serving phases
            s.serve(rounds=2)
            state = copy.deepcopy(s.state_dict())
            s.serve()
        s.finish()
        continued = flat(model)
        model2 = make_model(seed=123)
        s2 = build(dp, model2, "adam", comm, **options)
        s2.load_state_dict(state)
        if s2.is_worker:
            run_steps(s2, model2, data[2:])
        s2.finish()
        out.add(size=comm.size, case=f"resume/{dp}/{options}", rank=comm.rank, worker=s.is_worker,
             same=bool(torch.equal(flat(model2), continued)) if s.is_worker else None)


def backup(comm, out, batch: int, steps: int = 4, late_s: float = 0.5) -> None:
    """--backup-workers 1 with a straggler: the last worker sleeps `late_s` before each step,
    so the server takes the others' gradients every step and leaves its out; the run must
    equal one process trained on the other workers' shares only, and every worker (the
    straggler too) must end with the same parameters."""
    data = make_data(batch, steps, seed=11)
    model = make_model()
    share = batch // comm.size
    kept = [(x[:share * (comm.size - 1)], y[:share * (comm.size - 1)]) for x, y in data]
    want, _ = reference(model, "sgd", kept)
    s = build("ps", model, "sgd", comm, backup_workers=1)
    t0 = time.perf_counter()
    for x, y in data:
        if comm.rank == comm.size - 1:
            time.sleep(late_s)
        mbs = local_microbatches(x, y, s.worker_rank, s.num_workers, 1)
        s.step(mse(model), mbs)
    s.finish()
    got = flat(model)
    out.add(size=comm.size, case="backup", rank=comm.rank, worker=False, maxdiff=float((got - want).abs().max()),
            digest=digest(got), left_out=s.server_totals["left_out"] if s.shard is not None else None,
            wall_s=time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,2,3,4",
                    help="run every case on sub-communicators of these sizes (ranks 0..n-1)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per worker and step")
    ap.add_argument("--resume-size", type=int, default=3, help="size for the resume check (0: skip)")
    args = ap.parse_args()
    world = psrt.init()
    torch.set_num_threads(1)
    out = Results(world.comm)
    # Every rank pays torch's first-optimizer-step cost now, all at once, not one size at a time.
    reference(make_model(), "adam", make_data(4, 1))
    # One launch covers every size: ranks 0..n-1 form a communicator of n ranks, which the
    # strategies receive explicitly (they never look at COMM_WORLD); the others skip ahead.
    sizes = [int(n) for n in args.sizes.split(",")]
    for n in sorted(set(sizes + ([args.resume_size] if args.resume_size else []))):
        sub = world.comm.Split(0 if world.rank < n else MPI.UNDEFINED, world.rank)
        if sub == MPI.COMM_NULL:
            continue
        comm = psrt.Communicator(sub)
        if n in sizes:
            # micro-batches of 1 on one rank make the run identical to the reference's
            equivalence(comm, out, n, args.steps, args.batch, 1 if n == 1 else args.micro)
        if n == args.resume_size:
            resume(comm, out, args.batch)
        if n == max(sizes) and n >= 3:
            backup(comm, out, args.batch)
        comm.close()
        sub.Free()
    out.flush()


if __name__ == "__main__":
    main()
