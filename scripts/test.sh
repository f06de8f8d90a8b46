#!/usr/bin/env bash
# Run psrt's whole test suite (multi-rank tests launch mpirun themselves).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# Open MPI refuses root unless told; CI runs as root.  Oversubscription: Open MPI 4 reads the
# first variable, Open MPI 5 (PRRTE) the second.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
exec "$PYTHON" -m pytest -q --durations=30 "$@"
