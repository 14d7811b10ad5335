#!/usr/bin/env bash
# One GPU call (~3-4 min), written in session 20 (not run yet): issue 5's sparse decode after
# the head-major path stopped repeating lengths in XLA (lengths_group, 30bc367). Device slopes
# (programs of 1 and 4 calls, each call its own query, 7 interleaved rounds), as runs 36-48:
# dense decode on the default and the head-major cache, sparse on the head-major cache, and
# the one-launch scores + selection (fused_select). Runs 36/40/42/48 gave 2.96x / 3.07x / 2.79x
# / 2.78x (median 2.88x); issue 5 asks 3x. Outputs under $OUT; the summary is printed.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_LAYOUT:-230} python3 experiments/probe_sparse_decode_layout.py --calls 1,4 --rounds ${ROUNDS:-7} \
  --skip sparse_nhd --hnd-fused --out "$OUT/h200_sparse_decode_layout_lengths_group.json" \
  > "$OUT/sparse_decode_layout_lengths_group.txt" 2>&1
echo "layout probe rc=$?"; grep -v Warn "$OUT/sparse_decode_layout_lengths_group.txt" | tail -10
