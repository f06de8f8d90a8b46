"""Rank-side check of the memory ledger's claims, measured from outside the strategies.

    mpirun -np 4 python ledger_probe.py        # sizes 2 and 4 on sub-communicators

The ledger (psrt.dp.memory) sums the tensors each strategy *names* in memory(), and the
bytes per step come from psrt's cost model.  This script measures the same things without
asking the strategy, for zero1, zero2 and zero3 on a 4-block transformer with Adam:

- held: every tensor storage reachable from the strategy object and the model (attributes,
  containers, the optimizer's state, each parameter's .grad), walked by the script, at the
  end of a step and, through hooks, at every gradient during backward; beside memory.held.
- live gradients: the bytes of the parameters' .grad during backward (zero2 must drop each
  bucket's as soon as it is reduced; zero1 keeps the whole gradient until backward ends).
- gathered units: the storage of every buffer zero3 all-gathers into, followed by weak
  reference (a storage dies only when no tensor, autograd's saved ones included, holds it),
  counted at the end of forward and at every gather.
- bytes sent: the comm under the strategy's Communicator replaced by a proxy that adds up
  every point-to-point send the algorithms make (Isend, Send, Sendrecv) of the ring.

Every rank prints one `PSRT-RESULT {json}` per strategy and size.
"""
import json
import sys
import weakref

import torch
import torch.nn.functional as F
from mpi4py import MPI

import psrt
from psrt.dp import memory, strategy_class
from psrt.train.models import TransformerLM

VOCAB, SEQ, DIM, LAYERS, STEPS, BATCH = 64, 16, 64, 4, 2, 8
BUCKET_MB = 0.05


def nbytes(spec) -> int:
    """Bytes of an mpi4py message spec as psrt.transport.msg builds them."""
    if isinstance(spec, (list, tuple)):
        return int(spec[1])
    return int(spec.nbytes)


class CountingComm:
    """An mpi4py communicator whose point-to-point sends add their bytes to `sent`."""

    def __init__(self, comm):
        self._comm, self.sent = comm, 0

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def Isend(self, buf, *args, **kw):
        self.sent += nbytes(buf)
        return self._comm.Isend(buf, *args, **kw)

    def Send(self, buf, *args, **kw):
        self.sent += nbytes(buf)
        return self._comm.Send(buf, *args, **kw)

    def Sendrecv(self, sendbuf, *args, **kw):
        self.sent += nbytes(sendbuf)
        return self._comm.Sendrecv(sendbuf, *args, **kw)


def reachable(*roots) -> dict:
    """Every tensor storage reachable from `roots` through psrt objects, modules, optimizers
    and containers, and every leaf tensor's .grad: {(device, pointer): bytes}."""
    out, seen, stack = {}, set(), list(roots)
    while stack:
        o = stack.pop()
        if id(o) in seen or o is None:
            continue
        seen.add(id(o))
        if torch.is_tensor(o):
            if o.numel():
                s = o.untyped_storage()
                out[(s.device.type, s.data_ptr())] = s.nbytes()
            if o.is_leaf and o.grad is not None:
                stack.append(o.grad)
        elif isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif isinstance(o, (torch.nn.Module, torch.optim.Optimizer)) or type(o).__module__.startswith("psrt"):
            stack.extend(getattr(o, "__dict__", {}).values())
            stack.extend(getattr(o, name) for c in type(o).__mro__ for name in getattr(c, "__slots__", ())
                         if hasattr(o, name))
    return out


def run(name: str, comm, data) -> dict:
    torch.manual_seed(0)
    model = TransformerLM(vocab=VOCAB, dim=DIM, layers=LAYERS, heads=4, max_len=SEQ)
    params = list(model.parameters())
    phi = sum(p.numel() for p in params)
    group = psrt.Communicator(comm)
    options = {"bucket_mb": BUCKET_MB} if name == "zero2" else {}
    strategy = strategy_class(name)(model, lambda ps: torch.optim.Adam(ps, lr=1e-3), group, **options)
    counter = CountingComm(group.comm)
    group.comm = counter                     # what every algorithm of this group sends through

    gathered = []                            # (weak reference to the storage, bytes) per all-gather
    gather = group.allgather
    peak = {"gathered": 0, "live_grads": 0, "held": 0}

    def alive() -> int:
        return sum(n for ref, n in gathered if ref() is not None)

    def counting_gather(t, out=None, **kw):
        if out is not None and name == "zero3":
            s = out.untyped_storage()
            gathered.append((weakref.ref(s), s.nbytes()))
            peak["gathered"] = max(peak["gathered"], alive())
        return gather(t, out=out, **kw)
    group.allgather = counting_gather

    def grad_seen(p):
        grads = {}
        for q in params:
            if q.grad is not None:
                s = q.grad.untyped_storage()
                grads[s.data_ptr()] = s.nbytes()
        peak["live_grads"] = max(peak["live_grads"], sum(grads.values()))
        if last[0]:
            peak["held"] = max(peak["held"], sum(reachable(strategy, model).values()))
    last = [False]
    # Registered after the strategy's own hooks, so each sees what they left.
    hooks = [p.register_post_accumulate_grad_hook(grad_seen) for p in params]

    end_of_forward = []
    per = BATCH // comm.size
    stats = []
    for s in range(STEPS):
        last[0] = s == STEPS - 1              # Adam's state exists from the first step on
        mine = data[s, comm.rank * per:(comm.rank + 1) * per]

        def loss_fn(mb):
            logits = model(mb[:, :-1])
            end_of_forward.append(alive())
            return F.cross_entropy(logits.reshape(-1, VOCAB), mb[:, 1:].reshape(-1))
        stats.append(strategy.step(loss_fn, [mine]))
    held_walk = sum(reachable(strategy, model).values())
    ledger = memory.held(strategy)
    sent = counter.sent / STEPS              # before finish(), which gathers zero3's model whole
    for h in hooks:
        h.remove()
    units = [u.numel * 4 for u in strategy.map.units]
    strategy.finish()
    group.comm = counter._comm
    group.close()
    return {"dp": name, "size": comm.size, "rank": comm.rank, "phi": phi, "units": units,
            "sent_counted": sent, "sent_model": sum(st.bytes_sent for st in stats) / STEPS,
            "end_of_forward": end_of_forward, "peak_gathered": peak["gathered"],
            "peak_live_grads": peak["live_grads"], "peak_held": peak["held"], "held_walk": held_walk,
            "held_ledger": sum(ledger[k] for k in memory.PARTS + ("buffers",))}


def main() -> None:
    world = psrt.init()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=g)
    for n in (2, 4):
        sub = world.comm.Split(0 if world.rank < n else MPI.UNDEFINED, world.rank)
        if sub != MPI.COMM_NULL:
            for name in ("zero1", "zero2", "zero3"):
                sys.stdout.write("PSRT-RESULT " + json.dumps(run(name, sub, data)) + "\n")
                sys.stdout.flush()
            sub.Free()
        world.comm.Barrier()


if __name__ == "__main__":
    main()
