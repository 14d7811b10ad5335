#!/usr/bin/env bash
# One GPU call (~7 min), written in session 23 (not run yet): the early-exit bit search
# (search_loop="early": stop at the first trial counting exactly top_k keys; the same kept
# set, ~17 of 32 steps on continuous scores, CPU-tested against the full search, brute force
# and lax.top_k). Prediction: the selection alone 6.8 -> ~4-4.5 us (8 warps), fused scores +
# selection 10.4 -> ~8, the whole call 46.4 -> ~44 us by kernel sums (~2.94x dense).
# (0) the GPU tests of both (compiled: bit-identical to the default head-major call) and the
#     head-major vs nhd ones;
# (1) probe_decode_select.py: unrolled / rolled / early at 4, 8, 16 warps, alone and fused,
#     each checked equal to the default's indices and counts (device kernel time);
# (2) the whole head-major call with session 23's defaults against the same with
#     search_loop="early" (bit-identical output checked) and dense decode, by kernel trace.
# (3) in the same layout probe: the attention with each split's block ids loaded once before
#     its loop (prefetch_ids, ':p' rows; bit-identical to the default on the CPU). Session 14's CPU-compiled
#     TTGIR had each step wait on a scalar L2 load of its id before issuing its copies; at ~12
#     steps per program that could be the ~6 us by which the attention (34.5 us) exceeds the
#     dense kernel's per-SM rate. Prediction: 28-31 us for the attention, 2-6 us less per call.
# If early wins in both: make it _selection_params' default for digit_bits=1; if a ':p' row
# wins: add ("prefetch_ids", True) to jattn.sparse._HND_TRITON_LAUNCH (and try the nhd path).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_TESTS:-120} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider -o addopts="" \
  tests/test_sparse_decode_layout.py -k "prefetch_ids_and_early or hnd_equals_nhd" \
  > "$OUT/gpu_tests_prefetch_early.txt" 2>&1
echo "GPU tests rc=$?"; tail -2 "$OUT/gpu_tests_prefetch_early.txt"
timeout ${T_SELECT:-150} python3 experiments/probe_decode_select.py \
  --rows select_r1_wd_cd,select_r1_w8_cd,select_r1_w4_cd_early,select_r1_w16_cd_early,fused_r1_w8_cd \
  --out "$OUT/decode_select_early.json" > "$OUT/decode_select_early.txt" 2>&1
echo "select probe rc=$?"; grep -v Warn "$OUT/decode_select_early.txt" | tail -14 | cut -c1-200
timeout ${T_LAYOUT:-300} python3 experiments/probe_sparse_decode_layout.py --calls 1,4 \
  --rounds ${ROUNDS:-2} --skip sparse_nhd,dense_hnd --hnd-select early \
  --hnd-grid ${GRID:-33:2:2:p,33:3:1:p,48:3:1:p,16:3:1:p} --kernel-trace ${CALLS:-32} \
  --out "$OUT/sparse_decode_early_trace.json" > "$OUT/sparse_decode_early_trace.txt" 2>&1
echo "layout probe rc=$?"; grep -v Warn "$OUT/sparse_decode_early_trace.txt" | grep "rel_err\|by kernel_program" | cut -c1-400
grep "program)" "$OUT/sparse_decode_early_trace.txt" | cut -c1-260
