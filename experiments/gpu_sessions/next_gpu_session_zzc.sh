#!/usr/bin/env bash
# One GPU call (~3 min), written in session 24 after run 93 (the one-launch kernel was slower:
# 46.6-57.8 us against 43.7 for the two-launch default): the head-major Triton default now
# runs 3 stages of 1 block with prefetched ids and one program per SM (16 splits at B1 with 8
# kv heads; runs 90-93: 0.3-0.45 us less than 33 splits of 2 x 2 blocks in each run). Its GPU
# tests, then the layout probe twice (two processes) by device kernel trace: dense decode on
# both layouts, the new default, and the previous one (33:2:2:p).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_TESTS:-150} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider -o addopts="" \
  tests/test_sparse_decode_layout.py > "$OUT/gpu_tests_layout.txt" 2>&1
echo "GPU tests rc=$?"; tail -2 "$OUT/gpu_tests_layout.txt"
for i in 1 2; do
  timeout ${T_LAYOUT:-150} python3 experiments/probe_sparse_decode_layout.py --calls 1,4 \
    --rounds 1 --skip sparse_nhd --hnd-grid 33:2:2:p --kernel-trace ${CALLS:-32} \
    --out "$OUT/sparse_decode_final_$i.json" > "$OUT/sparse_decode_final_$i.txt" 2>&1
  echo "layout probe $i rc=$?"; grep -v Warn "$OUT/sparse_decode_final_$i.txt" | grep "rel_err" | cut -c1-200
  grep "program)" "$OUT/sparse_decode_final_$i.txt" | cut -c1-200
done
