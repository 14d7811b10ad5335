#!/usr/bin/env bash
# One GPU call (~4-5 min; run tool timeout_s 600), issue 8 (causal window 512 forward): the new
# BlockSizes.q_tiles_per_program (several query tiles per program, the K/V ring running on
# across them, the next Q prefetched; never run on a GPU). (1) its GPU tests against the
# reference (GPU_CASES "*q_tiles*": causal window 511 with 64-key tiles, causal ragged, q
# longer non-causal, rows that see no key, D64 with early_k_load/q_major_grid/no ping-pong);
# (2) one _sweep process, B2 S16K H16 D128 bf16, causal window (511, 0): the H200 default
# (64-key tiles, fence) with q_tiles_per_program 1, 2, 4, 8, and cuDNN. Outputs under $OUT. The
# sweep runs first (its rows carry max_abs_diff_vs_cudnn, a check of the window case); the tests
# print one line per case (-v), simplest first, so that a hang (timeout) shows where.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_SWEEP:-110} python3 -c "
import dataclasses as dc, json
from pallas_kernels.flash import mosaic_gpu as m
b = m.default_block_sizes(128, mask='causal_window')
cfgs = [b] + [dc.replace(b, q_tiles_per_program=p) for p in (2, 4, 8)]
rows = m._sweep(causal=True, local_window_size=(511, 0), configs=cfgs)
json.dump(rows, open('$OUT/h200_mosaic_q_tiles_window512.json', 'w'), indent=1, default=str)
" > "$OUT/sweep_q_tiles_window512.txt" 2>&1
echo "sweep rc=$?"
grep "^{" "$OUT/sweep_q_tiles_window512.txt" | sed -E "s/compute_registers=232, //; s/backward='triton', //; s/block_q=64, //; s/early_k_load=False, q_major_grid=False, //; s/no_reduction_scratch=False, //; s/pingpong_handoff=False, //; s/k_wait_in_pv=False, //" | cut -c1-260
grep -m3 "Error\|error" "$OUT/sweep_q_tiles_window512.txt" | cut -c1-300
timeout ${T_TESTS:-140} python3 -m pytest -v -rfE --tb=short -m gpu -p no:cacheprovider \
  -o addopts="" tests/test_flash_mosaic_gpu.py -k q_tiles > "$OUT/gpu_tests_q_tiles.txt" 2>&1
echo "q_tiles GPU tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests_q_tiles.txt" | cut -c1-200; tail -3 "$OUT/gpu_tests_q_tiles.txt"
