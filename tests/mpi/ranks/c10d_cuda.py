"""Rank-side: the psrt torch.distributed backend on CUDA tensors equals the same on CPU tensors,
and a collective, a send or a receive called on a side stream is ordered after what that
stream queued before the call."""
import json

import torch
import torch.distributed as dist

import psrt.c10d
from psrt.transport import forced_but_unsupported

psrt.c10d.init_process_group()
world = psrt.c10d.job_world()

# PSRT_CUDA_AWARE=1 from a test that cannot ask the library itself (the pytest process is no
# MPI process): on an MPI that is not CUDA-aware the ranks report a skip instead of crashing.
if forced_but_unsupported():
    print("PSRT-RESULT " + json.dumps({"rank": world.rank, "skip": forced_but_unsupported()}), flush=True)
    raise SystemExit(0)
torch.cuda.set_device(world.local_rank % torch.cuda.device_count())
r, n = dist.get_rank(), dist.get_world_size()
failures, checked = [], 0


def expect(ok: bool, what: str) -> None:
    global checked
    checked += 1
    if not ok:
        failures.append(what)


for dtype in (torch.float32, torch.bfloat16, torch.float16):
    x = torch.full((1 << 16,), float(r + 1), device="cuda", dtype=dtype)
    dist.all_reduce(x)
    expect(torch.equal(x.cpu(), torch.full((1 << 16,), float(n * (n + 1) // 2), dtype=dtype)), f"all_reduce {dtype}")
    out = torch.empty(4 * n, device="cuda", dtype=dtype)
    dist.all_gather_into_tensor(out, torch.full((4,), float(r), device="cuda", dtype=dtype))
    expect(out.cpu().tolist() == [float(j) for j in range(n) for _ in range(4)], f"all_gather {dtype}")
# stream order: a side stream fills the tensor and the collective is called on that stream
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    big = torch.empty(1 << 22, device="cuda")
    torch.cuda._sleep(50_000_000)          # keep the stream busy so a missed order shows
    big.fill_(float(r + 1))
    dist.all_reduce(big)
torch.cuda.synchronize()
expect(bool((big == n * (n + 1) / 2).all()), "all_reduce after a side-stream write")
# point to point: a send and a receive called on a side stream that is still writing the
# tensor (send) or still reading it (receive) when the call is made
peer_to, peer_from = (r + 1) % n, (r - 1) % n
with torch.cuda.stream(side):
    out = torch.empty(1 << 22, device="cuda")
    into = torch.zeros(1 << 22, device="cuda")
    torch.cuda._sleep(50_000_000)
    out.fill_(float(r + 1))
    before = into.sum()                     # a read of the receive buffer, queued before the receive
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer_to),
                                    dist.P2POp(dist.irecv, into, peer_from)])
    for w in works:
        w.wait()
    after = into.sum()
torch.cuda.synchronize()
expect(before.item() == 0.0, "a receive wrote the tensor before the stream's earlier read of it")
expect(bool((into == peer_from + 1).all()) and after.item() == (peer_from + 1) * (1 << 22),
       "batch_isend_irecv on a busy side stream")
with torch.cuda.stream(side):               # blocking send/recv, non-contiguous, bfloat16
    grid = torch.zeros(64, 64, device="cuda", dtype=torch.bfloat16)
    torch.cuda._sleep(50_000_000)
    grid.fill_(float(r + 1))
    got = torch.zeros(64, 64, device="cuda", dtype=torch.bfloat16).t()
    if r % 2 == 0:
        dist.send(grid.t(), dst=peer_to)
        dist.recv(got, src=peer_from)
    else:
        dist.recv(got, src=peer_from)
        dist.send(grid.t(), dst=peer_to)
torch.cuda.synchronize()
expect(bool((got == peer_from + 1).all()), "send/recv of non-contiguous bfloat16 CUDA tensors")
# a receive's future completes (and its value is in the tensor) without wait()
fut_into = torch.zeros(8, device="cuda")
works = [dist.irecv(fut_into, src=peer_from), dist.isend(torch.full((8,), float(r), device="cuda"), dst=peer_to)]
value = works[0].get_future().wait()[0]
torch.cuda.synchronize()
expect(value.cpu().tolist() == [float(peer_from)] * 8, "a CUDA receive's future")
works[1].wait()
# DDP on CUDA against DDP on CPU, same seed and data
for device in ("cpu", "cuda"):
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 4).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        g = torch.Generator().manual_seed(step * n + r)
        x = torch.randn(8, 16, generator=g).to(device)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    if device == "cpu":
        ref = [p.detach().clone() for p in model.parameters()]
    else:
        expect(all(torch.allclose(p.detach().cpu(), q, atol=1e-5) for p, q in zip(model.parameters(), ref)),
               "DDP on CUDA equals DDP on CPU")
print("PSRT-RESULT " + json.dumps({"rank": r, "failures": failures, "checked": checked}), flush=True)
dist.destroy_process_group()
