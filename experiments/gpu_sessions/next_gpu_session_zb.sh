#!/usr/bin/env bash
# One GPU call (~6-8 min), written in session 20 (its GPU call was refused: not run yet).
# BlockSizes.one_segment_static_mask (default off until this passes): packed documents (B2 S16K
# H16 D128, four causal 4K documents per row) with the causal_segments entry and with the option,
# in one _sweep (the bench's timer, checked against cuDNN on the 8 separate 4K rows); run 70 had
# 0.558 ms packed against 0.499 for the same tiles without segment ids (B1). Then the segment-id
# GPU tests (the option's aligned / packed cases included). If the option wins with every test
# passing: set it in the H200 table's causal_segments entry and rerun the bench's packed row
# (tile-sum ratio, issue 8's gate 1.2x; run 63: 1.209x).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_SWEEP:-200} python3 -c "
import dataclasses as dc, json
from pallas_kernels.flash import mosaic_gpu as m
from pallas_kernels.tuning import mask_kind
base = m.default_block_sizes(128, mask=mask_kind(True, None, segments=True))
cfgs = [base, dc.replace(base, one_segment_static_mask=True), base,
        dc.replace(base, one_segment_static_mask=True)]
rows = m._sweep(docs=4, configs=cfgs)
json.dump(rows, open('$OUT/sweep_docs4_static_mask.json', 'w'), indent=1, default=str)
" 2>&1 | grep -v "^WARNING" | tail -8
for c in packed causal4k; do
  timeout 120 python3 experiments/ncu_flash_fwd.py --case $c --calls 2 --time 2>&1 \
    | grep -E "case|Error|error" | tee "$OUT/time_$c.txt"
done
timeout ${T_TESTS:-300} python3 -m pytest -q -rfE --tb=short -m gpu -o addopts="" \
  tests/test_flash_mosaic_gpu.py -k "segment" > "$OUT/gpu_tests_segments.txt" 2>&1
echo "segment GPU tests rc=$?"; tail -4 "$OUT/gpu_tests_segments.txt"
