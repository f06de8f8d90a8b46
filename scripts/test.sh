#!/usr/bin/env bash
# Run psrt's whole test suite (multi-rank tests launch mpirun themselves).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# Open MPI refuses root unless told; CI runs as root.  Oversubscription: Open MPI 4 reads the
# first variable, Open MPI 5 (PRRTE) the second.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
# The suite starts thousands of interpreters (ranks, launchers, commands), and each compiled the
# psrt modules it imports from source where the environment forbids bytecode caches: let Python
# keep them (__pycache__/, ignored by git).
unset PYTHONDONTWRITEBYTECODE
# Ranks that wait in a blocking MPI call spin on sched_yield(2), which the suite makes a short
# sleep (tests/idle_sleep.c says why); without a C compiler the suite runs as it is.
SHIM=build/idle_sleep.so
if [ ! -e "$SHIM" ] || [ tests/idle_sleep.c -nt "$SHIM" ]; then
    mkdir -p build
    ${CC:-cc} -O2 -shared -fPIC -o "$SHIM" tests/idle_sleep.c 2>/dev/null \
        || echo "test.sh: no C compiler: waiting ranks spin (the suite takes longer)" >&2
fi
if [ -e "$SHIM" ]; then
    export LD_PRELOAD="$PWD/$SHIM${LD_PRELOAD:+:$LD_PRELOAD}"
fi
# Side by side on PSRT_TEST_WORKERS workers (pytest-xdist; tests/conftest.py says which tests
# share a worker): most of a multi-rank test's time is spent waiting (timeouts, Slurm's
# heartbeats, a rank's start), which another worker's test fills.  `-n 0` runs them one by one.
WORKERS=${PSRT_TEST_WORKERS:-3}
SIDE=()
if [ "$WORKERS" -gt 1 ] && "$PYTHON" -c 'import xdist' 2>/dev/null; then
    SIDE=(-n "$WORKERS" --dist loadgroup)
fi
exec "$PYTHON" -m pytest -q --durations=30 "${SIDE[@]}" "$@"
