#!/usr/bin/env bash
# One GPU call (~4-6 min), written in session 18 for session 19 (run 62 failed: it profiled from
# the start; session 19 switched to --profile-from-start off, not yet run): issue 5's sparse decode against
# dense decode (B1 S128K GQA 32:8 D128, 64-token blocks, top 19%) by per-kernel device time
# (experiments/ncu_sparse_decode.py: each row's calls between cuProfilerStart/Stop and two
# marker kernels; ncu with the clocks unlocked, one cheap metric). Kernel sums leave out the
# gaps between a call's kernels: report them next to the probe's slopes
# (experiments/probe_sparse_decode_layout.py), not instead. Outputs under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
CALLS=${CALLS:-8}
for row in ${ROWS:-dense_nhd dense_hnd sparse_hnd sparse_nhd}; do
  # only the cuProfilerStart/Stop range (run 62 profiled from the start: every XLA compile and
  # autotuning kernel went through ncu, the first row crashed (rc 139) and the next ones failed
  # with "Failed to prepare kernel for profiling"); the markers still cut the calls out
  timeout ${T_ROW:-100} $NCU --target-processes all --profile-from-start off --clock-control none \
    --metrics gpu__time_duration.sum --csv \
    python3 experiments/ncu_sparse_decode.py --row $row --calls $CALLS > "$OUT/ncu_$row.csv" 2> "$OUT/ncu_$row.err"
  echo "$row rc=$?"; grep -h "rel err" "$OUT/ncu_$row.csv" "$OUT/ncu_$row.err" | head -2
  python3 experiments/ncu_sparse_decode.py --summarize "$OUT/ncu_$row.csv" --calls $CALLS \
    | tee "$OUT/summary_$row.txt" | tail -6
done
