"""The pieces of psrt's fail-safe behaviour that need no MPI job: the call fingerprint, the
user's frame in an error line, the launcher's filtering of MPI's notices, finding a job's
processes, and the claims of docs/how-to/reliability.md each naming a test that exists."""
from __future__ import annotations

import os
import re
import subprocess
import time
import traceback
from pathlib import Path

import torch

from psrt import faults
from psrt.collectives.agreement import Agreement, fingerprint
from psrt.launch.mpi import descendants, drop_exit_banners

ROOT = Path(__file__).resolve().parents[2]
RULE = "-" * 74 + "\n"


def test_the_fingerprint_is_the_same_in_every_process():
    """Python's hash() of a string differs between processes (PYTHONHASHSEED); the agreement's
    fingerprint must not, or every call would be a mismatch: it is a fixed function of the
    signature's text (BLAKE2b), here its value for one signature."""
    sig = Agreement.signature(None, "allreduce", {"op": "sum", "dtype": torch.float32, "numel": 4})
    assert sig == ("allreduce", (("dtype", "torch.float32"), ("numel", "4"), ("op", "sum")))
    assert fingerprint(sig) == 1169396903225059445
    other = Agreement.signature(None, "allreduce", {"op": "sum", "dtype": torch.float32, "numel": 5})
    assert fingerprint(other) != fingerprint(sig)
    assert 0 < fingerprint(other) < 1 << 62     # -f fits an int64 for the MAX of (f, -f)


def _raise_in_torch():
    torch.nn.Linear(4, 4)(torch.ones(2, 3))      # torch raises in its own linear.py


def test_the_error_line_names_the_users_frame_then_torchs():
    try:
        _raise_in_torch()
    except RuntimeError as err:
        tb = traceback.extract_tb(err.__traceback__)
    line = next(f.lineno for f in tb if f.name == "_raise_in_torch")
    assert faults.location(tb) == (f" (test_failsafe.py:{line}, in torch/nn/modules/linear.py:"
                                   f"{tb[-1].lineno})")
    try:
        raise ValueError("in the user's own code")
    except ValueError as err:
        own = traceback.extract_tb(err.__traceback__)
    assert faults.location(own) == f" (test_failsafe.py:{own[-1].lineno})"
    assert faults.location([]) == ""


def test_open_mpis_abort_notice_and_daemon_lines_go_to_the_log():
    abort = [RULE, "MPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD\n",
             "with errorcode 1.\n", RULE]
    noise = ["[vm:10174] [[24342,0],0] ORTE_ERROR_LOG: Data unpack would read past end of buffer in file x\n",
             "[vm:10174] 1 more process has sent help message help-mpi-api.txt / mpi-abort\n",
             "[vm:10174] Set MCA parameter \"orte_base_help_aggregate\" to 0 to see all help / error messages\n"]
    killed = [RULE, "mpirun noticed that process rank 1 with PID 7 on node vm exited on signal 9 (Killed).\n", RULE]
    shown, kept = [], []
    drop_exit_banners(["[rank 1] psrt: error: boom\n"] + abort + noise + killed, shown.append, kept.append)
    assert "".join(shown) == "[rank 1] psrt: error: boom\n" + "".join(killed)
    assert "".join(kept) == "".join(abort + noise)


def test_descendants_finds_children_and_grandchildren():
    proc = subprocess.Popen(["bash", "-c", "sleep 30 & sleep 30 & wait"])
    try:
        for _ in range(100):
            found = descendants(proc.pid)
            if len(found) == 2:
                break
            time.sleep(0.05)
        assert len(found) == 2 and proc.pid in descendants(os.getpid())
        assert found <= descendants(os.getpid())
    finally:
        for pid in descendants(proc.pid) | {proc.pid}:
            os.kill(pid, 9)
        proc.wait()


def test_every_claim_of_the_reliability_doc_names_a_test_that_exists():
    text = (ROOT / "docs" / "how-to" / "reliability.md").read_text()
    table = text.split("| Promise |", 1)[1].split("\n\n", 1)[0]
    rows = [r for r in table.splitlines()[2:] if r.startswith("|")]
    assert len(rows) >= 10
    for row in rows:
        cited = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", row)
        assert cited, f"a promise without a test: {row}"
        for path, name in cited:
            source = (ROOT / path).read_text()
            assert re.search(rf"^def {name}\(", source, re.M), f"{path}::{name} does not exist"


def test_a_wait_on_a_crowded_machine_sleeps_sooner(monkeypatch):
    """Where ranks outnumber the cores, a rank waiting for a late peer polls briefly before it
    sleeps (the peer may need its core); with a core each it polls for a millisecond first."""
    from psrt.collectives import agreement

    class Late:
        tests = 0

        def Test(self):
            Late.tests += 1
            return False

    clock = iter(range(10**9))
    monkeypatch.setattr(agreement.time, "monotonic", lambda: next(clock) * 1e-6)   # 1 us a look

    class Slept(Exception):
        pass

    def polls_before_sleeping(crowd: float) -> int:
        Late.tests = 0
        monkeypatch.setattr(agreement.time, "sleep", lambda s: (_ for _ in ()).throw(Slept()))
        try:
            agreement.wait(Late(), agreement.spin_for(crowd))
        except Slept:
            return Late.tests
        raise AssertionError("never slept")

    crowded, spread = polls_before_sleeping(2.0), polls_before_sleeping(1.0)
    assert crowded * 10 < spread, (crowded, spread)
