#!/usr/bin/env bash
# One short GPU call, session 24: the head-major Triton default on Hopper is now 3 stages of 2
# blocks with prefetched ids, one program per SM (runs 96-97: 42.0-42.2 us per call by kernel
# sums, 3.00-3.02x dense). Its GPU tests (the API default compiled, against "nhd" and the
# reference), then one layout probe: dense, the new default and the previous (16:3:1:p).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_TESTS:-80} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider -o addopts="" \
  tests/test_sparse_decode_layout.py > "$OUT/gpu_tests_layout.txt" 2>&1
echo "GPU tests rc=$?"; tail -2 "$OUT/gpu_tests_layout.txt"
timeout ${T_LAYOUT:-90} python3 experiments/probe_sparse_decode_layout.py --calls 1,4 --rounds 1 \
  --skip sparse_nhd,dense_hnd --hnd-grid 16:3:1:p --kernel-trace 32 \
  --out "$OUT/sparse_decode_sm90_default.json" > "$OUT/sparse_decode_sm90_default.txt" 2>&1
echo "layout probe rc=$?"; grep -v Warn "$OUT/sparse_decode_sm90_default.txt" | grep "rel_err\|program)" | cut -c1-170
