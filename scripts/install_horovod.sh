#!/usr/bin/env bash
# Build and install horovod 0.28.1 (the last release) against the installed torch and the
# Open MPI that /usr/bin/mpicc belongs to, for `--dp horovod` and the horovod bench peer.
#
# Why each setting (horovod 0.28.1 builds from source only):
# - torch >= 2.1 headers need C++17, but horovod's CMakeLists pin C++14
#   (CMakeLists.txt:19, horovod/torch/CMakeLists.txt:67), so a compiler wrapper rewrites
#   -std=c++14 into -std=c++17 and hands everything else to g++ unchanged;
# - --no-build-isolation: the extension must compile against the torch that is installed
#   (an isolated build would fetch another torch, several GB with CUDA);
# - CMake: the system's 3.x; a CMake 4 from PyPI rejects the bundled gloo's
#   cmake_minimum_required unless CMAKE_POLICY_VERSION_MINIMUM is set (set either way);
# - pip keeps the built wheel in its cache, so a second run (after an uninstall, or a fresh
#   virtualenv on the same machine) installs in seconds instead of rebuilding.
# Safe to run again: does nothing when horovod.torch imports and reports MPI built.
set -euo pipefail
cd "$(dirname "$0")/.."
# An absolute path: the build below puts MPI's bin directory first on PATH, which may hold
# another python3 (the system's).
PYTHON=$(command -v "${PYTHON:-python3}")
HOROVOD_VERSION=${HOROVOD_VERSION:-0.28.1}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

say() { printf 'install_horovod: %s\n' "$*" >&2; }

if "$PYTHON" -c 'import horovod.torch as hvd, sys; sys.exit(not hvd.mpi_built())' 2>/dev/null; then
    say "horovod $("$PYTHON" -c 'import horovod; print(horovod.__version__)') with MPI already installed"
    exit 0
fi

MPICC=${MPICC:-/usr/bin/mpicc}
[ -x "$MPICC" ] || { say "no $MPICC: run scripts/install.sh first (Open MPI from Debian)"; exit 2; }
"$PYTHON" -c 'import torch' 2>/dev/null || { say "torch is not installed: run scripts/install.sh first"; exit 2; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Pin the installed torch so no resolver step can replace it (horovod does not depend on
# torch, this is a guard).
"$PYTHON" -c 'import torch; print("torch==" + torch.__version__)' > "$work/constraints.txt"

# g++ with -std=c++14 turned into -std=c++17 (see above); every other argument passes through.
cat > "$work/cxx17" <<'EOF'
#!/usr/bin/env bash
args=()
for a in "$@"; do
    if [ "$a" = "-std=c++14" ]; then args+=("-std=c++17"); else args+=("$a"); fi
done
exec g++ "${args[@]}"
EOF
chmod +x "$work/cxx17"

# horovod's setup_requires (its runtime deps) must be present before a no-isolation build.
say "horovod's runtime dependencies"
"$PYTHON" -m pip install -q -c "$work/constraints.txt" cloudpickle psutil pyyaml packaging

# Build tools from Debian (CMake 3.25 and g++ 12 on Debian 12).
if ! command -v g++ >/dev/null || ! command -v cmake >/dev/null; then
    say "cmake and g++ from Debian"
    as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
    as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq cmake g++ >/dev/null
fi
cmake_bin=$(command -v /usr/bin/cmake || command -v cmake)

say "building horovod $HOROVOD_VERSION (or taking it from pip's wheel cache) against torch $("$PYTHON" -c 'import torch; print(torch.__version__)') and $("$MPICC" --showme:version 2>&1 | head -1) (a build takes 10-20 minutes on 2 cores)"
start=$(date +%s)
# /usr/bin first on PATH so CMake's FindMPI picks the same Open MPI as mpi4py and mpirun.
env PATH="$(dirname "$MPICC"):$PATH" MPICC="$MPICC" MPICXX="$(dirname "$MPICC")/mpicxx" \
    CC=gcc CXX="$work/cxx17" \
    HOROVOD_CMAKE="$cmake_bin" CMAKE_POLICY_VERSION_MINIMUM=3.5 \
    MAKEFLAGS="-j${HOROVOD_BUILD_JOBS:-$(nproc)}" \
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
    HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    "$PYTHON" -m pip install -q --no-build-isolation -c "$work/constraints.txt" \
        "horovod==$HOROVOD_VERSION"
say "installed in $(( $(date +%s) - start )) s"

# Check what was built, not only that it imports.
"$PYTHON" - <<'EOF'
import sys
import horovod
import horovod.torch as hvd
built = {"mpi": hvd.mpi_built(), "gloo": hvd.gloo_built()}
print(f"install_horovod: horovod {horovod.__version__} built with "
      + ", ".join(k for k, v in built.items() if v), file=sys.stderr)
sys.exit(0 if built["mpi"] else "install_horovod: horovod was built without MPI")
EOF
