"""What a training run shows: a progress bar, JSONL metrics and the summary table.

Only the lead rank (worker 0) calls these; the numbers of the other ranks reach it through
the training loop (see train.py), so output is never printed N times.
"""
from __future__ import annotations

import json
import math
import sys
import time


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


class Progress:
    """A text bar on stderr when it is a terminal; otherwise a line every ~10% of the run."""

    def __init__(self, total: int, label: str, enabled: bool = True, stream=None):
        self.total, self.label, self.enabled = max(total, 1), label, enabled and total > 0
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every = max(1, self.total // 10)
        self.start = time.perf_counter()

    def update(self, done: int, note: str = "") -> None:
        """Show that `done` of `total` units are finished; `note` says what was just done."""
        if not self.enabled:
            return
        rate = done / max(time.perf_counter() - self.start, 1e-9)
        text = f"{self.label}: {done}/{self.total} {note} {rate:.1f}/s".replace("  ", " ")
        if self.tty:
            width = 24
            fill = int(width * done / self.total)
            self.stream.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {text}")
            if done == self.total:
                self.stream.write("\n")
            self.stream.flush()
        elif done % self.every == 0 or done == self.total:
            self.stream.write(text + "\n")
            self.stream.flush()


class Metrics:
    """JSONL: one object per step, then one summary object ("summary": true)."""

    def __init__(self, path: str | None, append: bool = False):
        self.file = open(path, "a" if append else "w", encoding="utf-8") if path else None

    def write(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record, allow_nan=False, default=_plain) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def _plain(value):
    return float(value) if hasattr(value, "__float__") else str(value)


def finite(x: float):
    """JSON has no NaN: a missing number is written as null."""
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x


COLUMNS = [  # (heading, key, format)
    ("strategy", "dp", "{}"),
    ("workers", "workers", "{}"),
    ("steps", "steps", "{}"),
    ("train loss", "train_loss", "{:.4f}"),
    ("test loss", "test_loss", "{:.4f}"),
    ("test acc", "test_acc", "{:.1%}"),
    ("samples/s", "samples_per_s", "{:.0f}"),
    ("compute s", "compute_s", "{:.2f}"),
    ("comm s", "comm_s", "{:.2f}"),
    ("sent/rank", "bytes_per_rank", "human"),
    ("max sent", "bytes_max_rank", "human"),
    ("opt state/rank", "opt_state_bytes", "human"),
]


def _cell(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return human_bytes(value) if fmt == "human" else fmt.format(value)


def table(rows: list[dict]) -> str:
    """The summary table: one row per strategy, columns as COLUMNS."""
    cells = [[h for h, _, _ in COLUMNS]] + [[_cell(r.get(k), f) for _, k, f in COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = []
    for j, row in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


LEGEND = """\
compute s, comm s: per worker, mean; comm s is time blocked in communication (not hidden by overlap)
sent/rank: bytes a worker put on the wire, mean over workers; max sent: the busiest rank (a server)
opt state/rank: bytes of optimizer-state tensors on the rank holding the most"""
