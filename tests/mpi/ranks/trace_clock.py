"""Rank side of tests/mpi/test_trace.py's clock test: every rank but 0 times its spans on a
clock that is far off (rank r: r x 1000 s behind), all leave a barrier together and record a
0.1 s span, and the timeline is written to argv[1].  Corrected, the spans line up."""
import sys
import time

import psrt
from psrt.trace import Tracer

world = psrt.init()
skew = world.rank * 1000 * 10**9
tracer = Tracer(clock=lambda: time.perf_counter_ns() - skew)
for _ in range(2):                 # the second pass: the ranks are warm and in step
    world.comm.Barrier()
with tracer.span("together", "wait"):
    time.sleep(0.1)
tracer.write(world.comm, sys.argv[1], world.hostname)
