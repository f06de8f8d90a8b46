# psrt: set-up, demo and tests.  `make demo` and `make test` each install what they need first.
# absolute: the ranks of Debian's mpirun may see /usr/bin first on PATH, whose python3 has no torch
PYTHON ?= $(shell command -v python3)
NP ?= 4

.PHONY: install demo test bench tune clean

install:
	bash scripts/install.sh

demo: install
	./mpi_launch -np $(NP) $(PYTHON) -m psrt.train --dp ps,ring

test: install
	bash scripts/test.sh

bench: install
	$(PYTHON) -m psrt.bench suite --out out/bench

tune: install
	$(PYTHON) -m psrt.bench tune --np 2,4,8

clean:
	rm -rf build *.egg-info .pytest_cache out
