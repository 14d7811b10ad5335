#!/usr/bin/env bash
# One GPU call (~4 min), written in session 22, trimmed in session 23 (not run yet): what the
# causal window 512 still spends (1.393x its tile sum in run 89; gate 1.2x): ncu of the window
# forward with the H200 entry (128-key tiles, the overlap, two query tiles per program since
# run 85): details + SASS page, read here by regions (experiments/ncu_sass_regions.py) against
# run 52's (masked bodies ~900 instructions at 5x the samples per execution of the full body).
# Outputs under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
CASES=window T_CASE=${T_CASE:-200} bash experiments/gpu_sessions/next_gpu_session_p.sh
[ -f "$OUT/ncu_fwd_window_sass.csv.gz" ] && python3 experiments/ncu_sass_regions.py \
  "$OUT/ncu_fwd_window_sass.csv.gz" --kernel 0 | cut -c1-170 | head -24
# (session 23: the 1 / 2 / 4 query-tile sweep ran as run 85, next_gpu_session_zr.sh; the entry
# now takes 2, and the profile above is of it)
