#!/usr/bin/env bash
# One GPU call (~8 min), session 23: issue 5's sparse decode by device kernel time
# (experiments/kernel_trace.py: CUPTI trace, no replay, no host timing).
# (1) probe_decode_select.py: the block-score kernel's launch variants and the selection's
#     (digit_bits 1/2/4 x num_warps x search_chunk; fused scores + selection), each alone on 8
#     distinct inputs in one program, checked equal to the defaults' outputs.
# (2) the whole call (probe_sparse_decode_layout.py --kernel-trace): dense (default cache),
#     head-major sparse (session 22's attention launch), the previous launch, fused_select;
#     kernel sums and spans from single calls and from the 4-call program.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_SELECT:-220} python3 experiments/probe_decode_select.py \
  --out "$OUT/decode_select_trace.json" > "$OUT/decode_select_trace.txt" 2>&1
echo "select probe rc=$?"; grep -v Warn "$OUT/decode_select_trace.txt" | tail -22 | cut -c1-200
timeout ${T_LAYOUT:-330} python3 experiments/probe_sparse_decode_layout.py --calls 1,4 \
  --rounds ${ROUNDS:-3} --skip sparse_nhd,dense_hnd --hnd-launch 3:1 --hnd-fused \
  --kernel-trace ${CALLS:-32} \
  --out "$OUT/sparse_decode_kernel_trace.json" > "$OUT/sparse_decode_kernel_trace.txt" 2>&1
echo "kernel trace probe rc=$?"; grep -v Warn "$OUT/sparse_decode_kernel_trace.txt" | grep -v "^sparse\|^dense" | tail -8 | cut -c1-400
grep "program)" "$OUT/sparse_decode_kernel_trace.txt" | cut -c1-300
