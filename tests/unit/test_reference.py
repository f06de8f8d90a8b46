"""The reference pages say what the code does: docs/reference/cli.md names every flag of every
command's parser, docs/reference/env.md every PSRT_* variable of psrt/env.py and
docs/reference/messages.md every one-line error message the source writes out, and each is
what scripts/gen_reference.py writes today (the API page is checked where the site is built:
its generator joins MPI, which this process must not)."""
from __future__ import annotations

import argparse
import importlib.util

from conftest import ROOT

from psrt import env

REF = ROOT / "docs" / "reference"
_spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "scripts" / "gen_reference.py")
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)


def _all_parsers():
    todo, seen = gen.parsers(), []
    while todo:
        parser = todo.pop(0)
        seen.append(parser)
        todo += list(gen.subcommands(parser).values())
    return seen


def test_every_command_has_its_section():
    progs = [p.prog for p in _all_parsers()]
    for wanted in ("python -m psrt.train", "mpi_launch", "python -m psrt.bench", "python -m psrt.bench demo",
                   "python -m psrt.cluster", "python -m psrt.cluster up", "python -m psrt.info", "python -m psrt.trace"):
        assert wanted in progs
    text = (REF / "cli.md").read_text()
    missing = [p for p in progs if f"`{p}`" not in text]
    assert not missing, f"docs/reference/cli.md has no section for {missing}: run python scripts/gen_reference.py"


def test_the_cli_reference_names_every_flag():
    text = (REF / "cli.md").read_text()
    missing = [f"{p.prog} {flag}" for p in _all_parsers() for a in p._actions
               if a.help != argparse.SUPPRESS for flag in a.option_strings if f"`{flag}`" not in text]
    assert not missing, f"docs/reference/cli.md lacks {missing}: run python scripts/gen_reference.py"


def test_the_env_reference_names_every_variable():
    text = (REF / "env.md").read_text()
    missing = [name for name in env.VARIABLES if f"`{name}`" not in text]
    assert not missing, f"docs/reference/env.md lacks {missing}: run python scripts/gen_reference.py"


def test_the_error_reference_names_every_message():
    text = (REF / "messages.md").read_text()
    found = gen.error_messages()
    assert len(found) > 300, f"{len(found)} messages: the generator no longer finds psrt's raises"
    missing = [f"{path}: {message}" for path, _, message in found if gen._code_span(message) not in text]
    assert not missing, f"docs/reference/messages.md lacks {missing}: run python scripts/gen_reference.py"


def test_a_message_is_read_as_the_source_writes_it():
    import ast
    read = gen._message(ast.parse("f'--np {n}: must be ' + ('even' if x else 'odd') + '; ' + 'see --help'").body[0].value)
    assert read == "--np ...: must be ...; see --help"
    assert gen._message(ast.parse("text").body[0].value) is None       # a message passed on, not written here
    assert gen._code_span("use `x`") == "`` use `x` ``"                # a backtick inside stays text


def test_the_pages_are_what_the_generator_writes():
    assert (REF / "cli.md").read_text() == gen.cli_page(), "run python scripts/gen_reference.py"
    assert (REF / "env.md").read_text() == gen.env_page(), "run python scripts/gen_reference.py"
    assert (REF / "messages.md").read_text() == gen.messages_page(), "run python scripts/gen_reference.py"
