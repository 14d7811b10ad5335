#!/usr/bin/env bash
# One GPU call (~5 min), session 23, after run 87: the head-major sparse decode with session 23's
# defaults (scores + selection in one launch, 8 selection warps) against dense decode, the
# three-launch call, and attention grids (splits:stages:blocks_per_step) by device kernel trace
# of the 4-call program (experiments/kernel_trace.py; the slopes too, 2 rounds).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_LAYOUT:-420} python3 experiments/probe_sparse_decode_layout.py --calls 1,4 \
  --rounds ${ROUNDS:-2} --skip sparse_nhd,dense_hnd --hnd-unfused \
  --hnd-grid ${GRID:-16:3:1,24:3:1,33:3:1,48:3:1} --kernel-trace ${CALLS:-32} \
  --out "$OUT/sparse_decode_kernel_trace.json" > "$OUT/sparse_decode_kernel_trace.txt" 2>&1
echo "kernel trace probe rc=$?"; grep -v Warn "$OUT/sparse_decode_kernel_trace.txt" | grep "rel_err\|device \|/ row" | cut -c1-500
grep "program)" "$OUT/sparse_decode_kernel_trace.txt" | cut -c1-330
