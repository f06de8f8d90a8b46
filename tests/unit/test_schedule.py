"""Pipeline schedules and partitioning as data: no MPI, no tensors (except split_batch)."""
import itertools

import pytest
import torch

from psrt.errors import PsrtError
from psrt.pp import partition as P
from psrt.pp import schedule as S
from psrt.pp.schedule import Action, Schedule


def in_flight(acts) -> int:
    """Largest number of micro-batches between their F and their B on one rank."""
    live = peak = 0
    for a in acts:
        live += 1 if a.op == "F" else -1
        peak = max(peak, live)
    return peak


def test_action_string_form_round_trips():
    assert str(Action(1, "F", 0)) == "1F0"
    assert Action.parse("12B3") == Action(12, "B", 3)
    for bad in ("1X0", "F0", "1F", ""):
        with pytest.raises(PsrtError):
            Action.parse(bad)


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)])
def test_every_schedule_is_valid_for_many_sizes(name, v):
    for p, m in itertools.product(range(1, 7), range(1, 14)):
        s = S.make_schedule(name, p, m, v)          # make_schedule() validates (completeness + deadlock simulation)
        assert s.num_stages == p * v and len(s.actions) == p
        assert sum(len(a) for a in s.actions) == 2 * p * v * m


def test_gpipe_table():
    assert S.table(S.make_schedule("gpipe", 3, 3)) == "\n".join([
        "time     0   1   2   3   4   5   6   7   8   9",
        "rank 0 0F0 0F1 0F2   .   .   .   . 0B0 0B1 0B2",
        "rank 1   . 1F0 1F1 1F2   .   . 1B0 1B1 1B2   .",
        "rank 2   .   . 2F0 2F1 2F2 2B0 2B1 2B2   .   .",
    ])


def test_1f1b_actions_and_memory():
    s = S.make_schedule("1f1b", 4, 6)
    assert " ".join(map(str, s.actions[0])) == "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0B3 0B4 0B5"
    assert " ".join(map(str, s.actions[3])) == "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5"
    for p, m in itertools.product(range(1, 6), range(1, 10)):
        one, gp = S.make_schedule("1f1b", p, m), S.make_schedule("gpipe", p, m)
        for r in range(p):
            # 1F1B holds at most p - r micro-batches on rank r; GPipe holds all m.
            assert in_flight(one.actions[r]) == min(p - r, m)
            assert in_flight(gp.actions[r]) == m


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (3, 9)])
def test_simulated_bubble_matches_theory(p, m):
    # Backward twice the forward, as in the papers' analyses; the theory holds for any ratio.
    want = (p - 1) / (m + p - 1)
    assert S.bubble_fraction(S.make_schedule("gpipe", p, m)) == pytest.approx(want)
    assert S.bubble_fraction(S.make_schedule("1f1b", p, m)) == pytest.approx(want)
    for v in (2, 3):   # Narayanan et al. 2021: bubble / ideal time = (p-1) / (v m)
        assert S.bubble_fraction(S.make_schedule("interleaved", p, m, v)) == pytest.approx((p - 1) / (v * m + p - 1))


def test_interleaved_places_stages_round_robin_and_orders_chunks():
    s = S.make_schedule("interleaved", 2, 4, 2)
    assert s.stages_of(0) == [0, 2] and s.stages_of(1) == [1, 3] and s.rank_of(3) == 1
    assert " ".join(map(str, s.actions[0][:4])) == "0F0 0F1 2F0 2F1"
    # A short last group (m % p != 0) with 3 chunks deadlocks with Megatron's warm-up alone;
    # the lengthened warm-up makes it run (make_schedule() would raise otherwise).
    p, m, v = 4, 5, 3
    megatron = Schedule("interleaved", p, p * v, m, tuple(
        S._interleaved_ranks(p, m, v, r, min(2 * (p - r - 1) + (v - 1) * p, m * v)) for r in range(p)))
    with pytest.raises(PsrtError, match="deadlocks"):
        S.validate(megatron)
    S.make_schedule("interleaved", p, m, v)


def _sched(rows, p=2, m=2, stages=2, name="hand"):
    return Schedule(name, p, stages, m, tuple(tuple(map(Action.parse, r.split())) for r in rows))


@pytest.mark.parametrize("rows,msg", [
    (["0F0 0F1 0B0 0B1", "1F0 1B0 1F1"], "missing 1B1"),
    (["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1 1B1"], "appears twice"),
    (["0F0 0F1 0B0 0B1", "1B0 1F0 1F1 1B1"], "runs 1B0 before 1F0"),
    (["0F0 0F1 0B0 0B1 1F0", "1B0 1F1 1B1"], "1F0 is on rank 0, but stage 1 lives on rank 1"),
    (["0F0 0F1 0B0 0B1", "1F0 1B0 1F2 1B1"], "outside 2 stages x 2 micro-batches"),
    (["0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1"],
     "deadlocks: rank 0 at 0B0 waits for 1B0; rank 1 at 1F1 waits for 0F1"),
])
def test_validator_rejects(rows, msg):
    with pytest.raises(PsrtError, match=msg):
        S.validate(_sched(rows))


def test_make_rejects_bad_requests():
    with pytest.raises(PsrtError, match="unknown pipeline schedule"):
        S.make_schedule("zigzag", 2, 2)
    with pytest.raises(PsrtError, match="needs the 'interleaved' schedule"):
        S.make_schedule("1f1b", 2, 2, virtual_stages=2)
    with pytest.raises(PsrtError, match="at least one"):
        S.make_schedule("gpipe", 2, 0)


def test_balanced_splits_are_optimal():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        k = int(torch.randint(1, n + 1, (1,), generator=gen))
        costs = torch.randint(0, 20, (n,), generator=gen).tolist()
        best = min(max(sum(costs[a:b]) for a, b in zip((0,) + cut, cut + (n,)))
                   for cut in itertools.combinations(range(1, n), k - 1))
        got = P.stage_ranges(n, k, costs=costs)
        assert len(got) == k and all(len(r) for r in got)
        assert max(sum(costs[i] for i in r) for r in got) == best


def test_explicit_splits_and_errors():
    assert P.stage_ranges(5, 3, splits=[1, 4]) == [range(0, 1), range(1, 4), range(4, 5)]
    for bad in ([0, 4], [4, 1], [1], [1, 5]):
        with pytest.raises(PsrtError, match="do not cut 5 blocks into 3"):
            P.stage_ranges(5, 3, splits=bad)
    with pytest.raises(PsrtError, match="cannot split 2 blocks into 3"):
        P.balanced_splits([1, 1], 3)


def test_split_batch_weights_give_the_whole_batch_mean():
    x, y = torch.arange(7.0).unsqueeze(1), torch.arange(7.0)
    xs, ys, w = P.split_batch(x, y, 3)
    assert [len(t) for t in xs] == [3, 2, 2] and sum(w) == pytest.approx(1.0)
    assert sum(wi * t.mean() for wi, t in zip(w, ys)) == pytest.approx(y.mean())
    with pytest.raises(PsrtError, match="cannot split a batch of 7 samples into 8"):
        P.split_batch(x, y, 8)
