#!/usr/bin/env bash
# One GPU call (~6-7 min), session 15: the head-major cache probe for sparse decode
# (experiments/probe_sparse_decode_layout.py), then the Hopper forward sweeps one process per
# case with its own timeout (session 15's first try ran them in one process and a D64 config
# hung past 330 s with nothing printed; the D64 list here drops block_q 128 and block_k 192/256).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_LAYOUT:-150} python3 experiments/probe_sparse_decode_layout.py \
  --out "$OUT/h200_sparse_decode_layout.json" > "$OUT/sparse_decode_layout.txt" 2>&1
echo "layout probe rc=$?"; grep -v Warn "$OUT/sparse_decode_layout.txt" | tail -12
sweep() {  # name timeout python-kwargs configs-expression
  timeout "$2" python3 -c "
import dataclasses, json, jax
from pallas_kernels.flash import mosaic_gpu as m
kw = dict($3)
base = m.default_block_sizes(kw.get('head_dim', 128)); r = lambda **c: dataclasses.replace(base, **c)
rows = m._sweep(configs=[$4], iters=10, **kw)
json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, case=kw, rows=rows),
          open('$OUT/h200_mosaic_fwd_sweep_$1.json', 'w'), indent=1, default=str)
" > "$OUT/sweep_$1.txt" 2>&1
  echo "== $1 rc=$?"; grep "^{" "$OUT/sweep_$1.txt" | cut -c1-200
}
sweep d64 110 "head_dim=64" "base, r(num_stages=2), r(num_stages=4), r(block_k=64), r(compute_registers=240)"
sweep d256 60 "head_dim=256" "base, r(pingpong=False)"
sweep window512 60 "causal=True, local_window_size=(511, 0)" "base, r(block_k=64)"
sweep docs4 60 "docs=4" "base, r(block_k=64)"
