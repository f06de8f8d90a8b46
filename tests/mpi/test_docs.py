"""The docs are tested: every command block of README.md, docs/**/*.md and hostfiles/README.md
runs as a new user types it, from the checkout, or says in the doc source why it is not run.

Fenced blocks carry a label:
- `sh`: commands, one per line (a trailing backslash continues a line);
- `console`: a session: `$ command` lines, each followed by what it printed;
- `text`, `python`: output, tables, file contents, code: not run here.
A block with no label fails this test, so a command added to the docs later is run by default.
`<!-- docs: not run: REASON -->` on the line before a block exempts it, with the reason.

Each command runs with bash in the repository root.  Long commands get a fast flag
(`fast()`: a few steps, small sizes).  A `console` command must exit as the session shows
(non-zero where it printed an error) and print the first word of its first output line.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass

import pytest
from conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "hostfiles" / "README.md"]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
MARK = re.compile(r"<!-- docs: not run: (?P<why>.+?) -->")
LABELS = ("sh", "console", "text", "python")


@dataclass
class Command:
    line: str            # as the doc shows it
    output: list[str]    # what the doc shows it printed (console blocks)


@dataclass
class Block:
    where: str
    lang: str
    body: str
    skip: str | None

    def commands(self) -> list[Command]:
        lines = _join_continuations(self.body.splitlines())
        if self.lang == "sh":
            return [Command(line, []) for line in lines if line.strip() and not line.lstrip().startswith("#")]
        out: list[Command] = []
        for line in lines:
            if line.startswith("$ "):
                out.append(Command(line[2:], []))
            elif out and line.strip():
                out[-1].output.append(line)
        return out


def _join_continuations(lines: list[str]) -> list[str]:
    joined, buf = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
        else:
            joined.append(buf + line)
            buf = ""
    return joined + ([buf] if buf else [])


def blocks() -> list[Block]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            before = text[:m.start()].rstrip().splitlines()
            mark = MARK.search(before[-1]) if before else None
            indent = len(m.group("indent"))
            body = "\n".join(line[indent:] for line in m.group("body").splitlines())
            where = f"{doc.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}"
            found.append(Block(where, m.group("lang").strip(), body, mark.group("why") if mark else None))
    return found


BLOCKS = blocks()
RUN = [b for b in BLOCKS if b.lang in ("sh", "console")]


def test_every_block_says_what_it_is():
    unlabelled = [b.where for b in BLOCKS if b.lang not in LABELS]
    assert not unlabelled, f"label these blocks ({', '.join(LABELS)}): {unlabelled}"


def test_every_run_block_has_a_command():
    assert all(b.commands() for b in RUN), [b.where for b in RUN if not b.commands()]


# ------------------------------------------------------------------ fast flags

def _set(words: list[str], flag: str, value: str) -> list[str]:
    """words with `flag value` (replacing the value if the flag is there)."""
    if flag in words:
        i = words.index(flag)
        return words[:i + 1] + [value] + words[i + 2:]
    return words + [flag, value]


def _drop(words: list[str], flag: str) -> list[str]:
    if flag in words:
        i = words.index(flag)
        return words[:i] + words[i + 2:]
    return words


SMALL_STEPS = 10     # a --steps a page shows that is run as shown


def fast(command: str) -> str:
    """The command with flags that make a long run short; the same command otherwise."""
    given = words = shlex.split(command, comments=True)
    text = " ".join(words)
    if "psrt.train" in text or re.search(r"examples/(ps_vs_ring|horovod_vs_ring|pipeline|hybrid|"
                                         r"tensor_parallel|ddp_overlap)\.py", text):
        # a page's own small step count is kept: a resume must go on past its checkpoint's step
        small = "--steps" in words and words[words.index("--steps") + 1].isdigit() \
            and int(words[words.index("--steps") + 1]) <= SMALL_STEPS
        words = _drop(words if small else _set(words, "--steps", "2"), "--epochs")
        # --quiet only leaves lines out (tests/mpi/test_train_cli.py checks it): a command shown
        # with and without it is run once
        words = [w for w in words if w != "--quiet"]
    elif "psrt.bench collectives" in text:
        words = _set(_set(_set(_drop(words, "--sizes"), "--max-size", "64KiB"), "--repeats", "1"), "--warmup", "0")
    elif "psrt.bench training" in text:
        words = _set(_set(_set(words, "--steps", "1"), "--rounds", "1"), "--width", "64")
    elif "psrt.bench c10d" in text:
        words = _set(_set(_set(words, "--grad-mb", "1"), "--steps", "1"), "--rounds", "1")
    elif "examples/torch_ddp.py" in text:
        words = _set(words, "--epochs", "1")
    elif "psrt.bench pipeline" in text:
        words = _set(_set(words, "--microbatches", "4"), "--t-forward", "0.005")
    elif "psrt.bench memory" in text:
        words = _set(_set(_set(words, "--width", "64"), "--layers", "1"), "--steps", "2")
    elif "psrt.bench pingpong" in text:
        words = _set(_set(words, "--max-size", "64KiB"), "--repeats", "1")
    # unchanged, it runs as typed: a redirection or a pipe stays one
    return command if words == given else shlex.join(words)


def test_fast_flags():
    assert fast("./mpi_launch -np 4 python -m psrt.train --dp ps,ring   # both") == \
        "./mpi_launch -np 4 python -m psrt.train --dp ps,ring --steps 2"
    assert fast("./mpi_launch -np 4 python -m psrt.train --dp ps,ring --quiet") == \
        "./mpi_launch -np 4 python -m psrt.train --dp ps,ring --steps 2"
    assert fast("./mpi_launch -np 2 python -m psrt.bench collectives --sizes 4,1MiB --repeats 7") == \
        "./mpi_launch -np 2 python -m psrt.bench collectives --repeats 1 --max-size 64KiB --warmup 0"
    assert fast("OMPI_MCA_x=1 horovodrun -np 4 python examples/horovod_vs_ring.py --steps 200") == \
        "OMPI_MCA_x=1 horovodrun -np 4 python examples/horovod_vs_ring.py --steps 2"
    assert fast("torchrun --nproc-per-node 2 examples/torch_ddp.py") == \
        "torchrun --nproc-per-node 2 examples/torch_ddp.py --epochs 1"
    assert fast("./mpi_launch --dry-run -np 8 python -m psrt.info") == "./mpi_launch --dry-run -np 8 python -m psrt.info"
    assert fast("./mpi_launch -np 4 python -m psrt.train --steps 8 --resume") == \
        "./mpi_launch -np 4 python -m psrt.train --steps 8 --resume"
    assert fast("printf 'a = 1\\n' > out/lab.toml") == "printf 'a = 1\\n' > out/lab.toml"


def _operators(line: str) -> list[str]:
    """The shell operators of a command line (comments left out)."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    return [word for word in lex if word and set(word) <= set("();<>|&")]


def test_a_command_made_fast_has_no_shell_operator():
    """fast() re-quotes a command whose flags it changes, so a redirection or a pipe there
    would reach the program as an argument: no such command is documented."""
    assert _operators("printf 'a' > out/x  # b; c") == [">"]
    quoted = [f"{b.where}: {c.line}" for b in RUN for c in b.commands()
              if fast(c.line) != c.line and _operators(c.line)]
    assert not quoted, quoted


def _steps(line: str) -> int | None:
    words = shlex.split(line, comments=True)
    return int(words[words.index("--steps") + 1]) if "--steps" in words else None


STOPS = {"scancel", "kill", "pkill"}     # commands that end a run before its last step


def test_a_resume_goes_on_past_its_checkpoint():
    """`--resume` trains up to --steps in all: shown after the run that wrote its checkpoint,
    it must ask for more steps than that run, or it resumes at the end and trains nothing.  A
    run stopped before its end (scancel, kill) resumes with the same --steps."""
    wrong = []
    for block in RUN:
        written: dict[str, int | None] = {}
        for cmd in block.commands():
            words = shlex.split(cmd.line, comments=True)
            if STOPS & set(words):
                written.clear()
            if "--checkpoint" not in words:
                continue
            path = words[words.index("--checkpoint") + 1]
            if "--resume" in words and path in written:
                before, now = written[path], _steps(cmd.line)
                if before is None or now is None or now <= before:
                    wrong.append(f"{block.where}: {cmd.line}")
            written[path] = _steps(cmd.line)
    assert not wrong, f"these resumes train nothing past their checkpoint: {wrong}"


# ------------------------------------------------------------------ running them

def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_", "PMIX_", "PMI_", "SLURM_"))}
    return dict(env, PYTHONPATH=str(ROOT))


_RAN: dict[str, subprocess.CompletedProcess] = {}


def _run(command: str) -> subprocess.CompletedProcess:
    """The command as fast() makes it, run once: a command that several docs show is checked
    against each of them from its one run."""
    line = fast(command)
    if line not in _RAN:
        _RAN[line] = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=400,
                                    cwd=ROOT, env=_env(), stdin=subprocess.DEVNULL)
    return _RAN[line]


def _first_word(line: str) -> str:
    return line.split()[0] if line.split() else ""


@pytest.mark.mpi
@pytest.mark.parametrize("block", RUN, ids=[b.where for b in RUN])
def test_documented_commands_work(block):
    if block.skip:
        pytest.skip(f"not run ({block.skip})")
    for cmd in block.commands():
        if ("--emulate" in cmd.line or "psrt.cluster" in cmd.line) and os.geteuid() != 0:
            pytest.skip("emulated hosts need root")
        run = _run(cmd.line)
        said = run.stdout + run.stderr
        fails = any("error:" in line for line in cmd.output[:2])
        assert (run.returncode != 0) if fails else (run.returncode == 0), \
            f"{block.where}: `{fast(cmd.line)}` exited {run.returncode}\n{said[-3000:]}"
        if cmd.output and _first_word(cmd.output[0]) not in ("...", ""):
            word = _first_word(cmd.output[0])
            assert any(line.lstrip().startswith(word) for line in said.splitlines()), \
                f"{block.where}: `{fast(cmd.line)}` printed no line starting {word!r} as the doc shows\n{said[-3000:]}"
        if fails and not re.match(r"\s*(\w+=\S+\s+)*(torchrun|horovodrun)\b", cmd.line):
            # psrt's own one-line errors (torchrun and horovodrun print tracebacks of their own)
            assert "Traceback" not in said, said[-3000:]
