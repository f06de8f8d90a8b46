"""One rank of PyTorch's distributed test suite on the psrt backend (run by scripts/torch_suite.py).

The suite is `DistributedTest._DistTestBase` of the installed torch
(torch/testing/_internal/distributed/distributed_test.py).  It is run as PyTorch's own MPI
driver ran it (test/distributed/test_distributed_fork.py before PyTorch 1.9): every rank of one
mpirun job joins one default process group and runs the same tests in the same order, and the
suite's file barrier works in a TEMP_DIR that the ranks share.

The suite picks its tests at import time, and some of their code paths at run time, from the
environment variable BACKEND; it is told "gloo", so gloo's selection and CPU paths apply (the
CPU backend psrt stands in for).  The default group is psrt's, and so is every group the tests
make from it (`new_group` without a backend takes the default group's).  The tests that check
the name of the backend they run on see "psrt" (NAMES_ITS_BACKEND).

    python3 scripts/torch_suite_rank.py --list                  # JSON: each test, skipped why or null
    mpirun -np N python3 scripts/torch_suite_rank.py TEST...    # run them; TEMP_DIR/results.RANK
    ... --backend gloo                                          # the same on gloo, for reference

Each rank appends one JSON line per test to TEMP_DIR/results.<rank> ({"test", "event": "start"}
before it, {"test", "event": "end", "status", "reason"} after it), flushed at once, so the
driver sees which test a killed or wedged job was in.  After a test that failed on any rank the
job ends, and the driver starts a new one for the tests after it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback
import unittest
from datetime import timedelta

SUITE_BACKEND = "gloo"   # whose test selection applies

# Tests psrt does not run, and why (docs/how-to/torch_backend.md, "PyTorch's distributed test suite").
_MONITORED = ("torch.distributed.monitored_barrier runs only on a group whose backend is gloo "
              "(distributed_c10d.py raises ValueError for any other backend by name)")
PSRT_SKIPS: dict[str, str] = {
    f"test_monitored_barrier_{case}": _MONITORED
    for case in ("gloo", "gloo_subgroup", "allreduce_hang", "allreduce_hang_wait_all_ranks",
                 "gloo_rank_0_timeout", "failure_order", "wait_all_ranks")}

# Tests that leave gloo's default group broken by design (a rank stays out of a barrier that
# must time out; every later test then fails with "Application timeout caused pair closure"):
# on gloo each runs in a job of its own, as the suite's own runner gives every test fresh
# processes.  On psrt a call that timed out wedges only the group it ran on (a new_group).
ISOLATE = {"gloo": ("test_monitored_barrier_", "test_barrier_timeout_"), "psrt": ()}

# Tests that check the name of the backend they run on: for them the suite's BACKEND is "psrt".
# Every other test sees "gloo", so that its CPU code paths (`if BACKEND == "gloo"`) are gloo's.
NAMES_ITS_BACKEND = ("test_get_backend", "test_Backend_enum_class")


def _suite():
    """The suite's module, imported with gloo's test selection."""
    os.environ["BACKEND"] = SUITE_BACKEND
    from torch.testing._internal.distributed import distributed_test
    return distributed_test


def _static_skip(fn, backend: str) -> str | None:
    """The reason a test is skipped whatever the backend does (unittest's skip decorators,
    evaluated at import), or psrt's own reason on psrt; None when it runs."""
    if getattr(fn, "__unittest_skip__", False):
        return getattr(fn, "__unittest_skip_why__", "") or "skipped by the suite"
    if backend == "psrt" and fn.__name__ in PSRT_SKIPS:
        return "psrt: " + PSRT_SKIPS[fn.__name__]
    return None


def list_tests(backend: str = "psrt") -> list[dict]:
    base = _suite().DistributedTest._DistTestBase
    names = unittest.TestLoader().getTestCaseNames(base)
    return [{"test": n, "skip": _static_skip(getattr(base, n), backend), "isolate": n.startswith(ISOLATE[backend])}
            for n in names]


class _Result(unittest.TestResult):
    """unittest's result, where a test that leaves by sys.exit with one of the suite's skip
    codes (common_distributed.TEST_SKIPS: "no_cuda", "multi-gpu-N", ...) counts as skipped
    with that code's message, as the suite's own multi-process runner reads it."""

    def __init__(self, skips: dict[int, str]):
        super().__init__()
        self._skip_codes = skips

    def addError(self, test, err):
        if err[0] is SystemExit and err[1].code in self._skip_codes:
            self.addSkip(test, self._skip_codes[err[1].code])
            return
        super().addError(test, err)


def _last_error(text: str) -> str:
    """The exception line of a formatted traceback (its last line that names an exception)."""
    lines = [l for l in text.strip().splitlines() if re.match(r"^[\w.]+(Error|Exception|Exit|Interrupt)\b", l)]
    return (lines[-1] if lines else text.strip().splitlines()[-1])[:500]


def _outcome(result: _Result) -> tuple[str, str]:
    if result.skipped:
        return "skipped", result.skipped[0][1]
    bad = result.errors + result.failures
    if bad:
        return ("failed" if result.failures else "error"), _last_error(bad[0][1])
    if result.unexpectedSuccesses:
        return "failed", "unexpected success"
    return "passed", ""


def run_tests(names: list[str], backend: str = "psrt") -> int:
    import psrt.c10d  # noqa: F401 - registers "psrt" and joins MPI
    import torch.distributed as dist
    from mpi4py import MPI
    from torch.testing._internal.common_distributed import TEST_SKIPS
    from torch.testing._internal.common_utils import TestCase

    suite = _suite()
    base = suite.DistributedTest._DistTestBase
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=suite.default_pg_timeout))
    rank = dist.get_rank()
    init_method = suite.INIT_METHOD

    class PsrtSuite(TestCase, base):
        """The suite's tests as one MPI job's ranks run them (attributes its runner sets)."""
        world_size = os.environ["WORLD_SIZE"]
        file_name = None

        @property
        def init_method(self):
            return init_method

    skips = {s.exit_code: s.message for s in TEST_SKIPS.values()}
    out = open(os.path.join(os.environ["TEMP_DIR"], f"results.{rank}"), "a", buffering=1)
    # Lines up the ranks before each test on a communicator of the driver's own (the suite's
    # tests may leave the default group destroyed or re-made).
    sync = MPI.COMM_WORLD.Dup()
    for name in names:
        sync.Barrier()
        out.write(json.dumps({"test": name, "event": "start"}) + "\n")
        t0 = time.monotonic()
        suite.BACKEND = backend if name in NAMES_ITS_BACKEND else SUITE_BACKEND
        case = PsrtSuite(name)
        case.rank = rank
        result = _Result(skips)
        try:
            case.run(result)
            status, reason = _outcome(result)
        except BaseException as err:  # noqa: BLE001 - reported as the test's outcome
            status, reason = "error", "".join(traceback.format_exception_only(err)).strip()[:500]
        if not dist.is_initialized():
            # A test that destroyed the default group and did not make it again.
            dist.init_process_group(backend=backend, timeout=timedelta(seconds=suite.default_pg_timeout))
        out.write(json.dumps({"test": name, "event": "end", "status": status, "reason": reason,
                              "seconds": round(time.monotonic() - t0, 2)}) + "\n")
        if sync.allreduce(int(status in ("failed", "error")), op=MPI.MAX):
            # A test that failed may have left the default group broken: the driver goes on
            # with the next tests in a new job.
            out.close()
            os._exit(0)
    sync.Barrier()
    sync.Free()
    dist.destroy_process_group()
    out.close()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="print the suite's tests as JSON and exit")
    ap.add_argument("--backend", default="psrt", choices=("psrt", "gloo"),
                    help="the default group's backend (gloo: the reference run)")
    ap.add_argument("tests", nargs="*")
    args = ap.parse_args(argv)
    if args.list:
        print(json.dumps(list_tests(args.backend)))
        return 0
    return run_tests(args.tests, args.backend)


if __name__ == "__main__":
    sys.exit(main())
