#!/usr/bin/env bash
# One GPU call (~5 min), written in session 22 (not run yet): issue 5's sparse decode judged by
# device kernel time, not by whole-call slopes (run 83's rounds spread 22-81 us for a 58 us
# call). probe_sparse_decode_layout.py --kernel-trace: each row's kernels from a profiler
# trace of 32 calls (experiments/kernel_trace.py, CUPTI: every kernel's device start/end, no
# replay, no ncu), per call: the kernel sum (launch gaps excluded, as run 67's ncu sums gave
# 2.66x) and the span (gaps included), with the dense / row ratios; the slopes too (5 rounds).
# Rows: dense (default cache), head-major sparse (session 22's launch), the previous launch,
# fused_select. Outputs under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_LAYOUT:-360} python3 experiments/probe_sparse_decode_layout.py --calls 1,4 \
  --rounds ${ROUNDS:-5} --skip sparse_nhd,dense_hnd --hnd-launch 3:1 --hnd-fused \
  --kernel-trace ${CALLS:-32} \
  --out "$OUT/sparse_decode_kernel_trace.json" > "$OUT/sparse_decode_kernel_trace.txt" 2>&1
echo "kernel trace probe rc=$?"; grep -v Warn "$OUT/sparse_decode_kernel_trace.txt" | tail -12 | cut -c1-260
