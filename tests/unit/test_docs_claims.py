"""Statements the docs once made that were not true, each with what shows the truth.  A page
that says one of them again fails here; the commands the docs show run in tests/mpi/test_docs.py."""
from __future__ import annotations

import re

import pytest
from conftest import ROOT

DOCS = ROOT / "docs"

# (page, what it must not say again, where the truth is shown)
UNTRUE = [
    ("explanation/model_parallel.md", r"Other `--dp` strategies, and `--checkpoint/--resume`, are refused",
     "zero1 and checkpoints on --pp/--tp: tests/mpi/test_composition.py"),
    ("explanation/moe.md", r"`--checkpoint` with `--model moe` are refused",
     "MoE checkpoints: tests/mpi/test_composition.py"),
    ("how-to/training.md", r"The same number of ranks is required",
     "a ring checkpoint of 2 ranks resumed on 4: the console block of how-to/training.md"),
    ("explanation/model_parallel.md", r"`mpirun -np 2 --bind-to none -x OMP_NUM_THREADS=1 python examples/tensor_parallel\.py`",
     "plain mpirun stops as root and on too few cores: ./mpi_launch instead"),
]


@pytest.mark.parametrize("page,claim,truth", UNTRUE, ids=[f"{p}:{c[:30]}" for p, c, _ in UNTRUE])
def test_the_docs_do_not_say_it_again(page, claim, truth):
    text = " ".join((DOCS / page).read_text().split())
    assert not re.search(claim, text), f"docs/{page} says {claim!r} again; the truth: {truth}"


def test_save_of_several_strategies_and_loading_it_are_shown():
    text = (DOCS / "how-to" / "training.md").read_text()
    assert "`FILE.<dp>.pt`" in text and "python examples/load_saved.py out/model.ring.pt" in text


def test_the_main_job_leads_the_results():
    text = (DOCS / "explanation" / "results.md").read_text()
    assert re.findall(r"(?m)^## (.+)$", text)[0] == "The main job: `make demo`"


def test_results_that_did_not_reproduce_say_so():
    text = " ".join((DOCS / "explanation" / "results.md").read_text().split())
    assert "**This order did not hold in later runs.**" in text          # --algorithm auto, two hosts
    assert "The step columns are one run and did not reproduce" in text  # bench memory


# ------------------------------------------------------------- results published, not typed

from psrt.bench import publish  # noqa: E402

# A figure measured: a time, a rate, a share or a ratio (inputs such as 16 MiB, 1 Gbit/s or 4
# ranks are not).
MEASURED = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:\s?(?:ms|us|µs|s|min|GB/s|MB/s|samples/s)(?![\w/])|%|x(?![\w]))")
REGIONS = re.compile(r"<!-- bench output: [\w.-]+ -->.*?<!-- /bench output -->|"
                     r"<!-- bench headlines -->.*?<!-- /bench headlines -->", re.S)
COMMENTS = re.compile(r"<!--.*?-->", re.S)
COMMANDS = re.compile(r"^```(?:sh|console)\n.*?^```[ \t]*$", re.M | re.S)


def _typed(text: str) -> str:
    """A page's text less what make bench wrote, its commands and its comments."""
    return COMMENTS.sub("", COMMANDS.sub("", REGIONS.sub("", text)))


def _measured_sections(text: str) -> str:
    """The sections of a page whose heading starts with "Measured"."""
    parts = re.split(r"(?m)^(?=#+ )", text)
    return "".join(p for p in parts if re.match(r"#+ Measured", p))


def _results_text() -> dict[str, str]:
    """What was typed by hand on the results pages: all of results.md, the "Measured" sections
    of the others, README's short results."""
    readme = _typed((ROOT / "README.md").read_text())
    short = readme.split("## Results in short", 1)[1].split("\n## ", 1)[0]
    return {
        "docs/explanation/results.md": _typed((DOCS / "explanation" / "results.md").read_text()),
        "docs/explanation/benchmarks.md (Measured)": _measured_sections(_typed((DOCS / "explanation" / "benchmarks.md").read_text())),
        "docs/explanation/scaling.md (Measured)": _measured_sections(_typed((DOCS / "explanation" / "scaling.md").read_text())),
        "README.md (Results in short)": short,
    }


@pytest.mark.parametrize("where", list(_results_text()))
def test_no_figure_on_the_results_pages_is_typed_by_hand(where):
    typed = _results_text()[where]
    hits = [(typed[:m.start()].count("\n") + 1, m.group(0)) for m in MEASURED.finditer(typed)]
    assert not hits, f"{where}: figures typed by hand (publish them with a bench block): {hits[:10]}"
    pasted = re.findall(r"(?m)^```text$", typed)
    assert not pasted, f"{where}: {len(pasted)} text block(s) of output pasted by hand"


def test_every_published_block_has_its_output_with_date_and_machine():
    for page in publish.pages():
        text = page.read_text()
        for block in publish.blocks(page):
            span = publish.region(text, block)
            assert span, f"{block.where}: bench block {block.name} has never been published (make bench)"
            assert re.search(r"^\*(Published by `make bench`|Measured by) .*\d{4}-\d\d-\d\d .* on .*\*$",
                             text[span[0]:span[1]], re.M), f"{block.where}: {block.name}'s output says no date or machine"


def test_readme_headlines_are_the_published_ones():
    readme = (ROOT / "README.md").read_text()
    shown = readme.split(publish.HEADLINES, 1)[1].split(publish.HEADLINES_END, 1)[0].strip().splitlines()
    assert shown == publish.headlines(), "README's headlines differ from the published output: run make bench"
