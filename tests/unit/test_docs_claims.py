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
