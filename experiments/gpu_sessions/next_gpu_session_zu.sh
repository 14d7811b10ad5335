#!/usr/bin/env bash
# One GPU call (~6 min), session 23, after run 86: (1) the bit-search selection with 8 / 16 / 32
# warps alone and fused with the scores (probe_decode_select.py, device kernel time); (2) the
# whole sparse decode call by kernel trace (run 86's trace died: 6.5 GB of HLO protos with the
# cache as a constant; kernel_trace.py now turns them off).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_SELECT:-120} python3 experiments/probe_decode_select.py --rows select_r1,fused_r1 \
  --out "$OUT/decode_select_trace.json" > "$OUT/decode_select_trace.txt" 2>&1
echo "select probe rc=$?"; grep -v Warn "$OUT/decode_select_trace.txt" | tail -12 | cut -c1-200
timeout ${T_LAYOUT:-300} python3 experiments/probe_sparse_decode_layout.py --calls 1,4 \
  --rounds ${ROUNDS:-3} --skip sparse_nhd,dense_hnd --hnd-launch 3:1 --hnd-fused \
  --kernel-trace ${CALLS:-32} \
  --out "$OUT/sparse_decode_kernel_trace.json" > "$OUT/sparse_decode_kernel_trace.txt" 2>&1
echo "kernel trace probe rc=$?"; grep -v Warn "$OUT/sparse_decode_kernel_trace.txt" | grep "device \|/ row" | cut -c1-400
grep "kernels" "$OUT/sparse_decode_kernel_trace.txt" | cut -c1-420
