#!/usr/bin/env bash
# One GPU call (~6-8 min; run tool timeout_s 600), session 16 (run 38), after run 37 made the
# softmax fence the H200's D128 forward default: (1) issue 5's sparse decode on a head-major
# cache with more split counts and the one-launch scores + selection (calls 1 and 6, 7 rounds:
# run 36 put sparse "hnd" at 2.96x dense "nhd"), (2) the D128 forward's neighbours with the
# fence, (3) the fence at D64 / D256 (non-causal and causal), the causal window 512 and packed
# 4 x 4K documents. One process per case, rows print as they finish. Outputs under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_LAYOUT:-250} python3 experiments/probe_sparse_decode_layout.py --calls 1,6 --rounds 7 \
  --hnd-splits 16,24,49 --hnd-fused --out "$OUT/h200_sparse_decode_layout_splits.json" \
  > "$OUT/sparse_decode_layout_splits.txt" 2>&1
echo "layout probe rc=$?"; grep -v Warn "$OUT/sparse_decode_layout_splits.txt" | tail -18
sweep() {  # name, python expression for _sweep's keyword arguments and configs
  timeout ${T_SWEEP:-100} python3 -c "
import dataclasses as dc, json, jax
from pallas_kernels.flash import mosaic_gpu as m
from pallas_kernels.tuning import mask_kind
R = dc.replace
$2
rows = m._sweep(iters=10, **kw)
json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, case=str(kw), rows=rows),
          open('$OUT/h200_fwd_$1.json', 'w'), indent=1, default=str)
" > "$OUT/fwd_$1.txt" 2>&1
  echo "sweep $1 rc=$?"; grep "^{" "$OUT/fwd_$1.txt" | sed -E "s/compute_registers=232, backward='triton', //" | cut -c1-230
}
for c in False True; do
  sweep d128_causal_$c "b = m.default_block_sizes(128)
kw = dict(causal=$c, configs=[b, R(b, pingpong=False), R(b, compute_registers=240), R(b, softmax_fence=False)])"
done
for d in 64 256; do for c in False True; do
  sweep d${d}_causal_$c "b = m.default_block_sizes($d)
kw = dict(causal=$c, head_dim=$d, configs=[b, R(b, softmax_fence=True)])"
done; done
sweep window "b = m.default_block_sizes(128, mask='causal_window')
kw = dict(causal=True, local_window_size=(511, 0), configs=[b, R(b, softmax_fence=True)])"
sweep packed "b = m.default_block_sizes(128, mask='causal')
kw = dict(docs=4, configs=[b, R(b, softmax_fence=False)])"
