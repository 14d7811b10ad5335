#!/usr/bin/env bash
# Session 28, after the sort-free schedule lists (block_schedule.compact_true; mosaic_gpu's
# _list_walk unions by scatter): run 121's trace had 5 sorts = 2.46 ms of the 29.6 ms Hopper
# sparse call at 64K. Part A: the bench's sparse rows (speedup_vs_own_dense) and the trace
# again. Part B (T_PART=B): D64 block-sparse backward, Mosaic vs Triton on 128 x 64 and 128 x 128
# blocks (run 121: Triton 19.61 ms vs Mosaic 21.36 at 128 x 64), and the GPU tests of the
# block-sparse Hopper path.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
if [ "${T_PART:-A}" = A ]; then
  timeout ${T_BENCH:-300} python3 -m experiments.bench_kernels --ops sparse \
    --out "$OUT/bench_sparse.json" > "$OUT/bench_sparse.txt" 2>&1
  echo "bench rc=$?"; grep -E "sparse_speedup|sparse_fwdbwd|sparse_select" "$OUT/bench_sparse.txt" | cut -c1-220 | head -40
  timeout ${T_TRACE:-150} python3 -m experiments.probe_sparse_mosaic_bwd --seqs 65536 --trace \
    --out "$OUT/probe_sparse_trace.json" 2>&1 | cut -c1-1500
else
  for bs in 64 128; do
    timeout ${T_PROBE:-110} python3 -m experiments.probe_sparse_mosaic_bwd --seqs 65536 \
      --head-dim 64 --block-size $bs --kernels-only \
      --out "$OUT/probe_sparse_d64_k$bs.json" 2>&1 | grep '"op"' | cut -c1-220
  done
  timeout ${T_TESTS:-240} python3 -m pytest -q -m gpu tests/test_sparse_mosaic_gpu.py \
    -k "vjp or default_is" 2>&1 | tail -4
fi
