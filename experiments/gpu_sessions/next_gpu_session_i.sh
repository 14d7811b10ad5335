#!/usr/bin/env bash
# One GPU call (~5-6 min; run tool timeout_s 600), written in session 16 for session 17:
# (1) the nn GPU tests (tests/test_nn_layers.py -m gpu: all kinds and MLA, fp32/bf16), which now
# run MLA single-token decode absorbed on the Triton decode kernel (never run on a GPU);
# (2) issue 5's sparse decode on a head-major cache against dense decode in both layouts, 7
# rounds (run 36: 2.96x / 2.86x; run 40: 3.07x against dense nhd). Outputs under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_TESTS:-170} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider \
  -o addopts="" tests/test_nn_layers.py > "$OUT/gpu_tests_nn_layers.txt" 2>&1
echo "nn gpu tests rc=$?"; tail -3 "$OUT/gpu_tests_nn_layers.txt"
timeout ${T_LAYOUT:-230} python3 experiments/probe_sparse_decode_layout.py --calls 1,4 --rounds 7 \
  --skip sparse_nhd --out "$OUT/h200_sparse_decode_layout_hnd.json" > "$OUT/sparse_decode_layout_hnd.txt" 2>&1
echo "layout probe rc=$?"; grep -v Warn "$OUT/sparse_decode_layout_hnd.txt" | tail -8
