"""A benchmark's goal: a ratio of a measured row to a named peer row of the same run, a
threshold and a direction, met or missed, printed one way wherever it appears (the console,
report.md's table, JSON).

    Goal("N=4: ring >= 0.9x native busbw at >= 4 MiB", "ring", "native", ">=", 0.9,
         ratio=0.95, worst=True)        -> "goal met: N=4: ring >= 0.9x ...: worst 0.95x"
"""
from __future__ import annotations

import operator
import sys
from dataclasses import dataclass

# How a ratio is judged against the threshold; "within": |ratio - 1| <= threshold, the
# ratio then printed as the signed relative difference (+11%).
OPS = {">=": operator.ge, "<=": operator.le, "<": operator.lt, "within": lambda r, t: abs(r - 1) <= t}
STATUS = {True: "met", False: "MISSED", None: "n/a"}


@dataclass(frozen=True)
class Goal:
    """What is promised (`text`, as printed), which row is compared with which (`measured`
    over `peer`, in the goal's sense), the direction (`op`) and `threshold`, and the ratio
    measured (None: not measured).  `judged` False reports the ratio without a verdict."""
    text: str
    measured: str
    peer: str
    op: str
    threshold: float
    ratio: float | None = None
    worst: bool = False         # the ratio is the worst of several points
    detail: str = ""            # after the figure: which point was worst, a second figure
    judged: bool = True
    digits: int = 2
    missing: str = "not measured"
    unit: str = "x"             # after the figure: "x" for a ratio, " failed" for a count
    spec: str = ""              # the figure's format where digits will not do (".1e")

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"Goal {self.text!r}: op {self.op!r} is not one of {', '.join(OPS)}")

    @property
    def ok(self) -> bool | None:
        if not self.judged or self.ratio is None:
            return None
        return bool(OPS[self.op](self.ratio, self.threshold))

    @property
    def status(self) -> str:
        return STATUS[self.ok]

    @property
    def value(self) -> str:
        """The measured figure as printed: "0.95x", "worst 0.95x (ring, 4 B)", "+11%"."""
        if self.ratio is None:
            return self.missing
        figure = f"{self.ratio - 1:+.0%}" if self.op == "within" else f"{self.ratio:{self.spec or f'.{self.digits}f'}}{self.unit}"
        return ("worst " if self.worst else "") + figure + (f" {self.detail}" if self.detail else "")

    def line(self) -> str:
        """The goal's one line on the console."""
        return f"goal {self.status}: {self.text}: {self.value}"

    def as_dict(self) -> dict:
        """The goal in JSON: the printed pieces, then what they were computed from."""
        return {"goal": self.text, "value": self.value, "ok": self.ok, "status": self.status,
                "measured": self.measured, "peer": self.peer, "op": self.op,
                "threshold": self.threshold, "ratio": self.ratio}


COLUMNS = [("goal", "goal", ""), ("value", "measured", ""), ("status", "", "")]


def rows(goals: list[Goal]) -> list[dict]:
    """The goals as table rows (psrt.bench.report.table / md_table with COLUMNS)."""
    return [g.as_dict() for g in goals]


def print_goals(goals: list[Goal], prefix: str = "", out=None) -> None:
    out = out or sys.stdout
    for g in goals:
        print(prefix + g.line(), file=out)
    out.flush()
