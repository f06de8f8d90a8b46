"""Every torch.distributed call on the psrt backend against its definition, then the errors:
a mismatched call, a failing collective under DDP, the future and Work of a failed call.
Each group runs the algorithm asked for (PSRT_ALGORITHM, else pg_options): what its
Communicator recorded per call says so.

usage: [PSRT_ALGORITHM=A] mpirun -np N python c10d_ops.py   (or python c10d_ops.py: one plain process)
"""
import functools
import operator
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import psrt.c10d
from psrt.collectives import small
from psrt.errors import CollectiveMismatch, PsrtError
from psrt.trace import Tracer

pg = psrt.c10d.init_process_group()
r, n = dist.get_rank(), dist.get_world_size()
R = dist.ReduceOp
tri = n * (n + 1) / 2     # sum of (rank + 1)


def mine(*shape, dtype=torch.float32):
    return torch.full(shape, float(r + 1)).to(dtype)


def check(cond, what):
    assert cond, f"rank {r}: {what}"


# ---------------------------------------------------------------- reductions
for op, want in ((R.SUM, tri), (R.AVG, tri / n), (R.MAX, n), (R.MIN, 1), (R.PRODUCT, float(torch.arange(1, n + 1).prod()))):
    t = mine(5)
    dist.all_reduce(t, op=op)
    check(torch.allclose(t, torch.full((5,), float(want))), f"all_reduce {op}: {t}")
for dtype in (torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32):
    t = mine(3, dtype=dtype)
    dist.all_reduce(t)
    check(t.tolist() == [tri] * 3, f"all_reduce {dtype}: {t}")
t = mine(4)
dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
check(torch.allclose(t, torch.full((4,), tri * 0.5)), f"premul_sum {t}")
for op, fold in ((R.BAND, operator.and_), (R.BOR, operator.or_), (R.BXOR, operator.xor)):
    def bits(j):
        return [1 << j, j + 1, 3 * j + 5, 0b11111 ^ (1 << j)]
    for dtype in (torch.int64, torch.int32, torch.uint8):
        t = torch.tensor(bits(r), dtype=dtype)
        dist.all_reduce(t, op=op)
        want = [functools.reduce(fold, col) for col in zip(*(bits(j) for j in range(n)))]
        check(t.tolist() == want, f"all_reduce {op} {dtype}: {t.tolist()} != {want}")
    t = torch.tensor([r % 2 == 0, True, r == 0])
    dist.all_reduce(t, op=op)
    want = [functools.reduce(fold, col) for col in zip(*([j % 2 == 0, True, j == 0] for j in range(n)))]
    check(t.tolist() == want, f"all_reduce {op} bool: {t.tolist()} != {want}")
c = torch.ones(2, dtype=torch.complex64) * (1 + 2j) * (r + 1)
dist.all_reduce(c)
check(torch.allclose(c, torch.full((2,), tri * (1 + 2j))), f"complex {c}")
t = mine(3, 4).t()                      # not contiguous
dist.all_reduce(t)
check(torch.allclose(t, torch.full((4, 3), tri)), "all_reduce of a transposed tensor")
ts = [mine(2), mine(3, dtype=torch.float64), mine(1)]
pg.allreduce_coalesced(ts).wait()
check(all(torch.allclose(x.double(), torch.full(x.shape, tri, dtype=torch.float64)) for x in ts), "coalesced")
t = mine(3)
dist.reduce(t, dst=n - 1)
if r == n - 1:
    check(t.tolist() == [tri] * 3, f"reduce {t}")
out = torch.empty(2)
dist.reduce_scatter_tensor(out, torch.arange(2 * n, dtype=torch.float32) * (r + 1))
check(out.tolist() == [tri * 2 * r, tri * (2 * r + 1)], f"reduce_scatter_tensor {out}")
outs = [torch.empty(2), torch.empty(1, dtype=torch.float64)]
opts = dist.ReduceScatterOptions()
pg.reduce_scatter_tensor_coalesced(outs, [torch.arange(2.0 * n) * (r + 1), torch.ones(n, dtype=torch.float64)], opts).wait()
check(outs[0].tolist() == [tri * 2 * r, tri * (2 * r + 1)] and outs[1].tolist() == [float(n)], f"rs coalesced {outs}")
outs = [torch.empty(2 * n), torch.empty(n, dtype=torch.int64)]
pg.allgather_into_tensor_coalesced(outs, [torch.full((2,), float(r)), torch.tensor([r])]).wait()
check(outs[0].tolist() == [float(j) for j in range(n) for _ in range(2)] and outs[1].tolist() == list(range(n)),
      f"ag coalesced {outs}")
# all_gather_coalesced: list j holds rank j's inputs, of any shapes (torch requires one dtype
# per call; psrt moves them as one message of bytes: int16 is not a dtype MPI reduces)
for dtype in (torch.float32, torch.int16):
    ins = [torch.full((3,), r + 1, dtype=dtype), torch.full((2, 2), -r, dtype=dtype), torch.empty(0, dtype=dtype)]
    lists = [[torch.empty_like(t) for t in ins] for _ in range(n)]
    dist.all_gather_coalesced(lists, ins)
    check(all(lists[j][0].tolist() == [j + 1] * 3 and lists[j][1].tolist() == [[-j, -j]] * 2
              and lists[j][2].numel() == 0 for j in range(n)), f"all_gather_coalesced {dtype} {lists}")
# a sparse all_reduce sums as gloo's: rank r sets rows r and 0 of a 2-column dense part
sp = torch.sparse_coo_tensor(torch.tensor([[r, 0]]), torch.tensor([[1.0, r], [2.0, 2.0]]), (n, 2))
dist.all_reduce(sp)
want = torch.tensor([[1.0, r] for r in range(n)]); want[0] += torch.tensor([2.0 * n, 2.0 * n])
check(sp.is_sparse and torch.equal(sp.to_dense(), want), f"sparse all_reduce {sp.to_dense()} != {want}")
out = torch.empty(3)
dist.reduce_scatter(out, [torch.full((3,), float(j + r)) for j in range(n)], op=R.AVG)
check(torch.allclose(out, torch.full((3,), r + (n - 1) / 2)), f"reduce_scatter avg {out}")

# ---------------------------------------------------------------- data movement
b = mine(3, dtype=torch.int16)          # a dtype psrt moves as bytes
dist.broadcast(b, src=n - 1)
check(b.tolist() == [n] * 3, f"broadcast int16 {b}")
outs = [torch.empty(2, 2) for _ in range(n)]
dist.all_gather(outs, mine(2, 2))
check([o[0, 0].item() for o in outs] == [j + 1 for j in range(n)], "all_gather")
o = torch.empty(2 * n, dtype=torch.bfloat16)
dist.all_gather_into_tensor(o, mine(2, dtype=torch.bfloat16))
check(o.tolist() == [float(j + 1) for j in range(n) for _ in range(2)], f"all_gather_into_tensor {o}")
x = torch.arange(n, dtype=torch.float32) + 10 * r
y = torch.empty(n)
dist.all_to_all_single(y, x)
check(y.tolist() == [10 * j + r for j in range(n)], f"all_to_all_single {y}")
# uneven splits: rank r sends j + 1 rows to rank j
send = torch.full((sum(range(1, n + 1)), 2), float(r))
y = torch.empty((n * (r + 1), 2))
dist.all_to_all_single(y, send, output_split_sizes=[r + 1] * n, input_split_sizes=[j + 1 for j in range(n)])
check(y[:, 0].tolist() == [float(j) for j in range(n) for _ in range(r + 1)], f"all_to_all uneven {y}")
outs = [torch.empty(1) for _ in range(n)]
dist.all_to_all(outs, [torch.tensor([float(10 * r + j)]) for j in range(n)])
check([o.item() for o in outs] == [float(10 * j + r) for j in range(n)], "all_to_all lists")
gathered = [torch.empty(2) for _ in range(n)] if r == 0 else None
dist.gather(mine(2), gathered, dst=0)
if r == 0:
    check([g[0].item() for g in gathered] == [j + 1.0 for j in range(n)], "gather")
got = torch.empty(2)
dist.scatter(got, [torch.full((2,), float(j)) for j in range(n)] if r == 0 else None, src=0)
check(got.tolist() == [float(r)] * 2, f"scatter {got}")
objs = [None] * n
dist.all_gather_object(objs, {"rank": r})
check(objs == [{"rank": j} for j in range(n)], "all_gather_object")
dist.barrier()

# ---------------------------------------------------------------- async, p2p, groups
work = dist.all_reduce(mine(2), async_op=True)
check(work.get_future().wait()[0].tolist() == [tri] * 2, "future value")
check(work.wait() and work.is_completed(), "work")
if n > 1:
    # A send's and a receive's futures complete when the transfer does, with no wait() or
    # is_completed() to drive them (callbacks chained on them run then).
    got = torch.empty(3)
    works = [dist.irecv(got, src=(r - 1) % n, tag=11), dist.isend(mine(3), dst=(r + 1) % n, tag=11)]
    futures = [w.get_future() for w in works]
    chained = futures[0].then(lambda f: f.value()[0].sum().item())
    deadline = time.monotonic() + 60
    while not all(f.done() for f in futures + [chained]) and time.monotonic() < deadline:
        time.sleep(0.001)
    check(all(f.done() for f in futures + [chained]), "p2p futures did not complete without wait()")
    check(got.tolist() == [float((r - 1) % n + 1)] * 3, f"irecv by its future {got}")
    check(chained.value() == 3.0 * ((r - 1) % n + 1), f"callback on a receive's future: {chained.value()}")
    recv = torch.empty(2)
    ops = [dist.P2POp(dist.isend, mine(2), (r + 1) % n), dist.P2POp(dist.irecv, recv, (r - 1) % n)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    check(recv.tolist() == [float((r - 1) % n + 1)] * 2, f"batch_isend_irecv {recv}")
    if r == 0:
        dist.send(torch.arange(3.0), dst=n - 1, tag=5)
    elif r == n - 1:
        t = torch.empty(3)
        dist.recv(t, src=0, tag=5)
        check(t.tolist() == [0.0, 1.0, 2.0], "send/recv")
    # from any source: recv returns the sender's global rank, irecv's Work names its group rank
    if r in (0, 1) and n > 2:
        dist.send(torch.full((2,), float(r)), dst=n - 1, tag=6)
    elif r == n - 1 and n > 2:
        got = torch.empty(2)
        first = dist.recv(got, tag=6)
        check(first in (0, 1) and got.tolist() == [float(first)] * 2, f"recv from any source: {first} {got}")
        work = dist.irecv(got, tag=6)
        work.wait()
        check(work._source_rank() == 1 - first and got.tolist() == [float(1 - first)] * 2,
              f"irecv from any source: {work._source_rank()} {got}")
# subgroups: evens and odds (sizes differ when n is odd), and ps on one of them
evens = dist.new_group(list(range(0, n, 2)), pg_options=psrt.c10d.Options(algorithm="ps"))
odds = dist.new_group(list(range(1, n, 2))) if n > 1 else None
group = evens if r % 2 == 0 else odds
t = mine(2)
dist.all_reduce(t, group=group)
members = range(r % 2, n, 2)
check(t.tolist() == [float(sum(j + 1 for j in members))] * 2, f"subgroup all_reduce {t}")
check(dist.get_process_group_ranks(group) == list(members), "subgroup ranks")
# every rank, in another order than the world's: not the default group
backwards = dist.new_group(list(range(n - 1, -1, -1)), sort_ranks=False)
check(dist.get_group_rank(backwards, r) == n - 1 - r, "group rank in a reversed group")
outs = [torch.empty(1) for _ in range(n)]
dist.all_gather(outs, torch.tensor([float(r)]), group=backwards)
check([o.item() for o in outs] == [float(n - 1 - j) for j in range(n)], f"all_gather, reversed group: {outs}")
t = torch.tensor([float(r)])
dist.broadcast(t, group_src=0, group=backwards)
check(t.item() == n - 1, f"broadcast from group rank 0 of a reversed group: {t}")

# ---------------------------------------------------------------- the algorithm each group runs
asked = os.environ.get("PSRT_ALGORITHM", "auto")
by_dict = dist.new_group(list(range(n)), pg_options={"algorithm": "tree"})
inherits = dist.new_group(list(range(n)))
cases = [(dist.group.WORLD, asked), (inherits, asked), (by_dict, "tree"), (evens if r % 2 == 0 else None, "ps")]
for g, want in cases:
    if g is None:
        continue
    check(g.algorithm == want, f"group {dist.get_process_group_ranks(g)}: algorithm {g.algorithm}, asked {want}")
    g.group.tracer = Tracer()        # what the group's Communicator ran, per call
    for numel in (5, small.SMALL_BYTES // 4 + 1):       # the small-message path and the full one
        t = mine(numel)
        dist.all_reduce(t, group=g)
        check(bool((t == float(sum(j + 1 for j in dist.get_process_group_ranks(g)))).all()), f"all_reduce on {want}")
    used = {args["algorithm"] for name, _, _, _, _, args in g.group.tracer.events if name == "allreduce"}
    g.group.tracer = Tracer(enabled=False)
    check(used == {want} if want != "auto" else len(used) >= 1 and "auto" not in used,
          f"asked for {want}, the Communicator ran {used}")
try:
    dist.new_group(list(range(n)), pg_options=object())
    check(False, "a foreign pg_options object was taken")
except PsrtError as err:
    check("pg_options must be psrt.c10d.Options" in str(err), f"foreign pg_options: {err}")

# ---------------------------------------------------------------- errors
pg_psrt = dist.group.WORLD
try:
    pg_psrt.group.check = "all"
    dist.all_reduce(torch.ones(4 + (r == n - 1)))
    check(n == 1, "a mismatched all_reduce did not raise")
except CollectiveMismatch as err:
    check(f"ranks [{n - 1}]" in str(err), f"mismatch names the rank: {err}")
try:
    dist.all_reduce(torch.ones(3 + (r == n - 1), dtype=torch.int64), op=R.BXOR)
    check(n == 1, "a mismatched bitwise all_reduce did not raise")
except CollectiveMismatch as err:
    check(f"ranks [{n - 1}]" in str(err), f"bitwise mismatch names the rank: {err}")
t = torch.ones(2)
dist.all_reduce(t)          # the group still works after a refused call
check(t.tolist() == [float(n)] * 2, "all_reduce after a mismatch")

model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
real = pg_psrt.group.allreduce


def broken(*args, **kwargs):
    raise PsrtError("injected failure")


pg_psrt.group.allreduce = broken
try:
    model(torch.ones(2, 4)).sum().backward()
    check(False, "DDP's backward did not see the failed all-reduce")
except RuntimeError as err:
    check("injected failure" in str(err), f"DDP error: {err}")
work = dist.all_reduce(torch.ones(1), async_op=True)
for name, call in (("future", lambda: work.get_future().wait()), ("wait", work.wait)):
    try:
        call()
        check(False, f"{name} of a failed call returned")
    except Exception as err:  # noqa: BLE001
        check("injected failure" in str(err), f"{name}: {err}")
pg_psrt.group.allreduce = real
dist.barrier()
print(f"rank {r}: c10d ops ok", flush=True)
dist.destroy_process_group()
