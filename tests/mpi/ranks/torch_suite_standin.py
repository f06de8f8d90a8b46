"""A stand-in for scripts/torch_suite_rank.py that speaks its protocol, for the driver's tests.

usage: python torch_suite_standin.py --list
       mpirun -np 2 python torch_suite_standin.py --backend psrt TEST...
    test_pass passes; test_hang never ends on rank 1; test_kill ends rank 0's process;
    test_fail fails on rank 1 only, and the job ends after it; test_skip skips at run time; test_listed_skip is skipped
    by the listing.  Each rank appends its events to TEMP_DIR/results.<rank>.
"""
import json
import os
import sys
import time

TESTS = ("test_pass", "test_hang", "test_after_hang", "test_kill", "test_after_kill", "test_fail",
         "test_skip", "test_listed_skip")

if sys.argv[1] == "--list":
    print(json.dumps([{"test": t, "skip": "the listing skips it" if t == "test_listed_skip" else None}
                      for t in TESTS]))
    sys.exit(0)
from mpi4py import MPI  # noqa: E402 - the listing above runs without MPI, as the real one does

rank = MPI.COMM_WORLD.Get_rank()
names = sys.argv[3:]      # after --backend NAME
with open(os.path.join(os.environ["TEMP_DIR"], f"results.{rank}"), "a", buffering=1) as out:
    for name in names:
        MPI.COMM_WORLD.Barrier()      # as the real one: no rank runs ahead of the others
        out.write(json.dumps({"test": name, "event": "start"}) + "\n")
        status, reason = "passed", ""
        if name == "test_hang" and rank == 1:
            time.sleep(600)
        if name == "test_kill" and rank == 0:
            os._exit(3)
        if name == "test_kill":
            time.sleep(600)          # the others are taken down with the job
        if name == "test_fail" and rank == 1:
            status, reason = "failed", "AssertionError: 1 != 2"
        if name == "test_skip":
            status, reason = "skipped", "CUDA is not available."
        out.write(json.dumps({"test": name, "event": "end", "status": status, "reason": reason,
                              "seconds": 0.0}) + "\n")
        if name == "test_fail":
            out.close()
            os._exit(0)       # as the real one after a failure: the driver starts a new job
