#!/usr/bin/env bash
# One GPU call (~5 min), session 22: issue 5's sparse decode with the head-major path's new
# Triton attention launch (jattn.sparse._HND_TRITON_LAUNCH: 2 stages of 2 blocks per step,
# from run 79's sweep) against the previous one (3 stages of 1 block, sparse_hnd_st3_b1) and
# dense decode, interleaved rounds in one process (device slopes, distinct q per call), plus
# fused_select with the new launch; the head-major GPU tests first. Outputs under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_TESTS:-60} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider -o addopts="" \
  tests/test_sparse_decode_layout.py > "$OUT/gpu_tests_hnd.txt" 2>&1
echo "hnd GPU tests rc=$?"; tail -1 "$OUT/gpu_tests_hnd.txt"
timeout ${T_LAYOUT:-300} python3 experiments/probe_sparse_decode_layout.py --calls 1,4 \
  --rounds ${ROUNDS:-9} --skip sparse_nhd,dense_hnd --hnd-launch 3:1 --hnd-fused \
  --out "$OUT/sparse_decode_hnd_launch_ab.json" > "$OUT/sparse_decode_hnd_launch_ab.txt" 2>&1
echo "layout probe rc=$?"; grep -v Warn "$OUT/sparse_decode_hnd_launch_ab.txt" | tail -10
