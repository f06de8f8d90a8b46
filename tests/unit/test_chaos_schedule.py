"""The chaos campaign's schedule (psrt/bench/nemesis.py) is data drawn from a seed, and
PSRT_FAULT (psrt.faults.strike_if_asked) strikes exactly the rank, moment and start it names."""
import signal

import pytest

from psrt import faults
from psrt.bench.nemesis import KINDS, MOMENTS, STRATEGIES, applies, schedule


def test_the_same_seed_draws_the_same_schedule_and_another_seed_another():
    a = schedule(20, seed=7, steps=12, every=3, timeout_s=4.0, modes=("restarts",))
    assert a == schedule(20, seed=7, steps=12, every=3, timeout_s=4.0, modes=("restarts",))
    assert a != schedule(20, seed=8, steps=12, every=3, timeout_s=4.0, modes=("restarts",))
    assert [t.describe() for t in a][0].startswith("trial 0: ")


@pytest.mark.parametrize("seed", range(10))
def test_eight_trials_cover_every_kind_and_moment_and_each_applies(seed):
    trials = schedule(8, seed, steps=12, every=3, timeout_s=4.0, modes=("restarts",))
    assert {t.kind for t in trials} == set(KINDS)
    assert {t.moment for t in trials} == set(MOMENTS)
    for t in trials:
        assert applies(t.kind, t.moment, t.mode, t.strategy), t
        assert t.strategy in STRATEGIES and t.rank in (0, 1)
        if t.moment in ("step", "recovery"):
            assert 3 < t.step < 12, t            # after the first checkpoint, before the end
        if t.moment == "checkpoint":
            assert t.step % 3 == 0 and 6 <= t.step < 12, t   # a checkpoint before it, to be kept
        if t.kind in ("sigstop", "link-cut"):
            assert t.seconds > 4.0, t             # longer than the timeout: the job must see it


def test_what_cannot_apply_is_never_drawn():
    assert not applies("host-loss", "step", "restarts", "pp2")      # 2 -> 1 rank: no pp2 grid
    assert not applies("enospc", "step", "restarts", "ring")
    assert not applies("sigstop", "step", "in-job", "ring")         # ULFM sees a dead peer only
    assert applies("sigkill", "step", "in-job", "zero3")
    assert applies("host-loss", "step", "in-job", "ps")              # ULFM's detector finds the host's ranks silent
    assert not applies("link-cut", "step", "in-job", "ring")
    trials = schedule(50, 3, steps=12, every=3, timeout_s=4.0, strategies=("pp2",), modes=("restarts",))
    assert not {t.kind for t in trials} & {"host-loss", "link-cut"}
    with pytest.raises(ValueError):
        schedule(8, 1, steps=5, every=3, timeout_s=4.0)


def test_an_in_job_host_loss_takes_the_host_of_the_third_rank():
    """In-job trials run 3 ranks, 2 + 1 on two emulated hosts: the host lost is the second,
    so that two survivors go on."""
    trials = schedule(40, 2, steps=12, every=3, timeout_s=4.0, modes=("in-job",))
    assert {t.kind for t in trials} == {"sigkill", "host-loss"} and {t.moment for t in trials} == {"step"}
    assert {t.rank for t in trials if t.kind == "host-loss"} == {2}
    assert {t.rank for t in trials if t.kind == "sigkill"} <= {0, 1}
    only = schedule(3, 2, steps=12, every=3, timeout_s=4.0, modes=("in-job",), kinds=("host-loss",))
    assert [t.kind for t in only] == ["host-loss"] * 3


@pytest.fixture
def struck(monkeypatch):
    """Signals this process would have sent itself, instead of sending them."""
    sent = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: sent.append(sig))
    monkeypatch.setattr(faults.subprocess, "Popen", lambda *a, **k: sent.append("resumer"))
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.delenv("PSRT_RESTART_COUNT", raising=False)
    return sent


def test_a_fault_strikes_only_its_rank_moment_step_and_start(struck, monkeypatch):
    monkeypatch.setenv("PSRT_FAULT", "kill:1:checkpoint:6;kill:0:step:3;stop:1:gather:0:9@1")
    faults.strike_if_asked("checkpoint", 3)
    faults.strike_if_asked("step", 3)        # rank 0's
    faults.strike_if_asked("gather", 12)     # start 1's
    assert struck == []
    faults.strike_if_asked("checkpoint", 6)
    assert struck == [signal.SIGKILL]
    monkeypatch.setenv("PSRT_RESTART_COUNT", "1")
    struck.clear()
    faults.strike_if_asked("checkpoint", 6)  # start 0's only
    faults.strike_if_asked("gather", 12)
    assert struck == ["resumer", signal.SIGSTOP]   # SIGCONT comes from a process of its own
