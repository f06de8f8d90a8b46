"""What a training run shows: a progress bar, JSONL metrics and the summary table.

Only the lead rank (worker 0) calls these; the numbers of the other ranks reach it through
the training loop (see train.py), so output is never printed N times.
"""
from __future__ import annotations

import json
import math
import sys
import time


def fmt_bytes(n: float) -> str:
    """4 B, 64 KiB, 1.5 MiB: binary units, a decimal only where the value needs one."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n:.0f} B"


class Progress:
    """A text bar on stderr when it is a terminal; otherwise a line every ~10% of the run."""

    def __init__(self, total: int, label: str, enabled: bool = True, stream=None, unit: str = "steps",
                 first: int = 0):
        """`first`: units done before this run (a resumed one), counted in `done` but not
        in the rate."""
        self.total, self.label, self.enabled = max(total, 1), label, enabled and total > first
        self.unit, self.first = unit, first
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every = max(1, self.total // 10)
        self.start = time.perf_counter()

    def update(self, done: int, note: str = "") -> None:
        """Show that `done` of `total` units are finished; `note` says what was just done."""
        if not self.enabled:
            return
        rate = (done - self.first) / max(time.perf_counter() - self.start, 1e-9)
        text = f"{self.label}: {done}/{self.total} {self.unit} {note} {rate:.1f} {self.unit}/s".replace("  ", " ")
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


# The summary table's columns: (key, heading, format spec[, scale]); the spec "bytes" prints
# a byte count with fmt_bytes, "" prints the value as it is.
COLUMNS = [
    ("dp", "strategy", ""),
    ("workers", "workers", "d"),
    ("steps", "steps", "d"),
    ("train_loss", "train loss", ".4f"),
    ("test_loss", "test loss", ".4f"),
    ("test_acc", "test acc", ".1%"),
    ("samples_per_s", "samples/s", ".0f"),
    ("compute_s", "compute s", ".2f"),
    ("comm_s", "comm s", ".2f"),
    ("bytes_per_rank", "sent/rank", "bytes"),
    ("bytes_max_rank", "max sent", "bytes"),
    ("opt_state_bytes", "opt state/rank", "bytes"),
]


def _cell(value, spec: str, scale: float = 1) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if spec == "bytes":
        return fmt_bytes(value)
    return format(value * scale, spec) if spec else str(value)


def format_table(rows: list[dict], columns: list[tuple], markdown: bool = False) -> str:
    """The one table printer of psrt: rows as aligned text (first column left, the rest
    right) or as a Markdown table.  columns are (key, heading, format spec[, scale])."""
    cells = [[c[1] for c in columns]] + [[_cell(r.get(c[0]), *c[2:]) for c in columns] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(row) + " |" for row in cells]
        lines.insert(1, "|" + "---|" * len(columns))
        return "\n".join(lines) + "\n"
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary_table(rows: list[dict]) -> str:
    """The summary of `python -m psrt.train`: one row per strategy, columns as COLUMNS."""
    return format_table(rows, COLUMNS)


LEGEND = """\
compute s, comm s: per worker, mean; comm s is time blocked in communication (not hidden by overlap)
sent/rank: bytes a worker put on the wire, mean over workers; max sent: the busiest rank (a server)
opt state/rank: bytes of optimizer-state tensors on the rank holding the most"""


MEMORY_COLUMNS = [("dp", "strategy", ""), ("mem_params", "params", "bytes"), ("mem_grads", "grads", "bytes"),
                  ("mem_optimizer", "optimizer", "bytes"), ("mem_states", "model states", "bytes"),
                  ("formula_states", "formula", "bytes"), ("vs_formula", "vs formula", "+.1%"),
                  ("mem_buffers", "comm buffers", "bytes"), ("mem_activations", "activations/micro-batch", "bytes"),
                  ("formula_activations", "formula", "bytes")]
PLACE_COLUMNS = [("mem_device", "on device", "bytes"), ("mem_host", "on host", "bytes")]
# torch.cuda.memory_allocated / max_memory_allocated on the rank holding the most
CUDA_COLUMNS = [("mem_cuda_allocated", "CUDA allocated", "bytes"), ("mem_cuda_peak", "CUDA peak", "bytes")]


def memory_block(rows: list[dict], optimizer: str, precision: str = "fp32") -> str:
    """The memory ledger under the summary: what the rank holding the most keeps of each
    model state after the last step, measured, beside ZeRO's formula, and the activations
    one micro-batch's forward keeps for backward (psrt.dp.memory).  Where a rank holds
    anything on an accelerator, or offloads its optimizer, its bytes are split by where they
    live; on CUDA the allocator's own count, now and at its peak, stands beside them."""
    for r in rows:
        if r.get("formula_states"):
            r["vs_formula"] = r["mem_states"] / r["formula_states"] - 1
    phi = rows[0]["params"]
    formula_acts = any("formula_activations" in r for r in rows)
    columns = MEMORY_COLUMNS if formula_acts else MEMORY_COLUMNS[:-1]
    if any(r.get("offload") or r.get("mem_device") for r in rows):
        columns = columns + PLACE_COLUMNS
    if any(r.get("mem_cuda_allocated") for r in rows):
        columns = columns + CUDA_COLUMNS
    acts = ""
    if formula_acts:
        acts = ("; activations: Korthikanti et al. (2022) adapted to psrt's transformer (16 sbh elements per block, "
                "1 with --recompute" + ("; under autocast 14 of them 16-bit, the LayerNorm inputs fp32, and a 16-bit "
                                        "copy of the matmul weights" if precision != "fp32" else "") + ")")
    mixed = ""
    if precision != "fp32":
        mixed = (f"; --precision {precision} keeps fp32 parameters as the master weights and casts per operation "
                 "(autocast): 4 + 4 + 8 = 16 bytes per parameter, the same total as the paper's 2 Phi + 2 Phi + 12 Phi "
                 "for 16-bit parameters and gradients beside fp32 master weights")
    offload = ("; --offload-optimizer: the optimizer's part is in host memory and holds the rank's fp32 master and "
               "gradient copies too, (K + 8) Phi / N" if any(r.get("offload") for r in rows) else "")
    return (f"memory per rank, measured after the last step; formula: ZeRO's (Rajbhandari et al., SC 2020) for "
            f"Phi = {phi:,} parameters, {optimizer} (16 Phi ddp, 8 Phi + 8 Phi/N zero1, 4 Phi + 12 Phi/N zero2, "
            f"16 Phi/N zero3 with fp32 Adam){mixed}{offload}{acts}\n" + format_table(rows, columns))


AXES = (("dp", "dp_bytes_per_rank"), ("pp", "pp_bytes_per_rank"), ("tp", "tp_bytes_per_rank"),
        ("ep", "ep_bytes_per_rank"))


def axes_line(row: dict) -> str | None:
    """A grid run's bytes per rank and step on each axis: the data-parallel strategy's, the
    pipeline's activations, the tensor-parallel collectives, the experts' all-to-alls."""
    steps = max(row.get("steps_run", row["steps"]), 1)
    parts = [f"{axis} {fmt_bytes(row[key] / steps)}" for axis, key in AXES if row.get(key)]
    return f"{row['dp']}: sent per rank and step by axis: " + ", ".join(parts) if parts else None


def moe_block(row: dict) -> str:
    """What the experts did in a --model moe run: tokens routed to each expert per step (the
    load balance), the share dropped over capacity, and the all-to-all bytes per rank beside
    their value under uniform routing (4 all-to-alls per layer, T k h d (EP-1)/EP each)."""
    routed = row["routed_per_step"]
    mean = sum(routed) / len(routed)
    cells = "  ".join(f"e{i} {v:.0f}" for i, v in enumerate(routed))
    return (f"{row['dp']}: {row['experts']} experts, top-{row['top_k']}, ep {row['ep']}; tokens routed per "
            f"expert per step and layer: {cells} (max/mean {max(routed) / mean:.2f}); dropped over capacity "
            f"{row['dropped_frac']:.1%}; all-to-all {fmt_bytes(row['a2a_bytes_per_step'])} per rank per step "
            f"(uniform routing: {fmt_bytes(row['a2a_uniform'])})")
