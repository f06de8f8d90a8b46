"""Rank-side: rank 1 leaves the job early with exit code 0; rank 0 must not wait for it.

    PSRT_TIMEOUT=10 mpirun -np 2 python leave_early.py MODE
    ring, ps:  psrt.data_parallel with that strategy; rank 1 calls sys.exit(0) at step 5 of 10.
    nofinish:  psrt.data_parallel ps; rank 1 takes all 10 steps and ends without finish(),
               while rank 0 (the server) finishes, serving until every worker is done.
    comm:      a bare psrt.Communicator; rank 1 leaves after the first all-reduce, rank 0
               makes a second.
    c10d:      torch.distributed on the psrt backend; rank 1 leaves after the first
               all_reduce without destroy_process_group, rank 0 makes a second.
Rank 0 prints `PSRT-RESULT {"finished": true}` only if it was not stopped.
"""
import sys

import torch
import torch.nn.functional as F

mode = sys.argv[1]


def leave(where: str) -> None:
    print(f"rank 1 leaves {where}", flush=True)
    sys.exit(0)


if mode == "c10d":
    import torch.distributed as dist

    import psrt.c10d
    psrt.c10d.init_process_group()
    rank = dist.get_rank()
    dist.all_reduce(torch.ones(4))
    if rank == 1:
        leave("before the second all_reduce")
    dist.all_reduce(torch.ones(4))
else:
    import psrt
    world = psrt.init()
    rank = world.rank
    if mode == "comm":
        group = psrt.Communicator(world.comm)
        group.allreduce(torch.ones(4))
        if rank == 1:
            leave("before the second allreduce")
        group.allreduce(torch.ones(4))
    else:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        dp = psrt.data_parallel(model, lambda p: torch.optim.SGD(p, lr=0.1),
                                strategy="ring" if mode == "ring" else "ps", world=world)
        x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        for step in range(1, 11):
            if rank == 1 and step == 5 and mode != "nofinish":
                leave("at step 5")
            dp.step(lambda mb: F.cross_entropy(model(mb[0]), mb[1]), (x, y))
        if rank == 1:
            leave("without finish()")
        dp.finish()
if rank == 0:
    print("PSRT-RESULT {\"finished\": true}", flush=True)
