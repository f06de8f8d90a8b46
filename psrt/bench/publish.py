"""`python -m psrt.bench publish` (`make bench`): run the benchmarks the results pages show and
write what they printed into those pages, so that no figure in them is typed by hand.

A page marks a command block as published with a comment on the line before it (or before its
`<!-- docs: not run -->` line):

    <!-- bench: NAME [include=FILE] [images=GLOB] [stderr] [needs=root|cuda] [timeout=S] [headline="REGEX"] -->
    ```sh
    python -m psrt.bench ...
    ```

Publishing runs the block's commands with bash in the repository root and writes, right after
the block, a region that says when, on what machine and in how long they ran, followed by
what they printed: stdout in a `text` block (`stderr` adds stderr), or the Markdown file
`include=FILE` that the commands wrote (its images are copied into docs/img/). `images=GLOB`:
the PNGs the commands wrote that the page shows, copied to docs/img/NAME-FILE. A region
already there is replaced; a command that fails leaves its region and images as they were.

`headline="REGEX"`: README.md's region `<!-- bench headlines -->` lists, for each such block,
the first line of its published output that matches (its groups joined by ": ", if it has
any), linked to the block's section.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from psrt.bench import report
from psrt.errors import PsrtError

HELP = "run the results pages' benchmarks and write their output into the pages (make bench)"
ROOT = Path(__file__).resolve().parents[2]
MARK = re.compile(r"^<!-- bench: (?P<name>[\w.-]+)(?P<opts>[^\n]*?) -->[ \t]*$", re.M)
FENCE = re.compile(r"^```(?P<lang>[^\n`]*)\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)
REGION = "<!-- bench output: {name} -->"
REGION_END = "<!-- /bench output -->"
HEADLINES, HEADLINES_END = "<!-- bench headlines -->", "<!-- /bench headlines -->"
NEEDS = ("root", "cuda")


@dataclasses.dataclass
class Block:
    """One published command block of a page."""
    page: Path
    name: str
    commands: str                 # the sh block's body
    end: int                      # offset just after the block's closing fence
    line: int                     # the line of its mark, when the page was read
    section: str                  # the heading the block sits under
    level: int                    # its level (## is 2)
    include: str | None = None
    images: str | None = None
    stderr: bool = False
    needs: str | None = None
    timeout: float = 3600.0
    headline: str | None = None

    @property
    def where(self) -> str:
        return f"{_rel(self.page)}:{self.line}"


def _rel(path: Path) -> str:
    path = path.resolve()
    return path.relative_to(ROOT).as_posix() if ROOT in path.parents else str(path)


def pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def _options(text: str, where: str) -> dict:
    opts = {}
    for word in shlex.split(text):
        key, _, value = word.partition("=")
        if key not in ("include", "images", "stderr", "needs", "timeout", "headline"):
            raise PsrtError(f"{where}: unknown bench option {key!r}")
        if key == "needs" and value not in NEEDS:
            raise PsrtError(f"{where}: needs={value!r}: one of {', '.join(NEEDS)}")
        opts[key] = True if key == "stderr" else float(value) if key == "timeout" else value
    return opts


def blocks(page: Path) -> list[Block]:
    """The published blocks of a page, in order."""
    text = page.read_text()
    found = []
    for mark in MARK.finditer(text):
        where = f"{_rel(page)}:{text[:mark.start()].count(chr(10)) + 1}"
        fence = FENCE.search(text, mark.end())
        between = text[mark.end():fence.start()] if fence else ""
        if not fence or fence.group("lang").strip() != "sh" or \
                any(line.strip() and not line.strip().startswith("<!-- docs:") for line in between.splitlines()):
            raise PsrtError(f"{where}: a bench mark must stand right before a ```sh block")
        # the headings above the mark, not the "# ..." lines of the outputs between them
        heads = re.findall(r"^(#+) (.+)$", FENCE.sub("", text[:mark.start()]), re.M)
        level, section = (len(heads[-1][0]), heads[-1][1]) if heads else (1, page.stem)
        found.append(Block(page, mark.group("name"), fence.group("body"), fence.end(),
                           text[:mark.start()].count("\n") + 1, section, level,
                           **_options(mark.group("opts"), where)))
    return found


def region(text: str, block: Block) -> tuple[int, int] | None:
    """The span of the block's published region, right after its command block, if any."""
    start = text.find(REGION.format(name=block.name), block.end)
    if start < 0 or text[block.end:start].strip():
        return None
    end = text.find(REGION_END, start)
    return (start, end + len(REGION_END)) if end >= 0 else None


def _include(path: Path, name: str, level: int) -> str:
    """The Markdown file a block wrote, its local images copied into docs/img/, its title left
    out and its headings moved under the section it lands in."""
    text = re.sub(r"^# .*\n", "", path.read_text(), flags=re.M)
    text = re.sub(r"^(#+) ", lambda m: "#" * (len(m.group(1)) + level - 1) + " ", text, flags=re.M)
    img = ROOT / "docs" / "img"

    def copy(m: re.Match) -> str:
        src = path.parent / m.group(2)
        if re.match(r"[a-z]+:", m.group(2)) or not src.exists():
            return m.group(0)
        dest = img / f"{name}-{src.name}"
        shutil.copyfile(src, dest)
        return f"![{m.group(1)}](IMG/{dest.name})"
    return re.sub(r"!\[([^\]]*)\]\(([^)\s]+)\)", copy, text).strip()


def render(block: Block, output: str, seconds: float, when: dt.datetime, where: str) -> str:
    """The block's region: when, where and how long, then what it printed."""
    if block.include:
        up = os.path.relpath(ROOT / "docs" / "img", block.page.parent)
        body = output.replace("](IMG/", f"]({up}/")
    else:
        body = "```text\n" + "\n".join(line.rstrip() for line in output.strip("\n").splitlines()) + "\n```"
    return (f"{REGION.format(name=block.name)}\n"
            f"*Published by `make bench` from the commands above: {when:%Y-%m-%d %H:%M} UTC on {where}, "
            f"{_duration(seconds)}.*\n\n{body}\n{REGION_END}")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def write(block: Block, rendered: str) -> None:
    # found again: an earlier block's region on the same page may have moved it
    block = next(b for b in blocks(block.page) if b.name == block.name)
    text = block.page.read_text()
    span = region(text, block)
    start, end = span if span else (block.end, block.end)
    glue = "" if span else "\n\n"
    block.page.write_text(text[:start] + glue + rendered + text[end:])


def published_output(text: str, block: Block) -> str:
    """What a block's region shows, without its first line of provenance."""
    span = region(text, block)
    if not span:
        return ""
    lines = text[span[0]:span[1]].splitlines()[2:-1]
    return "\n".join(line for line in lines if not line.startswith("```")).strip("\n")


def _anchor(heading: str) -> str:
    # GitHub's (and the docs site's, mkdocs.yml) slugs
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headlines(root: Path = ROOT) -> list[str]:
    """README's headline lines, from every published region with a headline pattern."""
    lines = []
    for page in pages(root):
        text = page.read_text()
        for block in blocks(page):
            if not block.headline:
                continue
            hit = next((m for m in map(re.compile(block.headline).search, published_output(text, block).splitlines()) if m), None)
            if hit:
                said = ": ".join(g.strip() for g in hit.groups() if g) if hit.groups() else hit.group(0).strip()
                link = f"{page.relative_to(root).as_posix()}#{_anchor(block.section)}"
                lines.append(f"- **{block.section}**: {said} ([output]({link})).")
    return lines


def write_headlines(root: Path = ROOT) -> bool:
    readme = root / "README.md"
    text = readme.read_text()
    start, end = text.find(HEADLINES), text.find(HEADLINES_END)
    if start < 0 or end < start:
        return False
    readme.write_text(text[:start + len(HEADLINES)] + "\n" + "\n".join(headlines(root)) + "\n" + text[end:])
    return True


def _unmet(need: str | None) -> str | None:
    if need == "root" and os.geteuid() != 0:
        return "needs root (emulated hosts)"
    if need == "cuda":
        import torch
        if not torch.cuda.is_available():
            return "needs a CUDA GPU"
    return None


STOP_GRACE_S = 120     # for a stopped block to take its emulated hosts down


def run(block: Block) -> tuple[int, str, float]:
    """Run a block's commands; (exit code, what they printed, seconds).  Past its timeout, or
    when this process is stopped (Ctrl-C, SIGTERM), the block's whole process group gets
    SIGTERM and time to clean up (a bench's emulated hosts), then SIGKILL."""
    t0 = time.monotonic()
    # BENCH_PUBLISHING names the block being published: a test suite run by it (make test) does
    # not count that block's region as missing (tests/unit/test_docs_claims.py).
    env = dict(os.environ, PYTHONUNBUFFERED="1", BENCH_PUBLISHING=block.name)
    proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", block.commands], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT if block.stderr else None,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=block.timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        return 124, "", time.monotonic() - t0
    except BaseException:
        _stop(proc)
        raise
    return proc.returncode, out, time.monotonic() - t0


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the block's process group; SIGKILL to what is left of it after the grace
    (the shell may end at once while the bench it started is still taking its hosts down)."""
    def group(sig) -> bool:
        try:
            os.killpg(proc.pid, sig)
            return True
        except ProcessLookupError:
            return False
    group(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    try:
        proc.communicate(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    while time.monotonic() < deadline and group(0):
        time.sleep(0.1)
    group(signal.SIGKILL)
    proc.communicate()


def add_arguments(ap) -> None:
    ap.add_argument("--only", default="", help="comma-separated block names (default: every block)")
    ap.add_argument("--list", action="store_true", help="list the published blocks and exit")


def command(args) -> int:
    # SIGTERM (a deadline's `timeout`, a batch system) as Ctrl-C: the running block is stopped
    # and cleans up (run) before this process ends
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    every = [b for page in pages() for b in blocks(page)]
    twice = sorted({b.name for b in every if sum(c.name == b.name for c in every) > 1})
    if twice:
        print(f"psrt.bench publish: block names used twice: {', '.join(twice)}", file=sys.stderr)
        return 2
    only = [n for n in args.only.split(",") if n]
    unknown = sorted(set(only) - {b.name for b in every})
    if unknown:
        print(f"psrt.bench publish: no block named {', '.join(unknown)} (see --list)", file=sys.stderr)
        return 2
    chosen = [b for b in every if not only or b.name in only]
    if args.list:
        for b in every:
            print(f"{b.name:<24} {b.where:<42} {b.commands.strip().splitlines()[0]}")
        return 0
    failed = publish(chosen, report.machine())
    write_headlines()
    if failed:
        print(f"psrt.bench publish: {len(failed)} block(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def publish(chosen: list[Block], where: str) -> list[str]:
    """Run each block and write its region; the names of the blocks that failed."""
    failed = []
    for i, block in enumerate(chosen, 1):
        say = f"psrt.bench publish: [{i}/{len(chosen)}] {block.name} ({block.where})"
        why = _unmet(block.needs)
        if why:
            print(f"{say}: skipped, {why}; its region is unchanged", file=sys.stderr, flush=True)
            continue
        print(f"{say} ...", file=sys.stderr, flush=True)
        when = dt.datetime.now(dt.timezone.utc)
        code, output, seconds = run(block)
        if code == 0 and block.include:
            path = ROOT / block.include
            code, output = (0, _include(path, block.name, block.level)) if path.exists() else (1, "")
        if code != 0:
            failed.append(block.name)
            print(f"{say}: exit {code} after {_duration(seconds)}; its region is unchanged", file=sys.stderr, flush=True)
            continue
        for image in sorted(ROOT.glob(block.images)) if block.images else ():
            shutil.copyfile(image, ROOT / "docs" / "img" / f"{block.name}-{image.name}")
        write(block, render(block, output, seconds, when, where))
        print(f"{say}: {_duration(seconds)}", file=sys.stderr, flush=True)
    return failed
