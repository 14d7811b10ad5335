#!/usr/bin/env bash
# One GPU call (~4-5 min), written in session 21 (not run yet): issue 5's sparse decode, an
# in-process A/B of lengths_group (session 20). Runs 73 / 75 timed the head-major call at 59 us
# against 49-56 us in runs 36-48, a spread larger than the 1.8 us the change should remove.
# Rows (device slopes, programs of 1 and 4 calls, distinct q per call, 11 interleaved rounds):
# dense decode (default cache), the head-major sparse call, the same with fused_select, and
# sparse_hnd_repeat (the pre-session-20 path: lengths repeated per kv head in XLA; checked
# bit-identical to sparse_hnd). Outputs under $OUT; the summary is printed.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_LAYOUT:-320} python3 experiments/probe_sparse_decode_layout.py --calls 1,4 \
  --rounds ${ROUNDS:-11} --skip sparse_nhd,dense_hnd --hnd-fused --hnd-repeat \
  --out "$OUT/sparse_decode_lengths_group_ab.json" > "$OUT/sparse_decode_lengths_group_ab.txt" 2>&1
echo "layout probe rc=$?"; grep -v Warn "$OUT/sparse_decode_lengths_group_ab.txt" | tail -10
