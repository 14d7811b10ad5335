#!/usr/bin/env bash
# Session 28, first call: block-sparse training on the Hopper path.
#  1. bench_kernels --ops sparse: the bench's own rows with the Mosaic GPU backward on the
#     schedule, incl. jattn_mosaic_gpu_dense and speedup_vs_own_dense (issue 8's block-sparse
#     gate against the Hopper dense kernel; run 120's probe: 4.00x).
#  2. Per-kernel device time (CUPTI trace) of the whole Hopper sparse call and the dense
#     default at 64K: selection, list building and the three kernels, split.
#  3. D64 block-sparse backward tiles (never timed).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_BENCH:-300} python3 -m experiments.bench_kernels --ops sparse \
  --out "$OUT/bench_sparse.json" > "$OUT/bench_sparse.txt" 2>&1
echo "bench rc=$?"; grep -E "sparse_speedup|sparse_fwdbwd" "$OUT/bench_sparse.txt" | cut -c1-260 | head -30
timeout ${T_TRACE:-150} python3 -m experiments.probe_sparse_mosaic_bwd --seqs 65536 --trace \
  --out "$OUT/probe_sparse_trace.json" 2>&1 | cut -c1-1500
timeout ${T_PROBE:-130} python3 -m experiments.probe_sparse_mosaic_bwd --seqs 65536 --head-dim 64 \
  --kernels-only --bwd-configs "64,64,64,64,4,2;64,64,64,64,4,3" \
  --out "$OUT/probe_sparse_bwd_d64.json" 2>&1 | grep '"op"' | cut -c1-300
