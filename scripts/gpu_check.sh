#!/usr/bin/env bash
# The GPU check: every CUDA test and a short GPU training run beside the CPU's, in one go on a
# machine with a GPU and nothing installed beyond python3, torch and mpi4py (the checkout on
# PYTHONPATH).  Prints one table at the end; exits non-zero if a test failed.
#   bash scripts/gpu_check.sh            # about 3-6 minutes
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
PY=${PYTHON:-python3}
OUTDIR=${OUT:-$(mktemp -d)}
LOG="$OUTDIR/gpu_check.log"
say() { printf '%s\n' "$*" | tee -a "$LOG"; }

say "gpu_check: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1)"
say "gpu_check: $($PY -c 'import torch; from mpi4py import MPI; print("torch", torch.__version__, "| cuda", torch.version.cuda, "|", MPI.Get_library_version().split(",")[0].strip())')"

# 1. every CUDA test (the CPU-only ones skip themselves on a GPU-less machine, never here)
timeout 300 "$PY" -m pytest -q -p no:cacheprovider -rs tests/mpi/test_cuda.py tests/unit/test_device.py \
    tests/unit/test_staged.py \
    2>&1 | tee -a "$LOG" | tail -25
tests=${PIPESTATUS[0]}

# 2. the same training on the CPU and on the GPU, 2 ranks sharing the device
row() {   # device strategies -> "dp samples/s loss" per strategy
    local dev=$1 dps=$2 m="$OUTDIR/train_$1.jsonl"
    timeout 120 mpirun -np 2 --bind-to none "$PY" -m psrt.train --device "$dev" --dp "$dps" --steps 30 \
        --quiet --metrics "$m" >>"$LOG" 2>&1 || { echo "$dps run-failed"; return; }
    for dp in ${dps//,/ }; do
        "$PY" - "$OUTDIR/train_$dev.$dp.jsonl" "$dp" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
s = next(r for r in rows if r.get("summary"))
print(sys.argv[2], f"{s['samples_per_s']:.0f}", f"{s['train_loss']:.4f}")
PYEOF
    done
}
DPS=ps,ring,zero3,torch
row cpu $DPS >"$OUTDIR/cpu.txt"
row cuda $DPS >"$OUTDIR/cuda.txt"

# 3. CUDA collectives: staged (or CUDA-aware) psrt beside torch.distributed and the model
timeout 150 mpirun -np 2 --bind-to none "$PY" -m psrt.bench collectives --device cuda \
    --sizes 1MiB,16MiB,64MiB --algorithms ring,native,auto,torch --repeats 3 --warmup 1 \
    >"$OUTDIR/bench.txt" 2>>"$LOG" || echo "gpu bench failed" >>"$OUTDIR/bench.txt"
#    and ZeRO's two collectives, staged in columns of every rank's segment (a run of its own, so
#    that a failure there leaves the all-reduce rows above)
timeout 120 mpirun -np 2 --bind-to none "$PY" -m psrt.bench collectives --device cuda \
    --collective reduce_scatter,allgather --sizes 16MiB,64MiB --algorithms ring,native,torch \
    --repeats 3 --warmup 1 >>"$OUTDIR/bench.txt" 2>>"$LOG" || echo "gpu bench (zero) failed" >>"$OUTDIR/bench.txt"
# 4. the MoE all-to-all on CUDA: psrt's pairwise exchange, pipelined through host slots where
#    the MPI is not CUDA-aware, beside MPI_Alltoallv on a whole staged copy (x native)
timeout 90 mpirun -np 2 --bind-to none "$PY" -m psrt.bench moe --device cuda --sizes 1MiB,16MiB,64MiB \
    --steps 0 --repeats 3 >>"$OUTDIR/bench.txt" 2>>"$LOG" || echo "moe bench failed" >>"$OUTDIR/bench.txt"
# 5. a pipeline's activations: tensors through the pipeline's sends, staged in pieces where the
#    MPI is not CUDA-aware, beside the same bytes through MPI from host memory
for dev in "" cuda; do
    timeout 60 mpirun -np 2 --bind-to none "$PY" -m psrt.bench pingpong --sizes 1MiB,16MiB,64MiB --repeats 3 \
        ${dev:+--device $dev} >>"$OUTDIR/bench.txt" 2>>"$LOG" || echo "pingpong ${dev:-host} failed" >>"$OUTDIR/bench.txt"
done
# 6. torch DDP on psrt's backend vs on gloo, a 25M-parameter MLP (100 MiB of gradients) on the GPU,
#    with the staged sums on the host and then on the GPU (PSRT_STAGED_REDUCE), each beside gloo
for side in host gpu; do
    PSRT_STAGED_REDUCE=$side timeout 150 mpirun -np 2 --bind-to none -x PSRT_STAGED_REDUCE "$PY" -m psrt.bench c10d \
        --device cuda --grad-mb 100 --rounds 2 --steps 2 --quiet --json "$OUTDIR/c10d_$side.json" >>"$LOG" 2>&1 \
        || echo "c10d bench ($side sums) failed" >>"$OUTDIR/bench.txt"
    [ -f "$OUTDIR/c10d_$side.json" ] && "$PY" - "$OUTDIR/c10d_$side.json" "$side" >>"$OUTDIR/bench.txt" 2>&1 <<'PYEOF'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    print(f"c10d ({sys.argv[2]} sums) {r['way']:<22} {r['step_s'] * 1e3:8.1f} ms  x gloo {r['vs_gloo']:.2f}")
for g in d["goals"]:
    print(f"goal ({sys.argv[2]} sums) {g['status']}: {g['goal']}: {g['value']}")
PYEOF
done

say ""
say "gpu_check summary"
say "$(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$LOG" | tail -1)"
printf '%-10s %14s %14s %10s %12s %12s\n' strategy "cpu samples/s" "gpu samples/s" "gpu/cpu" "cpu loss" "gpu loss" | tee -a "$LOG"
join <(sort "$OUTDIR/cpu.txt") <(sort "$OUTDIR/cuda.txt") | while read -r dp cs cl gs gl; do
    printf '%-10s %14s %14s %10s %12s %12s\n' "$dp" "$cs" "$gs" "$(awk -v a="$gs" -v b="$cs" 'BEGIN{printf "%.2fx", a/b}')" "$cl" "$gl"
done | tee -a "$LOG"
say ""
say "$(cat "$OUTDIR/bench.txt")"
exit "$tests"
