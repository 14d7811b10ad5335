#!/usr/bin/env bash
# One GPU call (~5 min), written in session 21 (not run yet): issue 5's sparse decode on the
# head-major cache, the attention kernel's launch configs. Run 23 swept them on the default
# ("nhd") cache, where a 64-token block is 64 rows 2 KB apart; the head-major path reads each
# block as 16 KB contiguous, so the best config may differ. probe_sparse_decode.py --hnd runs
# every row as jattn's kv_layout="hnd" does (batch x kv heads sequences of one head); the
# attention alone per config (device slopes, every config checked against the default's
# output), then the whole call with the fastest (sparse_best) against dense and the default
# (issue 5: 3x dense decode; runs 36-75: 2.43-3.07x). Outputs under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_SWEEP:-400} python3 experiments/probe_sparse_decode.py --hnd --repeat 10 \
  --attend-configs ${CONFIGS:-s33_w4_st3_b1,s33_w4_st4_b1,s33_w8_st3_b1,s33_w4_st3_b2,s16_w4_st3_b2,s16_w4_st4_b2,s66_w4_st3_b1,s33_w4_st2_b2} \
  --out "$OUT/sparse_decode_hnd_attend_sweep.json" > "$OUT/sparse_decode_hnd_attend_sweep.txt" 2>&1
echo "hnd attend sweep rc=$?"
grep -E "^  (dense|sparse|sw_|sparse_best) |re-timed|summary|sparse_best =" \
  "$OUT/sparse_decode_hnd_attend_sweep.txt" | cut -c1-200 | tail -16
