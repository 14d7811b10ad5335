#!/usr/bin/env bash
# One GPU call (~4 min), written in session 22 (not run yet): issue 5's sparse decode, the
# head-major attention launch again. Run 79 had 2 stages x 2 blocks per step 4-7 us faster
# than 3 x 1 for the attention alone (4 of 4 timings); run 83's whole-call rounds (22-81 us)
# could not resolve it. This re-times the attention alone for the old and new launch and two
# neighbours (8 warps), then the whole call with the fastest against jattn's default (now the
# new launch) and dense. The two _ct rows read the same kept blocks from a contiguous copy
# (same arithmetic, bit-identical to their config): if they read much faster than the
# scattered rows, the placement of the blocks (address translation, DRAM pages) is the cost,
# not the kernel's loop. Outputs under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_SWEEP:-300} python3 experiments/probe_sparse_decode.py --hnd --repeat 10 \
  --attend-configs ${CONFIGS:-s33_w4_st3_b1,s33_w4_st2_b2,s33_w8_st2_b2,s33_w8_st3_b1,s16_w8_st2_b2,s33_w4_st3_b1_ct,s33_w4_st2_b2_ct} \
  --out "$OUT/sparse_decode_hnd_launch_retime.json" > "$OUT/sparse_decode_hnd_launch_retime.txt" 2>&1
echo "hnd launch re-time rc=$?"
grep -E "^  (dense|sparse|sparse_best) |re-timed|sparse_best =" \
  "$OUT/sparse_decode_hnd_launch_retime.txt" | cut -c1-220 | tail -10
