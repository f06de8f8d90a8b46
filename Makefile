# psrt: set-up, demo and tests.  `make demo` and `make test` each install what they need first.
# absolute: the ranks of Debian's mpirun may see /usr/bin first on PATH, whose python3 has no torch
PYTHON ?= $(shell command -v python3)

.PHONY: install demo test test-quick torch-suite bench tune docs clean

install:
	bash scripts/install.sh

demo: install
	$(PYTHON) -m psrt.bench demo

test: install
	bash scripts/test.sh

# The inner loop: the unit tests and one multi-rank launch per area (tests/quick.txt).
test-quick: install
	bash scripts/test.sh --quick

# PyTorch's own distributed test suite on the psrt backend at 2, 3 and 4 ranks, then on gloo
# (the reference, same selection): about 5 minutes each on 2 cores.
torch-suite: install
	$(PYTHON) scripts/torch_suite.py --np 2,3,4 --log out/torch_suite.log
	$(PYTHON) scripts/torch_suite.py --np 2,3,4 --backend gloo --log out/torch_suite_gloo.log

# Every benchmark the results pages show, run again, its output written into the pages with the
# date and the machine (psrt.bench publish; root for the emulated hosts; about an hour here).
bench: install
	$(PYTHON) -m psrt.bench publish

tune: install
	$(PYTHON) -m psrt.bench tune --np 2,4,8

# The documentation site, offline, into out/site; the reference pages are regenerated first.
docs:
	PSRT_WITH_SLURM=0 PSRT_WITH_FRAMEWORKS=0 PSRT_WITH_HOROVOD=0 PSRT_WITH_BROWSER=0 bash scripts/install.sh
	$(PYTHON) scripts/gen_reference.py
	$(PYTHON) -m mkdocs build --strict

clean:
	rm -rf build *.egg-info .pytest_cache out
