"""A chaos campaign's schedule: which fault strikes which run, where and when, drawn from a seed.

As in Jepsen, the schedule is data: a list of `Trial`s made by `schedule(trials, seed, ...)`
before anything runs, printable (`describe`), the same for the same seed, and testable
without MPI.  `psrt.bench chaos` then runs each trial (psrt/bench/chaos.py).

Fault kinds, and how each is applied:

- `sigkill`: one rank SIGKILLed (PSRT_FAULT kill, psrt.faults.strike_if_asked);
- `sigstop`: one rank stopped longer than PSRT_TIMEOUT, then resumed (PSRT_FAULT stop): the
  others' watchdog finds it silent and ends the job, and its late messages must change nothing;
- `host-loss`: every process of an emulated host killed and its link down (psrt.cluster fail);
- `link-cut`: an emulated host's link drops every packet it sends (a blackhole qdisc; netem
  loss 100% where the kernel has sch_netem) for a while, then
  carries them again;
- `enospc`: the file system of the checkpoints filled up (a small tmpfs), then emptied again.

Moments: `step` (before a training step), `checkpoint` (half-way through a checkpoint write),
`evaluation` (the final evaluation), `gather` (the final gather), and `recovery` (a second
SIGKILL while a restart loads its checkpoint, after a first SIGKILL at a step).
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass

KINDS = ("sigkill", "sigstop", "host-loss", "link-cut", "enospc")
MOMENTS = ("step", "checkpoint", "evaluation", "gather", "recovery")
STRATEGIES = ("ring", "zero1", "zero3", "ps", "ps-sharded", "pp2")
MODES = ("restarts", "in-job")
# Where each kind can strike: host loss and link cut come from outside the ranks, when the run
# has reached a step; a full disk shows at the next checkpoint write.
KIND_MOMENTS = {"sigkill": MOMENTS, "sigstop": ("step", "checkpoint", "evaluation", "gather"),
                "host-loss": ("step",), "link-cut": ("step",), "enospc": ("checkpoint",)}
# Kinds that need emulated hosts (root, network namespaces): the run shrinks to the survivors,
# which a --pp 2 grid on two ranks cannot.
ON_HOSTS = ("host-loss", "link-cut")
# In-job recovery (ULFM, Open MPI 5) serves a rank lost in a training step, for these strategies
# (psrt.train.in_job: FULL_REPLICA + FROM_CHECKPOINT): one killed, or every rank of a lost host
# (ULFM's heartbeat detector finds them silent).
IN_JOB_STRATEGIES = ("ring", "zero1", "zero3", "ps", "ps-sharded")
IN_JOB_KINDS = ("sigkill", "host-loss")
# In-job trials run three ranks (the survivors are a group of two); with emulated hosts, two
# ranks on the first host and one on the second, which is the host lost: rank 2's.
IN_JOB_RANKS, IN_JOB_LOST_RANK = 3, 2


@dataclass(frozen=True)
class Trial:
    index: int
    kind: str
    moment: str
    mode: str
    strategy: str
    rank: int           # the rank struck (host-loss, link-cut: the host of that rank)
    step: int           # the step it strikes before (checkpoint: whose write; else when reached)
    seconds: float      # how long a stop, a cut or a full disk lasts (0: for good)

    def describe(self) -> str:
        last = f" for {self.seconds:g} s" if self.seconds else ""
        second = " (a second sigkill while the restart loads)" if self.moment == "recovery" else ""
        return (f"trial {self.index}: {self.kind} of rank {self.rank} at {self.moment} {self.step}{last}"
                f"{second}, {self.strategy}, {self.mode}")

    def row(self) -> dict:
        return asdict(self)


def applies(kind: str, moment: str, mode: str, strategy: str) -> bool:
    """Whether psrt is meant to survive this combination (and so whether a trial tries it)."""
    if moment not in KIND_MOMENTS[kind]:
        return False
    if mode == "in-job":
        # ULFM reports a dead peer; a stopped one, a full disk or a fault outside a step is not one
        return kind in IN_JOB_KINDS and moment == "step" and strategy in IN_JOB_STRATEGIES
    return not (strategy == "pp2" and kind in ON_HOSTS)


def schedule(trials: int, seed: int, steps: int, every: int, timeout_s: float,
             strategies=STRATEGIES, modes=MODES, kinds=KINDS) -> list[Trial]:
    """`trials` trials drawn from random.Random(seed): first one of each kind and each moment
    (so a campaign as short as max(kinds, moments) covers all of them), then any combination
    that applies.  A fault at a step strikes after the first checkpoint (every `every` steps)
    and before the last step of `steps`; a stop, a cut and a full disk last longer than
    `timeout_s`, so that the job sees them."""
    if trials < 1 or steps < 2 * every + 1 or every < 1:
        raise ValueError("need trials >= 1 and steps > 2 * every >= 2")
    rng = random.Random(seed)
    combos = [(k, m, mode, s) for k in kinds for m in MOMENTS for mode in modes for s in strategies
              if applies(k, m, mode, s)]
    if not combos:
        raise ValueError("no fault applies to these strategies and modes")
    wanted = [("kind", k) for k in kinds] + [("moment", m) for m in MOMENTS]
    out: list[Trial] = []
    for i in range(trials):
        pool = combos
        while wanted:
            what, value = wanted.pop(0)
            fits = [c for c in combos if c[0 if what == "kind" else 1] == value]
            seen = {(t.kind if what == "kind" else t.moment) for t in out}
            if fits and value not in seen:
                pool = fits
                break
        kind, moment, mode, strategy = rng.choice(pool)
        if moment in ("step", "recovery"):
            step = rng.randrange(every + 1, steps)
        elif moment == "checkpoint":    # one checkpoint before it, to be kept
            step = every * rng.randrange(2, (steps - 1) // every + 1)
        else:
            step = steps
        # A full disk stays full until the run on it has ended; rank 0 writes the checkpoints.
        seconds = round(timeout_s * rng.uniform(1.5, 2.5), 1) if kind in ("sigstop", "link-cut") else 0.0
        rank = rng.randrange(2)
        if mode == "in-job" and kind in ON_HOSTS:
            rank = IN_JOB_LOST_RANK
        out.append(Trial(i, kind, moment, mode, strategy, rank=0 if kind == "enospc" else rank, step=step,
                         seconds=seconds))
    return out
