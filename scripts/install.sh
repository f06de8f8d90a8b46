#!/usr/bin/env bash
# Install what psrt needs on a fresh Debian machine: Open MPI 4.1 (Debian's: the last series
# horovodrun drives), mpi4py compiled against it, torch (CPU), and psrt itself in editable mode.
# Safe to run again: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

say() { printf 'install: %s\n' "$*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

if ! dpkg -s openmpi-bin libopenmpi-dev iproute2 >/dev/null 2>&1; then
    say "Open MPI 4.1 and iproute2 from Debian"
    as_root apt-get update -qq
    as_root apt-get install -y -qq openmpi-bin libopenmpi-dev iproute2 >/dev/null
fi

# Slurm and munge (Debian's 22.05), for python -m psrt.cluster up --slurm and its tests.
# PSRT_WITH_SLURM=0 leaves them out.
if [ "${PSRT_WITH_SLURM:-1}" != 0 ] && ! dpkg -s slurmctld slurmd slurm-client munge >/dev/null 2>&1; then
    say "Slurm (slurmctld, slurmd, slurm-client) and munge from Debian"
    as_root apt-get update -qq
    as_root apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
fi

# Any other torch spec would pull several GB of CUDA packages on this kind of machine.
if ! "$PYTHON" -c 'import torch' 2>/dev/null; then
    say "torch 2.13.0 (CPU)"
    "$PYTHON" -m pip install -q torch==2.13.0
fi

# mpi4py must be compiled against the same MPI as the mpirun on PATH, or mpirun -np N starts
# N unrelated singletons.  A wheel built for another MPI is replaced.
if ! "$PYTHON" -c 'from mpi4py import MPI; import sys; sys.exit("Open MPI v4" not in MPI.Get_library_version())' 2>/dev/null; then
    say "mpi4py, compiled against $(command -v mpicc)"
    MPICC=/usr/bin/mpicc "$PYTHON" -m pip install -q --force-reinstall --no-binary mpi4py --no-deps "mpi4py>=4.1,<5"
fi

if ! "$PYTHON" -c 'import psrt, pytest, xdist, sklearn, matplotlib, expecttest, tensorboard' 2>/dev/null; then
    say "psrt (editable) with its test extras"
    "$PYTHON" -m pip install -q -e '.[test]'
fi
# HF Accelerate, transformers and Lightning (docs/tutorials/own-code.md, "Frameworks":
# tests/mpi/test_frameworks.py runs them on the psrt backend).  PSRT_WITH_FRAMEWORKS=0 leaves them out.
if [ "${PSRT_WITH_FRAMEWORKS:-1}" != 0 ] && ! "$PYTHON" -c 'import accelerate, transformers, lightning' 2>/dev/null; then
    say "accelerate, transformers and lightning"
    "$PYTHON" -m pip install -q -e '.[frameworks]'
fi
# The documentation site (make docs) and its browser test (tests/docs): MkDocs with the Material
# theme, and Debian's Chromium.  PSRT_WITH_DOCS=0 leaves them out; make docs asks only for MkDocs.
if [ "${PSRT_WITH_DOCS:-1}" != 0 ] && ! "$PYTHON" -c 'import mkdocs, material' 2>/dev/null; then
    say "mkdocs and mkdocs-material"
    "$PYTHON" -m pip install -q -e '.[docs]'
fi
if [ "${PSRT_WITH_DOCS:-1}" = 1 ] && [ "${PSRT_WITH_BROWSER:-1}" != 0 ] && ! command -v chromium >/dev/null; then
    say "Chromium from Debian, for the documentation's browser test"
    as_root apt-get update -qq
    as_root apt-get install -y -qq chromium >/dev/null
fi
# Horovod, for --dp horovod and the bench's horovod peer: built from source (about 10 minutes
# the first time, from pip's wheel cache afterwards).  PSRT_WITH_HOROVOD=0 leaves it out.
if [ "${PSRT_WITH_HOROVOD:-1}" != 0 ]; then
    PYTHON="$PYTHON" bash scripts/install_horovod.sh
fi
say "ready: $("$PYTHON" -c 'from mpi4py import MPI; import torch, psrt; print("psrt", psrt.__version__, "| torch", torch.__version__, "|", MPI.Get_library_version().split(",")[0])')"
