#!/usr/bin/env bash
# The GPU check: on a machine with one GPU and nothing installed beyond python3, torch,
# mpi4py and pytest, every CUDA test and every GPU goal in one go, under the machine's MPI
# (CUDA tensors staged through pinned host memory where it is not CUDA-aware) and, where
# scripts/gpu_bundle.sh's bundle travelled with the checkout (.gpu/), under Intel MPI's
# runtime (CUDA-aware: CUDA tensors straight to MPI).  Ends with one table of the goals, met or
# missed, each with its figure or a one-line reason (psrt/bench/gpu_goals.py).
#
#   bash scripts/gpu_check.sh              # about 5-7 minutes on one H100/H200, 16 cores
#
# Writes under $OUT (else a fresh temporary folder): gpu_check.log (every step's command,
# exit code and time), goals.txt (the table) and gpu_check/ (each step's log and figures).
# Exits non-zero if a test failed or a step did not finish.  PSRT_GPU_CHECK_DEVICE=cpu rehearses
# every step on a machine without a GPU (the CUDA tests then skip, the GPU rows say why).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
PY=${PYTHON:-python3}
DEV=${PSRT_GPU_CHECK_DEVICE:-cuda}     # cpu: the same steps on host tensors (a rehearsal without a GPU)
TOP=${OUT:-$(mktemp -d)}
DIR=$TOP/gpu_check
mkdir -p "$DIR/logs"
LOG=$TOP/gpu_check.log
: >"$LOG"
: >"$DIR/steps.txt"
say() { printf '%s\n' "$*" | tee -a "$LOG"; }

# step NAME SECONDS COMMAND...: run it with its output in logs/NAME.log; record its exit code
# and time in steps.txt (a step that runs out of time is killed, its row then says so).
step() {
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    say "[$(date +%T)] $name: $*"
    timeout -k 10 "$limit" "$@" >"$DIR/logs/$name.log" 2>&1
    rc=$?
    echo "$name $rc $((SECONDS - start))" >>"$DIR/steps.txt"
    say "[$(date +%T)] $name: exit $rc after $((SECONDS - start)) s"
    [ "$rc" = 0 ] || tail -5 "$DIR/logs/$name.log" | sed 's/^/    /' | tee -a "$LOG"
    return "$rc"
}

OPENMPI=(mpirun -np 2 --bind-to none)
NO_BUNDLE=200      # a step's code in steps.txt: not run, no Intel MPI bundle
BUNDLE=yes
[ -f .gpu/impi/lib/libmpi.so.12 ] || { BUNDLE=""; say "no Intel MPI bundle (.gpu/): its rows will say so (bash scripts/gpu_bundle.sh makes it)"; }
# impi_step NAME SECONDS COMMAND...: a step on Intel MPI (mpiexec, python and mpi4py its own)
impi_step() {
    if [ -n "$BUNDLE" ]; then
        local name=$1 limit=$2
        shift 2
        step "$name" "$limit" bash scripts/with_mpi.sh impi -- "$@"
    else
        echo "$1 $NO_BUNDLE 0" >>"$DIR/steps.txt"
    fi
}

say "gpu_check: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
say "gpu_check: $($PY -c 'import torch, mpi4py; from mpi4py import MPI; print("torch", torch.__version__, "| cuda", torch.version.cuda, "| mpi4py", mpi4py.__version__, "|", MPI.Get_library_version().split(",")[0].strip())')"
[ -n "$BUNDLE" ] && say "gpu_check: Intel MPI bundle: $(cat .gpu/VERSION)"

# 1. how CUDA tensors meet each MPI (psrt.info), then every CUDA test under each MPI side by
#    side (the tests time nothing): the machine's MPI runs them all; Intel MPI the ones that
#    hand CUDA tensors to a CUDA-aware MPI, and the training runs on it.
step info.openmpi 60 bash -c "${OPENMPI[*]} $PY -m psrt.info > $DIR/info.openmpi.txt"
impi_step info.impi 60 bash -c "mpiexec -n 2 $PY -m psrt.info > $DIR/info.impi.txt"
TESTS=(tests/mpi/test_cuda.py tests/unit/test_device.py tests/unit/test_staged.py)
PYTEST=("$PY" -m pytest -q -p no:cacheprovider --cold -rs -n 4)
step tests.openmpi 300 "${PYTEST[@]}" --junitxml="$DIR/tests.openmpi.xml" "${TESTS[@]}" &
impi_step tests.impi 300 "${PYTEST[@]}" --junitxml="$DIR/tests.impi.xml" tests/mpi/test_cuda.py &
wait

# 2. collectives on CUDA tensors, one job per MPI (timed alone): psrt's algorithms, auto and
#    torch.distributed's (gloo: the two ranks share one GPU, which NCCL refuses); staged runs
#    add each algorithm on host tensors, the pipelined model and the sums on the GPU; the
#    CUDA-aware run adds the same calls staged, compared element by element.
COLL=(-m psrt.bench collectives --device "$DEV" --collective allreduce,reduce_scatter,allgather
      --sizes 1MiB,16MiB,64MiB --algorithms ring,native,auto,torch --repeats 3 --warmup 1)
step collectives.openmpi 180 "${OPENMPI[@]}" "$PY" "${COLL[@]}" --json "$DIR/collectives.openmpi.json"
impi_step collectives.impi 180 mpiexec -n 2 "$PY" "${COLL[@]}" --json "$DIR/collectives.impi.json"

# 3. the pipeline's sends: host tensors, CUDA tensors staged, CUDA tensors on Intel MPI
PING=(-m psrt.bench pingpong --sizes 1MiB,16MiB,64MiB --repeats 3 --quiet)
step pingpong.host 60 "${OPENMPI[@]}" "$PY" "${PING[@]}" --json "$DIR/pingpong.host.json"
step pingpong.cuda 60 "${OPENMPI[@]}" "$PY" "${PING[@]}" --device "$DEV" --json "$DIR/pingpong.cuda.json"
impi_step pingpong.cuda-impi 60 mpiexec -n 2 "$PY" "${PING[@]}" --device "$DEV" --json "$DIR/pingpong.cuda-impi.json"

# 4. torch DDP on psrt's backend against gloo, a 25M-parameter MLP (100 MiB of gradients):
#    staged with the sums on the host, then on the GPU (PSRT_STAGED_REDUCE), then on Intel MPI
DDP=(-m psrt.bench c10d --device "$DEV" --grad-mb 100 --rounds 2 --steps 2 --quiet)
step c10d.host 120 env PSRT_STAGED_REDUCE=host "${OPENMPI[@]}" -x PSRT_STAGED_REDUCE "$PY" "${DDP[@]}" --json "$DIR/c10d.host.json"
step c10d.gpu 120 env PSRT_STAGED_REDUCE=gpu "${OPENMPI[@]}" -x PSRT_STAGED_REDUCE "$PY" "${DDP[@]}" --json "$DIR/c10d.gpu.json"
impi_step c10d.impi 120 mpiexec -n 2 "$PY" "${DDP[@]}" --json "$DIR/c10d.impi.json"

say ""
say "gpu_check goals ($(awk '{s += $3} END {print s}' "$DIR/steps.txt") s of steps; logs in $DIR/logs)"
"$PY" -m psrt.bench.gpu_goals "$DIR" | tee "$TOP/goals.txt" | tee -a "$LOG"
# non-zero when a step did not finish or a test failed (a missing bundle is not a failure)
! awk -v skip=$NO_BUNDLE '$2 != 0 && $2 != skip {bad = 1} END {exit !bad}' "$DIR/steps.txt"
