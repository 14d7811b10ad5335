#!/usr/bin/env bash
# One GPU call (~5-7 min), written in session 20 (not run yet): BlockSizes.tail_kv_splits, the
# last partial wave of the Mosaic forward (run 69: at B2 S16K H16 the 4096 programs are 31.03
# waves of 132; full waves ran 3% faster per (batch, head) at D128, 0.8% at D256). _sweep of
# the H200 dense entry against the same entry with tail_kv_splits=8 (16 heads x 8 chunks = 128
# short programs for the skipped rows), interleaved twice, at D128 and D256, non-causal; then
# the two GPU tests of the option. If it wins at D128 or D256 with the tests passing, set it in
# that head dim's "dense" entry of the H200 table and rerun the bench's dense rows (issue 8:
# D128 1.05x the best anchor, D256 >= 1.0x; run 57: 1.014x / 0.996x).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
for d in 128 256; do
  timeout ${T_SWEEP:-200} python3 -c "
import dataclasses as dc, json
from pallas_kernels.flash import mosaic_gpu as m
base = m.default_block_sizes($d, mask='dense')
tail = dc.replace(base, tail_kv_splits=8)
rows = m._sweep(head_dim=$d, configs=[base, tail, base, tail])
json.dump(rows, open('$OUT/sweep_tail_d$d.json', 'w'), indent=1, default=str)
" 2>&1 | grep -v "^WARNING" | tail -7
done
timeout ${T_TESTS:-200} python3 -m pytest -q -rfE --tb=short -m gpu -o addopts="" \
  tests/test_flash_mosaic_gpu.py -k "tail_kv_splits" > "$OUT/gpu_tests_tail.txt" 2>&1
echo "tail GPU tests rc=$?"; tail -4 "$OUT/gpu_tests_tail.txt"
