"""Tables, files and plots for benchmark results (rank 0 only)."""
from __future__ import annotations

import csv
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

from psrt.train.report import format_table


def table(rows: list[dict], columns: list[tuple], out=sys.stdout) -> None:
    """Print rows as an aligned table (psrt.train.report.format_table)."""
    print(format_table(rows, columns), file=out)
    out.flush()


def md_table(rows: list[dict], columns: list[tuple]) -> str:
    """The same as a Markdown table."""
    return format_table(rows, columns, markdown=True)


def write_json(path, payload) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=1) + "\n")


def write_csv(path, rows: list[dict]) -> None:
    if not rows:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        # every key of every row, in first-seen order (rows of one file may differ a little)
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        w.writeheader()
        w.writerows(rows)


def panels(count: int = 1, width: float = 5.5, height: float = 4.0):
    """(pyplot, figure, axes) for `count` plots side by side, or None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, count, figsize=(width * count, height), squeeze=False)
    return plt, fig, list(axes[0])


def label(ax, title: str, xlabel: str, ylabel: str, log: bool = False) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if not log:
        ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def save(plt, fig, path) -> bool:
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_busbw(rows: list[dict], path, title: str) -> bool:
    """busbw vs message size, one line per algorithm (log-log).  False if matplotlib is missing."""
    made = panels(1, 7, 4.2)
    if made is None:
        return False
    plt, fig, (ax,) = made
    for algo in dict.fromkeys(r["algorithm"] for r in rows):
        pts = sorted((r["nbytes"], r["busbw_gbs"]) for r in rows if r["algorithm"] == algo)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=algo,
                lw=2.2 if algo in ("ring", "native") else 1.2)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    label(ax, title, "message size (bytes)", "bus bandwidth (GB/s)", log=True)
    return save(plt, fig, path)


def mpi_version() -> str:
    """The first line of the MPI library's version string."""
    from mpi4py import MPI
    return MPI.Get_library_version().splitlines()[0].strip()


def machine() -> str:
    """This machine in words: cores, memory, OS, MPI, torch, Python."""
    try:
        mem = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1)) / 2**20
        memory = f" with {mem:.0f} GiB"
    except (OSError, AttributeError):
        memory = ""
    try:
        osname = re.search(r'PRETTY_NAME="([^"]+)"', Path("/etc/os-release").read_text()).group(1)
    except (OSError, AttributeError):
        osname = platform.system()
    # MPI's version from a child: importing mpi4py here would start MPI in this process, whose
    # environment the MPI jobs it starts (the suite's, make bench's) would then inherit.
    mpi = subprocess.run([sys.executable, "-c", "from mpi4py import MPI; "
                          "print(MPI.Get_library_version().splitlines()[0].split(', package')[0])"],
                         capture_output=True, text=True).stdout.strip() or "no MPI"
    import torch
    return (f"a {os.cpu_count()}-core {platform.machine()} machine{memory} ({osname}, {mpi}, "
            f"torch {torch.__version__}, Python {platform.python_version()})")


def need(ok: bool, text: str) -> None:
    """A bad command-line value: one line, on rank 0 only."""
    if not ok:
        from psrt.errors import PsrtError
        raise PsrtError(text, everywhere=True)
