#!/usr/bin/env bash
# One GPU call (~7-8 min; run tool timeout_s 600), written in session 15 for session 16: the
# never-run GPU tests of session 15's code (head-major sparse and dense decode, the
# selection-inside-attention sparse decode), then issue 5's sparse decode 3x through the
# head-major API (probe_sparse_decode_layout.py: dense/sparse in both layouts, distinct q per
# call) and the fused selection with its search as one loop (--rolled: helper 42's
# instruction-fetch hypothesis for run 35's ~20 us prologue). Outputs under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
for f in test_sparse_decode_layout test_decode_layout test_sparse_decode_fused_select; do
  timeout ${T_TESTS:-100} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider \
    -o addopts="" tests/$f.py > "$OUT/gpu_tests_$f.txt" 2>&1
  echo "$f rc=$?"; tail -2 "$OUT/gpu_tests_$f.txt"
done
timeout ${T_LAYOUT:-200} python3 experiments/probe_sparse_decode_layout.py --calls 1,4 \
  --out "$OUT/h200_sparse_decode_layout_api.json" > "$OUT/sparse_decode_layout_api.txt" 2>&1
echo "layout probe rc=$?"; grep -v Warn "$OUT/sparse_decode_layout_api.txt" | tail -10
timeout ${T_FUSED:-170} python3 experiments/probe_sparse_decode_fused_select.py --calls 1,4 \
  --rolled --out "$OUT/h200_sparse_decode_fused_rolled.json" > "$OUT/sparse_decode_fused_rolled.txt" 2>&1
echo "fused probe rc=$?"; grep -v Warn "$OUT/sparse_decode_fused_rolled.txt" | tail -8
