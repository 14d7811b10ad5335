#!/usr/bin/env bash
# One GPU call (~2.5 min), session 25, after run 102 (the selection costs ~5 us whether one
# program per kv head runs it after the scores or every attention program does): fewer warps
# for the scores + selection kernel (its ~17 dependent reductions cross fewer warps; 1 warp:
# no CTA barrier), with smaller score tiles so the [chunk, 128] fp32 tile fits the registers;
# and the packed 2-trial kary search at 2 warps. The layout probe twice, device kernel trace.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
for i in 1 2; do
  timeout ${T_LAYOUT:-200} python3 experiments/probe_sparse_decode_layout.py --calls 1,4 \
    --rounds 1 --skip sparse_nhd,dense_hnd \
    --hnd-select early/8c32,early/2,early/2c32,early/1c16,kary:2/2c32 --kernel-trace 32 \
    --out "$OUT/sparse_decode_warps_$i.json" > "$OUT/sparse_decode_warps_$i.txt" 2>&1
  echo "layout probe $i rc=$?"; grep -v Warn "$OUT/sparse_decode_warps_$i.txt" | grep "rel_err\|program)\|FAILED" | cut -c1-200
done
