"""Pipeline schedules as data: one list of actions per pipeline rank.

A schedule says, for each rank, the order in which it runs the forward (F) and backward (B)
pass of each (stage, micro-batch).  It holds no tensors and no MPI: `validate` checks it by
simulation and `table` draws it, so every schedule is tested in one process.  The runtime
(psrt/pp/runtime.py) executes the same lists.

Stage placement: stage s lives on pipeline rank s % p.  With one stage per rank this is the
identity; with v virtual stages per rank (interleaving) rank r holds stages r, r+p, ..., the
"looping" placement of Narayanan et al., "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM", SC 2021, sec. 2.2.2.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from psrt.errors import PsrtError

SCHEDULES = ("gpipe", "1f1b", "interleaved")
_ACTION = re.compile(r"^(\d+)([FB])(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    """Run the forward ("F") or backward ("B") pass of `stage` on `microbatch`."""

    stage: int
    op: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.op}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """"1F0" -> Action(1, "F", 0)."""
        m = _ACTION.match(text.strip())
        if not m:
            raise PsrtError(f"cannot read action {text!r}: expected STAGE F|B MICROBATCH, e.g. 1F0")
        return cls(int(m.group(1)), m.group(2), int(m.group(3)))


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists for `num_stages` stages on `num_ranks` ranks."""

    name: str
    num_ranks: int
    num_stages: int
    num_microbatches: int
    actions: tuple  # tuple (one per rank) of tuples of Action

    @property
    def virtual_stages(self) -> int:
        return self.num_stages // self.num_ranks

    def rank_of(self, stage: int) -> int:
        return stage % self.num_ranks

    def stages_of(self, rank: int) -> list[int]:
        return list(range(rank, self.num_stages, self.num_ranks))

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(map(str, a)) for r, a in enumerate(self.actions))


def _check_sizes(p: int, m: int, v: int = 1) -> None:
    if p < 1 or m < 1 or v < 1:
        raise PsrtError(f"a schedule needs at least one rank, micro-batch and stage per rank "
                        f"(got ranks={p}, microbatches={m}, virtual_stages={v})")


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """All forwards, then all backwards (Huang et al., "GPipe", NeurIPS 2019, sec. 2.2).

    Every micro-batch's activations stay alive until its backward: peak memory grows with m.
    """
    p, m = num_ranks, num_microbatches
    _check_sizes(p, m)
    acts = tuple(tuple([Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)])
                 for r in range(p))
    return Schedule("gpipe", p, p, m, acts)


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush): p-r-1 warm-up forwards, then alternate one forward and one
    backward, then drain the backwards (Narayanan et al., "PipeDream", SOSP 2019; the
    flushed variant of Megatron-LM 2021, sec. 2.2.1).  Same bubble as GPipe, but rank r holds
    at most p-r micro-batches' activations instead of m.
    """
    p, m = num_ranks, num_microbatches
    _check_sizes(p, m)
    acts = []
    for r in range(p):
        warm = min(p - r - 1, m)
        seq = [Action(r, "F", i) for i in range(warm)]
        for i in range(m - warm):
            seq += [Action(r, "F", warm + i), Action(r, "B", i)]
        seq += [Action(r, "B", i) for i in range(m - warm, m)]
        acts.append(tuple(seq))
    return Schedule("1f1b", p, p, m, tuple(acts))


def _interleaved_unit(k: int, p: int, v: int, m: int, backward: bool) -> tuple[int, int]:
    """(chunk, microbatch) of the k-th forward (or backward) unit on a rank.

    Micro-batches go in groups of p: a group runs through chunk 0, then chunk 1, ... (the
    order of Megatron-LM's interleaved schedule); a last group smaller than p (m % p != 0)
    cycles through the chunks with its own size.  Backwards visit the chunks in reverse.
    """
    group = k // (p * v)
    size = min(p, m - group * p)
    inner = k - group * p * v
    chunk, mb = inner // size, group * p + inner % size
    return (v - 1 - chunk if backward else chunk), mb


def interleaved(num_ranks: int, num_microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Interleaved 1F1B: v model chunks per rank, p*v stages (Narayanan et al. 2021, sec. 2.2.2).

    Each rank does smaller pieces of work, so the pipeline fills v times faster: the bubble
    shrinks by a factor v, for v times as many point-to-point messages.  Warm-up length per
    rank follows Megatron-LM: 2(p-r-1) + (v-1)p forward units (all of them if fewer).  When
    the last group of micro-batches is short (m % p != 0, m > p) that warm-up can deadlock;
    the ranks found waiting on a backward then warm up one unit longer, until the
    simulation runs through (all-forwards-first always does, so this ends).
    """
    p, m, v = num_ranks, num_microbatches, virtual_stages
    _check_sizes(p, m, v)
    total = m * v
    warm = [min(2 * (p - r - 1) + (v - 1) * p, total) for r in range(p)]
    while True:
        sched = Schedule("interleaved", p, p * v, m,
                         tuple(_interleaved_ranks(p, m, v, r, warm[r]) for r in range(p)))
        stuck = _run(sched)[1]
        late = [r for r, a in stuck.items() if a.op == "B" and warm[r] < total]
        if not stuck or not late:
            return sched
        for r in late:
            warm[r] += 1


def _interleaved_ranks(p: int, m: int, v: int, r: int, warm: int) -> tuple:
    total = m * v

    def act(k: int, op: str) -> Action:
        chunk, mb = _interleaved_unit(k, p, v, m, op == "B")
        return Action(chunk * p + r, op, mb)
    seq = [act(k, "F") for k in range(warm)]
    for k in range(total - warm):
        seq += [act(warm + k, "F"), act(k, "B")]
    seq += [act(k, "B") for k in range(total - warm, total)]
    return tuple(seq)


def make_schedule(name: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Build a schedule by name ('gpipe', '1f1b', 'interleaved') and check it."""
    if name not in SCHEDULES:
        raise PsrtError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}",
                        everywhere=True)
    if name != "interleaved" and virtual_stages != 1:
        raise PsrtError(f"schedule {name!r} runs one stage per rank; virtual_stages="
                        f"{virtual_stages} needs the 'interleaved' schedule", everywhere=True)
    if name == "gpipe":
        sched = gpipe(num_ranks, num_microbatches)
    elif name == "1f1b":
        sched = one_f_one_b(num_ranks, num_microbatches)
    else:
        sched = interleaved(num_ranks, num_microbatches, virtual_stages)
    validate(sched)
    return sched


# ---------------------------------------------------------------- checking and drawing
def _needs(a: Action, last_stage: int) -> Action | None:
    """The action on a neighbouring stage whose message `a` waits for (None: no message)."""
    if a.op == "F":
        return Action(a.stage - 1, "F", a.microbatch) if a.stage > 0 else None
    return Action(a.stage + 1, "B", a.microbatch) if a.stage < last_stage else None


def validate(s: Schedule) -> None:
    """Raise PsrtError unless the schedule is complete, well placed and deadlock-free.

    Complete: each of stages x {F, B} x micro-batches appears exactly once, on the rank that
    holds the stage, and each F comes before its B in that rank's list.  Deadlock-free:
    `simulate` runs all ranks with blocking receives and non-blocking (buffered) sends and
    must finish.
    """
    if len(s.actions) != s.num_ranks:
        raise PsrtError(f"schedule {s.name}: {len(s.actions)} action lists for {s.num_ranks} ranks")
    want = {Action(st, op, i) for st in range(s.num_stages) for op in "FB"
            for i in range(s.num_microbatches)}
    seen: dict[Action, int] = {}
    for r, acts in enumerate(s.actions):
        for pos, a in enumerate(acts):
            if a not in want:
                raise PsrtError(f"schedule {s.name}: rank {r} has {a}, which is outside "
                                f"{s.num_stages} stages x {s.num_microbatches} micro-batches")
            if a in seen:
                raise PsrtError(f"schedule {s.name}: {a} appears twice (rank {r})")
            if s.rank_of(a.stage) != r:
                raise PsrtError(f"schedule {s.name}: {a} is on rank {r}, but stage {a.stage} "
                                f"lives on rank {s.rank_of(a.stage)}")
            if a.op == "B" and Action(a.stage, "F", a.microbatch) not in seen:
                raise PsrtError(f"schedule {s.name}: rank {r} runs {a} before "
                                f"{Action(a.stage, 'F', a.microbatch)}")
            seen[a] = pos
    missing = sorted(want - set(seen))
    if missing:
        raise PsrtError(f"schedule {s.name}: missing {' '.join(map(str, missing[:8]))}"
                        f"{' ...' if len(missing) > 8 else ''}")
    simulate(s)


def _run(s: Schedule, f_time: float = 1.0, b_time: float = 1.0):
    """(action -> (start, end), {rank: action it is stuck at}) on an ideal machine."""
    last = s.num_stages - 1
    done: dict[Action, tuple[float, float]] = {}
    pos = [0] * s.num_ranks
    free = [0.0] * s.num_ranks
    moved = True
    while moved:
        moved = False
        for r, acts in enumerate(s.actions):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                need = _needs(a, last)
                if need is not None and need not in done:
                    break
                start = max(free[r], done[need][1] if need is not None else 0.0)
                free[r] = start + (f_time if a.op == "F" else b_time)
                done[a] = (start, free[r])
                pos[r] += 1
                moved = True
    stuck = {r: acts[pos[r]] for r, acts in enumerate(s.actions) if pos[r] < len(acts)}
    return done, stuck


def simulate(s: Schedule, f_time: float = 1.0, b_time: float = 1.0) -> dict[Action, tuple[float, float]]:
    """Run the schedule on an ideal machine: action -> (start, end).

    Each rank runs its list in order; an action starts when the rank is free and the message
    it needs has arrived (sends never block, communication takes no time).  A state where no
    rank can move is a deadlock and raises PsrtError naming what each rank waits for.
    """
    done, stuck = _run(s, f_time, b_time)
    if stuck:
        last = s.num_stages - 1
        waits = "; ".join(f"rank {r} at {a} waits for {_needs(a, last)}" for r, a in stuck.items())
        raise PsrtError(f"schedule {s.name} deadlocks: {waits}")
    return done


def bubble_fraction(s: Schedule, f_time: float = 1.0, b_time: float = 2.0) -> float:
    """Idle share of the ranks' time in the simulated schedule (work of a stage scaled by 1/v)."""
    scale = 1.0 / s.virtual_stages
    times = simulate(s, f_time * scale, b_time * scale)
    makespan = max(end for _, end in times.values())
    busy = sum(end - start for start, end in times.values())
    return 1.0 - busy / (makespan * s.num_ranks)


def table(s: Schedule, f_time: int = 1, b_time: int = 1) -> str:
    """The rank x time table of the simulated schedule; '.' marks an idle slot."""
    times = simulate(s, f_time, b_time)
    makespan = int(max(end for _, end in times.values()))
    grid = [["."] * makespan for _ in range(s.num_ranks)]
    for a, (start, end) in times.items():
        for t in range(int(start), int(end)):
            grid[s.rank_of(a.stage)][t] = str(a)
    width = max(len(c) for row in grid for c in row)
    head = "time   " + " ".join(f"{t:>{width}}" for t in range(makespan))
    rows = [f"rank {r:<2}" + " ".join(f"{c:>{width}}" for c in row) for r, row in enumerate(grid)]
    return "\n".join([head] + rows)
