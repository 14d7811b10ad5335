#!/usr/bin/env bash
# One short GPU call (~1 min; the end of session 25's budget): next_gpu_session_zzm.sh's
# layout probe only (the API default, whose sm90 launch now merges in a second kernel,
# against the previous default 16:3:2:p with the in-kernel merge), device kernel trace.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_LAYOUT:-85} python3 experiments/probe_sparse_decode_layout.py --calls 1,4 \
  --rounds 1 --skip sparse_nhd,dense_hnd --hnd-grid 16:3:2:p --kernel-trace 32 \
  --out "$OUT/sparse_decode_merge_kernel.json" > "$OUT/sparse_decode_merge_kernel.txt" 2>&1
echo "layout probe rc=$?"; grep -v Warn "$OUT/sparse_decode_merge_kernel.txt" | grep "rel_err\|program)\|FAILED\|by kernel" | cut -c1-220
