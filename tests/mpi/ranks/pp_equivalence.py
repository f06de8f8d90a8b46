"""Rank side of tests/mpi/test_pipeline.py: every schedule against the unpartitioned model.

For p in {1, 2, 4} pipeline ranks (sub-communicators of the world), each schedule and
m in {1, p, 2p+1} micro-batches, the pipeline's loss and every local parameter's gradient
are compared with the same model run whole in this process.  Blocks change width from one
to the next and micro-batches have uneven sizes, so activation shapes vary between stages
and between micro-batches.  For p > 1, 1F1B and interleaved also run with the payloads staged
as CUDA ones are without a CUDA-aware MPI (psrt/pp/p2p.py), through 64-byte host slots with
copies that run late (late_lanes.py), and every slot must be back in the pool after the
step.  Rank 0 prints one PSRT-RESULT line per case and rank.
"""
import copy
import json

import torch
from torch import nn

import psrt
from psrt.errors import PsrtError
from psrt.collectives.staged import Slots, Stager
from psrt.pp import PipelineRuntime, build_stages, make_schedule, split_batch
from late_lanes import LateLanes

WIDTHS = [6, 16, 12, 20, 10, 14, 8, 12, 5]   # 8 blocks; 5 classes
RTOL, ATOL = 1e-5, 4e-5


def blocks(seed: int):
    torch.manual_seed(seed)
    out = [nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in zip(WIDTHS[:-2], WIDTHS[1:-1])]
    return out + [nn.Linear(WIDTHS[-2], WIDTHS[-1])]


def case(comm, name: str, m: int, v: int, seed: int, staged: bool = False) -> dict:
    p, r = comm.Get_size(), comm.Get_rank()
    torch.manual_seed(100 + seed)
    x = torch.randn(2 * m + 1, WIDTHS[0])          # uneven micro-batch sizes for m > 1
    y = torch.randint(0, WIDTHS[-1], (2 * m + 1,))
    ref = blocks(seed)
    whole = nn.Sequential(*copy.deepcopy(ref))
    loss_ref = nn.functional.cross_entropy(whole(x), y)
    loss_ref.backward()
    sched = make_schedule(name, p, m, v)
    mine = copy.deepcopy(ref)
    stages = build_stages(mine, sched.num_stages, sched.stages_of(r))
    rt = PipelineRuntime(stages, sched, comm, nn.functional.cross_entropy, timeout_s=60)
    if staged:      # the CUDA staging path on the CPU: 64-byte slots, copies that run late
        rt.p2p._staged = lambda device: True
        rt.p2p._stager = Stager(lanes_for=LateLanes)
        rt.p2p._slots = Slots(chunk_bytes=64, pin=False)
    xs, ys, w = split_batch(x, y, m)
    stats = rt.step(xs, ys, w)
    errors = []
    if staged and len(rt.p2p._slots._free) != rt.p2p._slots.made:
        errors.append(f"{rt.p2p._slots.made - len(rt.p2p._slots._free)} of {rt.p2p._slots.made} slots not given back")
    if abs(stats.loss - loss_ref.item()) > ATOL + RTOL * abs(loss_ref.item()):
        errors.append(f"loss {stats.loss} != {loss_ref.item()}")
    checked = 0
    for i, (a, b) in enumerate(zip(mine, whole)):
        held = any(a is blk for st in stages.values() for blk in st)
        for (pn, pa), pb in zip(a.named_parameters(), b.parameters()):
            if not held:
                if pa.grad is not None:
                    errors.append(f"block {i} {pn} has a gradient on a rank that does not hold it")
                continue
            checked += 1
            if pa.grad is None or not torch.allclose(pa.grad, pb.grad, rtol=RTOL, atol=ATOL):
                diff = None if pa.grad is None else (pa.grad - pb.grad).abs().max().item()
                errors.append(f"block {i} {pn}: max diff {diff}")
    return {"schedule": name, "p": p, "m": m, "v": v, "checked": checked, "errors": errors, "staged": staged,
            "slots": rt.p2p._slots.made, "sent": stats.bytes_sent,
            "peak_live": stats.peak_live_microbatches, "peak_bytes": stats.peak_activation_bytes}


def hang_check(world) -> str:
    """Rank 1 of a pair never runs its stage: rank 0 must raise, not wait for ever."""
    pair = world.comm.Split(color=world.rank // 2, key=world.rank)
    msg = ""
    if pair.Get_rank() == 0:
        sched = make_schedule("gpipe", 2, 2)
        stages = build_stages(blocks(0), 2, [0])
        rt = PipelineRuntime(stages, sched, pair, nn.functional.cross_entropy, timeout_s=1.5)
        x = torch.randn(4, WIDTHS[0])
        try:
            rt.step(list(x.split(2)), None)
        except PsrtError as err:
            msg = str(err)
    pair.Barrier()
    return msg


def main():
    world = psrt.init()
    results = []
    for p in (1, 2, 4):
        if world.size % p:
            continue
        comm = world.comm.Split(color=world.rank // p, key=world.rank)
        for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
            for m in sorted({1, p, 2 * p + 1}):
                results.append(case(comm, name, m, v, seed=len(results)))
            if p > 1 and name != "gpipe":
                results.append(case(comm, name, 2 * p + 1, v, seed=len(results), staged=True))
        comm.Free()
    mine = [dict(r, rank=world.rank) for r in results] + [{"rank": world.rank, "hang": hang_check(world)}]
    # Every rank's lines printed by rank 0 alone: mpirun may interleave lines that several
    # ranks print at once, and a record cut by another rank's line cannot be read.
    every = world.comm.gather(mine, root=0)
    for r in (r for rank_results in every or [] for r in rank_results):
        print("PSRT-RESULT " + json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
