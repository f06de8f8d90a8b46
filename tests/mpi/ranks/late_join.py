"""Rank-side: rank 0 reaches a join (psrt.collectives.p2p.barrier) SLOW_S seconds late; every
other rank waits at most TIMEOUT_S there and must then raise PeerTimeout naming the join.

    late_join.py SLOW_S TIMEOUT_S
"""
import json
import sys
import time

from psrt.collectives.p2p import barrier
from psrt.errors import PeerTimeout

slow, timeout = float(sys.argv[1]), float(sys.argv[2])
from mpi4py import MPI  # noqa: E402

comm = MPI.COMM_WORLD
start = time.monotonic()
said = None
if comm.rank == 0:
    time.sleep(slow)
    comm.Ibarrier().Wait()           # matches the others' join, which is still pending
else:
    try:
        barrier(comm, timeout, "the test's join")
    except PeerTimeout as err:
        said = str(err)
waited = time.monotonic() - start
comm.Barrier()
print("PSRT-RESULT " + json.dumps({"rank": comm.rank, "waited": waited, "said": said}), flush=True)
