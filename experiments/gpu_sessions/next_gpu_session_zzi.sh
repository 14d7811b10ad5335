#!/usr/bin/env bash
# One GPU call (~4 min), session 25, after runs 99-100.
# (1) next_gpu_session_zs.sh: issue 8's decode point by device kernel trace, jax.nn cuDNN
#     against jattn's default (now the Triton partials + the Pallas merge kernel);
# (2) the sparse head-major call's cost against the kept share: the layout probe (dense_nhd
#     and the API's sparse_hnd only) at 10% and 38% of the blocks (run 100: 19%), so each
#     kernel's time = fixed + per-byte part can be fitted.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
T_TRACE=150 bash experiments/gpu_sessions/next_gpu_session_zs.sh
for frac in 0.10 0.38; do
  timeout ${T_LAYOUT:-100} python3 experiments/probe_sparse_decode_layout.py --calls 1,4 \
    --rounds 1 --skip sparse_nhd,dense_hnd --top-frac $frac --kernel-trace 32 \
    --out "$OUT/sparse_decode_frac_$frac.json" > "$OUT/sparse_decode_frac_$frac.txt" 2>&1
  echo "layout probe $frac rc=$?"; grep -v Warn "$OUT/sparse_decode_frac_$frac.txt" | grep "rel_err\|program)\|FAILED" | cut -c1-200
done
