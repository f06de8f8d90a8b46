"""Rank-side: `python -m psrt.train` that freezes right after its Nth checkpoint is on disk.

    fault_ckpt.py SAVES MARKER [TAG] -- TRAIN ARGS...
After checkpoint number SAVES has been written, rank 0 creates MARKER and sleeps; the test
then SIGKILLs every process of the job, so nothing after that checkpoint reaches the disk.
"""
import sys
import time

from psrt.train import checkpoint
from psrt.train import __main__ as train

saves, marker = int(sys.argv[1]), sys.argv[2]
argv = sys.argv[sys.argv.index("--") + 1:]
written = 0
original = checkpoint.save


def save(path, ctl, *args, **kwargs):
    global written
    original(path, ctl, *args, **kwargs)
    written += 1
    if written == saves and ctl.rank == 0:
        with open(marker, "w") as f:
            f.write(str(args[1]))          # the step it holds
        time.sleep(600)                    # killed here; the other ranks wait in a collective


checkpoint.save = save
sys.exit(train.main(argv))
