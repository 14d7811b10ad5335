#!/usr/bin/env bash
# Next session (28): block-sparse training on the Hopper path after session 27.
#  1. bench_kernels --ops sparse: the bench's own rows with the Mosaic GPU backward on the
#     schedule, incl. the new jattn_mosaic_gpu_dense row and speedup_vs_own_dense (issue 8's
#     block-sparse gate against the Hopper dense kernel; run 120's probe: 4.00x).
#  2. D64 block-sparse backward tiles (never timed): the 'all' entry cut to the schedule against
#     4 dK/dV stages, at 64K with 128 x 64 blocks.
#  3. The default-path GPU test run 120's pytest limit cut (it passed in run 119).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_BENCH:-330} python3 -m experiments.bench_kernels --ops sparse \
  --out "$OUT/bench_sparse.json" > "$OUT/bench_sparse.txt" 2>&1
echo "bench rc=$?"; grep -E "sparse_speedup|sparse_fwdbwd" "$OUT/bench_sparse.txt" | cut -c1-260 | head -30
timeout ${T_PROBE:-150} python3 -m experiments.probe_sparse_mosaic_bwd --seqs 65536 --head-dim 64 \
  --kernels-only --bwd-configs "64,64,64,64,4,2;64,64,64,64,4,3" \
  --out "$OUT/probe_sparse_bwd_d64.json" 2>&1 | grep '"op"' | cut -c1-300
timeout ${T_TESTS:-90} python3 -m pytest -q -m gpu -k default_is tests/test_sparse_mosaic_gpu.py \
  2>&1 | tail -2
