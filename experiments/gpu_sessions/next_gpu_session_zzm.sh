#!/usr/bin/env bash
# One GPU call (~2 min), session 25, after run 105 (the in-kernel merge added ~4.3 us to the
# sparse attention kernel; partials + the merge kernel 28.3 + 1.9): the sm90 head-major
# launch now merges in a second kernel (merge_kernel=True). (0) the head-major GPU tests
# through the API (now with it); (1) the layout probe once: the API default against the
# previous default (16:3:2:p, in-kernel merge) and the 3 x 1 launch both ways.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_TESTS:-80} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider -o addopts="" \
  tests/test_sparse_decode_layout.py -k "hnd" > "$OUT/gpu_tests.txt" 2>&1
echo "GPU tests rc=$?"; tail -3 "$OUT/gpu_tests.txt"
timeout ${T_LAYOUT:-100} python3 experiments/probe_sparse_decode_layout.py --calls 1,4 \
  --rounds 1 --skip sparse_nhd,dense_hnd --hnd-grid 16:3:2:p,16:3:1:pk,16:3:1:p --kernel-trace 32 \
  --out "$OUT/sparse_decode_merge_kernel.json" > "$OUT/sparse_decode_merge_kernel.txt" 2>&1
echo "layout probe rc=$?"; grep -v Warn "$OUT/sparse_decode_merge_kernel.txt" | grep "rel_err\|program)\|FAILED" | cut -c1-220
