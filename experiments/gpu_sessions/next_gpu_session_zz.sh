#!/usr/bin/env bash
# One GPU call (~6 min), written in session 24: the new head-major sparse decode defaults
# (search_loop="early" for the bit search, prefetch_ids in _HND_TRITON_LAUNCH; run 90 timed
# both as options) by device kernel trace, with the attention's grid around them, then the
# causal window 512's neighbours at P = 2 (next_gpu_session_zy.sh).
# (0) the sparse decode GPU tests (head-major vs nhd, the options bit-identical);
# (1) layout probe: dense_nhd, sparse_hnd (new defaults), the full 32-step search as an A/B
#     (sparse_hnd_unrolled), and splits:stages:blocks rows, all with prefetched ids;
# (2) next_gpu_session_zy.sh.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_TESTS:-150} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider -o addopts="" \
  tests/test_sparse_decode_layout.py > "$OUT/gpu_tests_sparse_decode_layout.txt" 2>&1
echo "GPU tests rc=$?"; tail -2 "$OUT/gpu_tests_sparse_decode_layout.txt"
timeout ${T_LAYOUT:-200} python3 experiments/probe_sparse_decode_layout.py --calls 1,4 \
  --rounds ${ROUNDS:-2} --skip sparse_nhd,dense_hnd --hnd-select unrolled \
  --hnd-grid ${GRID:-16:3:1:p,16:2:2:p,24:2:2:p,24:3:1:p,33:3:1:p,33:2:2} \
  --kernel-trace ${CALLS:-32} \
  --out "$OUT/sparse_decode_defaults_trace.json" > "$OUT/sparse_decode_defaults_trace.txt" 2>&1
echo "layout probe rc=$?"; grep -v Warn "$OUT/sparse_decode_defaults_trace.txt" | grep "rel_err\|by kernel_program" | cut -c1-500
grep "program)" "$OUT/sparse_decode_defaults_trace.txt" | cut -c1-230
T_WINDOW=${T_WINDOW:-220} bash experiments/gpu_sessions/next_gpu_session_zy.sh
