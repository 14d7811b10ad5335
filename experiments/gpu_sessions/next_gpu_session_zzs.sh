#!/usr/bin/env bash
# Session 27: the Mosaic GPU backward walking block schedules (block-sparse training).
#  1. GPU tests: the three schedule cases of tests/test_flash_mosaic_gpu_bwd.py and every GPU
#     test of tests/test_sparse_mosaic_gpu.py (jattn's "mosaic_gpu" block-sparse path now runs the
#     Mosaic backward at D64/D128; its VJP is checked against the fp32 reference and Triton).
#  2. experiments/probe_sparse_mosaic_bwd.py at 16K and 64K: Mosaic fwd + Triton bwd vs Mosaic
#     fwd + Mosaic bwd on one schedule, the whole sparse_attention call (selection included) on
#     both paths, and the dense causal baselines, in one process.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_TESTS:-150} python3 -m pytest -q -m gpu -k sched \
  tests/test_flash_mosaic_gpu_bwd.py > "$OUT/gpu_tests_bwd.txt" 2>&1
echo "bwd tests rc=$?"; tail -15 "$OUT/gpu_tests_bwd.txt" | cut -c1-300
timeout ${T_TESTS2:-200} python3 -m pytest -q -m gpu tests/test_sparse_mosaic_gpu.py \
  > "$OUT/gpu_tests_sparse.txt" 2>&1
echo "sparse tests rc=$?"; tail -15 "$OUT/gpu_tests_sparse.txt" | cut -c1-300
timeout ${T_PROBE:-280} python3 -m experiments.probe_sparse_mosaic_bwd --seqs ${SEQS:-16384,65536} \
  --out "$OUT/probe_sparse_mosaic_bwd.json" > "$OUT/probe_sparse_mosaic_bwd.txt" 2>&1
echo "probe rc=$?"; cut -c1-400 "$OUT/probe_sparse_mosaic_bwd.txt" | grep -v Warn | tail -20
