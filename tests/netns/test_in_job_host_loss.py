"""In-job recovery from a lost *host*, end to end: `mpi_launch --emulate --in-job-recovery` under
Open MPI 5 with ULFM (PyPI's, scripts/with_mpi.sh) on two emulated hosts, 2 ranks on the first
and 1 on the second, `--dp ring`; the second host is lost after step 5 (psrt.cluster fail: its
link down, every process there killed).  No connection closes across a dead link: ULFM's
heartbeat detector (which --in-job-recovery turns on) finds rank 2 silent, the survivors revoke,
shrink and go on in the same job, and when they have finished mpi_launch ends the job, whose
runtime would wait for the lost host's daemon for ever.  The final parameters equal a run's
that never failed (same global batch)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from psrt.bench.recovery import _diff_to_reference, _env, _train_args
from psrt.launch.cluster import fail
from psrt.errors import IN_JOB_DONE
from test_cluster import needs_openmpi, netns
from test_growback import launched, two_hosts, wait_for

ROOT = Path(__file__).resolve().parents[2]
STEPS = 16


@netns
@pytest.mark.mpi
@needs_openmpi
def test_the_survivors_of_a_lost_host_carry_on_inside_the_job(tmp_path):
    names, subnet, hostfile = two_hosts(tmp_path, "j", (2, 1), 100)
    ckpt, final = tmp_path / "ckpt.pt", tmp_path / "final.pt"
    widths = Path(str(ckpt) + ".widths")
    # PSRT_TIMEOUT 20 s: ULFM's detector gives up on a silent rank after 4 s, well before the
    # watchdog; and these ranks start as fresh interpreters (Open MPI 5's environment), which
    # on a loaded machine stay silent for more than 8 s while torch's libraries load
    argv = ["bash", str(ROOT / "scripts" / "with_mpi.sh"), "openmpi5", "--", "python", "-m", "psrt.launch",
            "--emulate", "--in-job-recovery", "--hostfile", str(hostfile), "-np", "3", "--subnet", subnet,
            "python"] + _train_args("ring", STEPS, 48, 16) + [
            "--checkpoint", str(ckpt), "--checkpoint-every", "8", "--save", str(final),
            "--callback", "tests.mpi.ranks.paced_steps:Paced"]
    log = tmp_path / "launch.log"
    with launched(argv, _env(20.0), log, names, subnet) as proc:
        wait_for(widths, proc, lambda rows: any(s >= 5 for s, _ in rows), 180, "step 5 on 3 ranks")
        failed = time.monotonic()
        fail(names[1])
        wait_for(widths, proc, lambda rows: bool(rows) and rows[-1][1] == 2, 60, "the survivors training")
        took = time.monotonic() - failed
        code = proc.wait(timeout=120)
    said = log.read_text()
    assert code == 0, said
    assert "psrt.train: in-job recovery 1: rank 2 of 3 lost (MPI_ERR_PROC_FAILED); ring x2 continues" in said, said
    assert IN_JOB_DONE in said and "restart" not in said, said
    print(f"host lost after step 5; 2 ranks training again {took:.1f} s later")
    assert _diff_to_reference("ring", 2, STEPS, 48, 16, _env(20.0), final) <= 1e-5
