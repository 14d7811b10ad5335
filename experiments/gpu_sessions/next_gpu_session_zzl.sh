#!/usr/bin/env bash
# One GPU call (~1.5 min), session 25: where the sparse decode attention's ~8 us of fixed time
# goes (experiments/probe_sparse_attention_parts.py: the merged kernel, partials + the merge
# kernel, lists cut to 0 / 2 / 32 blocks), twice (two processes).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
for i in 1 2; do
  timeout ${T_PARTS:-120} python3 experiments/probe_sparse_attention_parts.py \
    --out "$OUT/sparse_attention_parts_$i.json" 2>&1 | grep -v -i warn | tee "$OUT/sparse_attention_parts_$i.txt" | cut -c1-200
done
