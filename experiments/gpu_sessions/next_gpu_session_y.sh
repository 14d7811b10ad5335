#!/usr/bin/env bash
# One GPU call (~4-5 min), written in session 19: issue 5's sparse decode by per-kernel device
# time (Nsight Compute, clocks unlocked, only the cuProfilerStart/Stop range), B1 S128K GQA 32:8
# D128, 64-token blocks, top 19%, head-major cache. Run 67 (session 19) gave dense 133.2 us per
# call (jattn_decode 123.3 + 4 XLA merge kernels 9.4 + the lengths broadcast 1.9) against sparse
# 50.0 (attention 33.9, selection 8.3, scores 5.7, lengths broadcast 1.8): 2.66x by kernel sums.
# The selection (8 programs, the 32-step bit search) is the outlier; this call times its radix
# forms (digit_bits 2 / 4: 16 / 8 passes, the same selection) and the one-launch scores +
# selection (fused_select), each row's output checked against the fp32 reference. Outputs
# under $OUT; summaries printed.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
CALLS=${CALLS:-8}
for v in "dense_hnd 1" "sparse_hnd 1" "sparse_hnd 2" "sparse_hnd 4" "sparse_hnd 1 --fused-select" \
         "sparse_hnd 2 --fused-select"; do
  set -- $v
  name="$1_r$2${3:+_fused}"
  timeout ${T_ROW:-70} $NCU --target-processes all --profile-from-start off --clock-control none \
    --metrics gpu__time_duration.sum --csv \
    python3 experiments/ncu_sparse_decode.py --row $1 --digit-bits $2 ${3:-} --calls $CALLS \
    > "$OUT/ncu_$name.csv" 2> "$OUT/ncu_$name.err"
  echo "$name rc=$?"; grep -h "rel err" "$OUT/ncu_$name.csv" "$OUT/ncu_$name.err" | head -2
  python3 experiments/ncu_sparse_decode.py --summarize "$OUT/ncu_$name.csv" --calls $CALLS \
    | tee "$OUT/summary_$name.txt" | head -8
done
