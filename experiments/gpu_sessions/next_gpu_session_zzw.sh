#!/usr/bin/env bash
# Session 28: the dense D128 Mosaic GPU backward's ring depths. Run 118 found 4 dK/dV stages
# 3.5% faster than the 'all' entry's 3 on block schedules; dense never ran 4 (run 25 swept 2-3).
# mosaic_gpu_bwd._sweep_bwd, B2 S16K H16 D128 bf16, non-causal and causal: the entry (3 / 2),
# 4 / 2, 4 / 3, each backward alone and Mosaic forward + backward, with cuDNN in the same process.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
for causal in False True; do
  timeout ${T_SWEEP:-250} python3 -c "
import dataclasses, json
from pallas_kernels.flash import mosaic_gpu_bwd as mb
base = mb.default_block_sizes(128)
cfgs = [base, dataclasses.replace(base, num_stages_dkv=4),
        dataclasses.replace(base, num_stages_dkv=4, num_stages_dq=3)]
rows = mb._sweep_bwd(causal=$causal, configs=cfgs)
json.dump(dict(rows=rows), open('$OUT/bwd_stages_causal_$causal.json', 'w'), indent=1)
" 2>&1 | grep -v Warning | tail -12
done
