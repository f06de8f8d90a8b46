#!/usr/bin/env bash
# What a GPU machine without a package registry needs beyond python3, torch and mpi4py, made
# on a machine that has one, into .gpu/ (ignored by git; carry it with the checkout):
#
#   .gpu/impi/     Intel MPI's runtime (PyPI `impi-rt`), pruned to what a one-host job uses:
#                  mpiexec.hydra and its proxies, libmpi.so.12, the GPU reduction kernels
#                  (opt/mpi/etc/coll.fatbin) and the generic shared-memory tuning file
#   .gpu/wheels/   mpi4py's PyPI wheels (MPI-ABI builds: they load Intel MPI's libmpi through
#                  MPI4PY_LIBMPI) for the Pythons in PSRT_BUNDLE_PYTHONS
#
# Intel MPI is the CUDA-aware MPI that installs without a compiler: it loads libcuda at run
# time and sums device buffers with its own kernels (I_MPI_OFFLOAD=1, I_MPI_OFFLOAD_MODE=cuda).
# The full wheel is 129 MB; what is kept comes to about 34 MB.  `impi-rt` is installed with
# no dependencies: its libfabric is for networks, not needed with I_MPI_FABRICS=shm.
# scripts/with_mpi.sh impi runs a command on it; scripts/gpu_check.sh uses it when present.
#
#   bash scripts/gpu_bundle.sh             # about 10 s on a fast link
# Environment: PSRT_BUNDLE_PYTHONS (default "311 312": this machine's and the GPU machine's),
# PSRT_IMPI_VERSION (default 2021.19.0), PSRT_MPI4PY_VERSION (default 4.1.2).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST=$ROOT/.gpu
IMPI=${PSRT_IMPI_VERSION:-2021.19.0}
MPI4PY=${PSRT_MPI4PY_VERSION:-4.1.2}
PYTHONS=${PSRT_BUNDLE_PYTHONS:-311 312}
PYTHON=${PYTHON:-python3}
say() { printf 'gpu_bundle: %s\n' "$*" >&2; }
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

say "downloading impi-rt $IMPI (129 MB) and mpi4py $MPI4PY for cp${PYTHONS// /, cp}"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: "${PLATFORMS[@]}" -d "$TMP" "impi-rt==$IMPI"
for v in $PYTHONS; do
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: "${PLATFORMS[@]}" --python-version "$v" \
        --implementation cp -d "$TMP/wheels" "mpi4py==$MPI4PY"
done

say "keeping what a one-host job needs"
rm -rf "$DEST.new"
mkdir -p "$DEST.new/impi" "$DEST.new/wheels"
(cd "$TMP" && "$PYTHON" -m zipfile -e impi_rt-*.whl unpacked)
DATA=$(echo "$TMP"/unpacked/impi_rt-*.data/data)
KEEP=(bin/mpiexec.hydra bin/hydra_pmi_proxy bin/hydra_bstrap_proxy lib/libmpi.so.12
      opt/mpi/etc/coll.fatbin opt/mpi/etc/tuning_generic_shm.dat
      share/doc/mpi/licensing/license.txt share/doc/mpi/licensing/third-party-programs.txt)
for f in "${KEEP[@]}"; do
    [ -f "$DATA/$f" ] || { say "impi-rt $IMPI has no $f: this script knows $IMPI's layout only"; exit 1; }
    mkdir -p "$DEST.new/impi/$(dirname "$f")"
    cp "$DATA/$f" "$DEST.new/impi/$f"
done
chmod +x "$DEST.new"/impi/bin/*
ln -s mpiexec.hydra "$DEST.new/impi/bin/mpiexec"
ln -s mpiexec.hydra "$DEST.new/impi/bin/mpirun"
cp "$TMP"/wheels/*.whl "$DEST.new/wheels/"
echo "impi-rt $IMPI, mpi4py $MPI4PY (cp${PYTHONS// /, cp})" >"$DEST.new/VERSION"
rm -rf "$DEST"
mv "$DEST.new" "$DEST"
say "ready: $DEST ($(du -sh "$DEST" | cut -f1)): bash scripts/with_mpi.sh impi -- mpiexec -n 2 python ..."
