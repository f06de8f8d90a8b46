"""psrt.env: every PSRT_* variable is read, parsed and refused in one place, and the reference's
table of variables is the one env.py generates."""
import re
from pathlib import Path

import pytest

from psrt import env
from psrt.errors import PsrtError

ROOT = Path(__file__).resolve().parents[2]

GOOD = {"PSRT_TIMEOUT": ("12.5", 12.5), "PSRT_CHECK": ("all", "all"), "PSRT_CUDA_AWARE": ("0", False),
        "PSRT_STAGED_REDUCE": ("gpu", "gpu"),
        "PSRT_TUNING": ("t.json", "t.json"), "PSRT_RING_SEGMENT": ("65536", 65536),
        "PSRT_MASTER_ADDR": ("198.18.0.1", "198.18.0.1"), "PSRT_TRACEBACK": ("1", True),
        "PSRT_YIELD": ("0", False), "PSRT_ALGORITHM": ("ps", "ps"), "PSRT_HOSTS": ("0,0,1", (0, 0, 1)),
        "PSRT_MPI_LOG": ("/tmp/psrt-logs-0/j/mpi.log", "/tmp/psrt-logs-0/j/mpi.log"),
        "PSRT_LOG_DIR": ("/var/tmp/psrt-logs", "/var/tmp/psrt-logs"), "PSRT_RESTARTS": ("2", 2),
        "PSRT_RESTART_COUNT": ("1", 1), "PSRT_FAILED_AT": ("1795685427.96", 1795685427.96),
        "PSRT_IN_JOB_RECOVERY": ("1", True), "PSRT_GROW_BACK_S": ("0.5", 0.5),
        "PSRT_GROW_FILE": ("/tmp/psrt-grow-back-x/request", "/tmp/psrt-grow-back-x/request"), "PSRT_KILL_AT": ("2,3:31", ((2, 3), 31)),
        "PSRT_FAULT": ("kill:1:checkpoint:6;stop:0,2:step:3:7.5@1",
                       (("kill", (1,), "checkpoint", 6, 0.0, 0), ("stop", (0, 2), "step", 3, 7.5, 1)))}
BAD = {"PSRT_TIMEOUT": ["-3", "0", "soon", "inf"], "PSRT_CHECK": ["most"], "PSRT_CUDA_AWARE": ["yes", "2"],
       "PSRT_STAGED_REDUCE": ["device", "GPU"],
       "PSRT_RING_SEGMENT": ["0", "4MiB", "-1"], "PSRT_TRACEBACK": ["true"],
       "PSRT_YIELD": ["yes"], "PSRT_ALGORITHM": ["torch", "fast"], "PSRT_HOSTS": ["0,a", "1;2", "-1"],
       "PSRT_RESTARTS": ["-1", "two"], "PSRT_RESTART_COUNT": ["-1"], "PSRT_FAILED_AT": ["soon"],
       "PSRT_IN_JOB_RECOVERY": ["yes"], "PSRT_GROW_BACK_S": ["-1", "often", "inf"], "PSRT_KILL_AT": ["2", "a:1", "1:0", ":4"],
       "PSRT_FAULT": ["kill:1:step", "burn:1:step:3", "kill:1:lunch:3", "kill:x:step:3", "stop:1:step:3:0",
                      "kill:1:step:3@", "kill:1:step:-1"]}


def test_every_variable_is_covered_here():
    assert set(GOOD) == set(env.VARIABLES)


@pytest.mark.parametrize("name", sorted(GOOD))
def test_values_parse_and_defaults_hold(name):
    text, value = GOOD[name]
    assert env.get(name, {name: text}) == value
    assert env.get(name, {}) == env.VARIABLES[name].default


@pytest.mark.parametrize("name,text", [(n, t) for n, texts in BAD.items() for t in texts])
def test_bad_values_are_one_line_errors_naming_the_variable(name, text):
    with pytest.raises(PsrtError) as err:
        env.check_all({name: text})
    message = str(err.value)
    assert message.startswith(f"{name}={text!r}: expected") and "\n" not in message


def test_accessors_read_the_process_environment(monkeypatch):
    monkeypatch.setenv("PSRT_TIMEOUT", "7")
    monkeypatch.setenv("PSRT_RING_SEGMENT", "1024")
    assert env.timeout_s() == 7.0 and env.ring_segment_bytes() == 1024


def test_the_reference_lists_exactly_these_variables():
    assert env.markdown_table() in (ROOT / "docs" / "reference" / "env.md").read_text()


def test_no_module_but_env_reads_a_psrt_variable():
    """PSRT_* settings are read in env.py only (the launcher forwards them untouched)."""
    readers = []
    for path in (ROOT / "psrt").rglob("*.py"):
        if path.name == "env.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"""(environ\.get\(|environ\[|getenv\()\s*["']PSRT_""", line):
                readers.append(f"{path.relative_to(ROOT)}:{i}")
    assert not readers, readers


def test_backend_algorithms_are_psrts_own_less_torch():
    from psrt.collectives.algorithms import ALGORITHMS, THROUGH_TORCH
    # the all-reduce algorithms name a group's algorithm; all-to-all's pairwise is chosen per call
    assert set(env.BACKEND_ALGORITHMS) == {"auto"} | set(ALGORITHMS["allreduce"]) - set(THROUGH_TORCH)
