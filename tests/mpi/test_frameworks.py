"""Frameworks built on torch.distributed, on the psrt backend: HF Accelerate's Accelerator,
transformers' Trainer and Lightning's Trainer each train a small model under mpirun, once on
psrt and once on gloo, and must log the same losses (tests/mpi/ranks/frameworks.py).

Each picks a CPU job's backend by name ("gloo", or "mpi" when torch has it) and keeps a default
group that exists already, so the script makes it first on the backend under test.  At N = 2 a
sum of two fp32 values is the same in either order, so the losses agree to the last bit; the
tolerance only allows for the reduction's order on other machines.
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

BACKENDS = ("psrt", "gloo")


@pytest.mark.parametrize("framework,package", (("accelerate", "accelerate"), ("trainer", "transformers"),
                                               ("lightning", "lightning")))
def test_framework_on_psrt_equals_gloo(run_ranks, tmp_path, framework, package):
    pytest.importorskip(package)
    got = {}
    for backend in BACKENDS:
        out = tmp_path / f"{backend}.json"
        run_ranks(2, "frameworks.py", framework, backend, str(out), timeout=240).check()
        got[backend] = json.loads(out.read_text())
    psrt_run, gloo_run = got["psrt"], got["gloo"]
    assert psrt_run["backend"] == "psrt" and gloo_run["backend"] == "gloo", (psrt_run, gloo_run)
    assert psrt_run["psrt_calls"] > 0, "no collective ran on psrt's group"
    assert len(gloo_run["losses"]) == 6, gloo_run
    assert psrt_run["losses"] == pytest.approx(gloo_run["losses"], rel=1e-6), (psrt_run, gloo_run)
    # the comparison means something only if training moved the loss
    assert len(set(gloo_run["losses"])) > 1, gloo_run
