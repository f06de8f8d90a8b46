"""Rank-side check: HorovodStrategy refuses a psrt communicator that is not Horovod's.

Horovod is started on the whole world (hvd.init() on every rank), then the strategy is
given a psrt communicator of one rank (COMM_SELF): averaging over Horovod's ranks while psrt
splits the batch over its own would train wrong without a word, so it must be a PsrtError.
Each rank prints `PSRT-RESULT {json}` with the message it got.
"""
import json
import sys

import horovod.torch as hvd
import torch
from mpi4py import MPI

import psrt
from psrt.dp import strategy_class
from psrt.errors import PsrtError


def main() -> None:
    world = psrt.init()
    hvd.init()
    self_comm = psrt.Communicator(MPI.COMM_SELF.Dup())
    model = torch.nn.Linear(3, 2)
    try:
        strategy_class("horovod")(model, lambda p: torch.optim.SGD(p, lr=0.1), self_comm)
        rec = {"rank": world.rank, "raised": False, "message": ""}
    except PsrtError as err:
        rec = {"rank": world.rank, "raised": True, "message": str(err)}
    sys.stdout.write("PSRT-RESULT " + json.dumps(rec) + "\n")
    sys.stdout.flush()
    self_comm.close()


if __name__ == "__main__":
    main()
