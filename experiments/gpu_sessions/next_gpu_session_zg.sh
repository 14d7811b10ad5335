#!/usr/bin/env bash
# One short GPU call (~4 min), session 21's last: the new GPU test of tail_kv_splits through
# jattn's forward + VJP (Mosaic and Triton backwards), then the key-chunk count C of the H200
# dense entries (8 since run 74) against 4, 16 and 0 at D128 and D256, interleaved, in one
# _sweep each (B2 S16K H16, the bench's timer, every row checked against cuDNN). Outputs under
# $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_TESTS:-90} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider -o addopts="" \
  tests/test_flash_mosaic_gpu.py -k "tail_kv_splits_forward_and_vjp" > "$OUT/gpu_tests_tail_vjp.txt" 2>&1
echo "tail VJP GPU tests rc=$?"; tail -2 "$OUT/gpu_tests_tail_vjp.txt"
for d in 128 256; do
  timeout ${T_SWEEP:-95} python3 -c "
import dataclasses as dc, json
from pallas_kernels.flash import mosaic_gpu as m
base = m.default_block_sizes($d, mask='dense')
assert base.tail_kv_splits == 8, base
cfgs = [dc.replace(base, tail_kv_splits=c) for c in (8, 4, 16, 0, 8)]
rows = m._sweep(head_dim=$d, configs=cfgs)
json.dump(rows, open('$OUT/sweep_tail_c_d$d.json', 'w'), indent=1, default=str)
" 2>&1 | grep -v "^WARNING" | sed -E "s/BlockSizes\(.*tail_kv_splits=/tail=/" | tail -7
done
