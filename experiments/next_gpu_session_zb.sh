#!/usr/bin/env bash
# One GPU call (~7-8 min), session 20: the one-segment flag (bd5004c). Packed documents vs the
# same tiles without segment ids (run 70: 0.558 vs 0.499 ms), the bench's packed row (tile-sum
# ratio, issue 8's gate 1.2x), then the segment-id GPU tests (the new aligned-document cases).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
for c in packed causal4k; do
  timeout 120 python3 experiments/ncu_flash_fwd.py --case $c --calls 2 --time 2>&1 \
    | grep -E "case|Error|error" | tee "$OUT/time_$c.txt"
done
JATTN_COMMIT=${JATTN_COMMIT:-unknown} timeout 240 python3 experiments/bench_kernels.py --ops flash \
  --masks dense,packed --fwd-only --head-dims 128 --seqs 16384 \
  --impls jattn_default,jattn_mosaic_gpu,jax_nn_cudnn --out "$OUT/bench_packed.json" 2>&1 \
  | grep -v "^WARNING" | tail -25
timeout ${T_TESTS:-300} python3 -m pytest -q -m gpu -o addopts="" tests/test_flash_mosaic_gpu.py \
  -k segments 2>&1 | tail -8
