# psrt: set-up, demo and tests.  `make demo` and `make test` each install what they need first.
# absolute: the ranks of Debian's mpirun may see /usr/bin first on PATH, whose python3 has no torch
PYTHON ?= $(shell command -v python3)

.PHONY: install demo test bench tune clean

install:
	bash scripts/install.sh

demo: install
	$(PYTHON) -m psrt.bench demo

test: install
	bash scripts/test.sh

bench: install
	$(PYTHON) -m psrt.bench suite --out out/bench

tune: install
	$(PYTHON) -m psrt.bench tune --np 2,4,8

clean:
	rm -rf build *.egg-info .pytest_cache out
