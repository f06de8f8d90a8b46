"""Every command a user types works from the checkout: the entry points of the README and of
docs/explanation/architecture.md answer --help (and psrt.info runs as one process) with exit code 0."""
import os
import subprocess
import sys

import pytest
from conftest import ROOT

COMMANDS = [
    ([sys.executable, "-m", "psrt.train", "--help"], "usage: python -m psrt.train"),
    ([sys.executable, "-m", "psrt.cluster", "--help"], "usage: python -m psrt.cluster"),
    ([sys.executable, "-m", "psrt.bench", "--help"], "usage: python -m psrt.bench"),
    ([sys.executable, "-m", "psrt.bench", "pipeline", "--help"], "--t-forward"),
    ([sys.executable, "-m", "psrt.launch", "--help"], "usage: mpi_launch"),
    ([str(ROOT / "mpi_launch"), "--help"], "usage: mpi_launch"),
    ([sys.executable, "-m", "psrt.info"], "1 rank on 1 host"),
]


@pytest.mark.parametrize("argv,says", COMMANDS, ids=[" ".join(c[0][1:4]) for c in COMMANDS])
def test_command_works_from_the_checkout(argv, says):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_", "PMIX_", "PMI_"))}
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr[-2000:]
    assert says in out.stdout, out.stdout[-2000:]
