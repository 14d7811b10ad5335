#!/usr/bin/env bash
# One GPU call (~4-5 min), session 19:
# (1) the 3 GPU tests of overlap_softmax on a block schedule's walk after the fix of run 60's
#     failure (a Q K^T-only turn after a skip that flushed the pending P V did not rescale acc
#     by the new max: "d128_q64_k64_union_segments", rel err 0.134);
# (2) packed 4 x 4K documents (B2 S16K H16 D128 causal segments): the causal_segments entry
#     against the overlap variant (the segment-id range path's overlap GPU tests passed in run 60);
# (3) D64: 256-key tiles (run 60: 3 stages 4.542 ms vs 4.995 default, cuDNN 4.773), non-causal
#     with the ping-pong hand-over, and causal (default, 256-key at 2 and 3
#     stages). Outputs under $OUT; every row is also printed.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_TESTS:-150} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider -o addopts="" \
  tests/test_sparse_mosaic_gpu.py -k "overlap" > "$OUT/gpu_tests_walk_overlap.txt" 2>&1
echo "walk overlap GPU tests rc=$?"; tail -3 "$OUT/gpu_tests_walk_overlap.txt"
sweep() {   # name, python expression for _sweep's keyword arguments (b: the mask's default)
  timeout ${T_SWEEP:-150} python3 -c "
import dataclasses as dc, json
from pallas_kernels.flash import mosaic_gpu as m
from pallas_kernels.tuning import mask_kind
$2
rows = m._sweep(**kw)
json.dump(rows, open('$OUT/h200_$1.json', 'w'), indent=1, default=str)
" > "$OUT/sweep_$1.txt" 2>&1
  echo "sweep $1 rc=$?"; grep "^{" "$OUT/sweep_$1.txt" | python3 -c "
import ast, sys
for line in sys.stdin:
  r = ast.literal_eval(line)
  n = r['name']
  keep = [p for p in n.replace('(', ', ').replace(')', '').split(', ') if p.startswith(
      ('block_k=', 'num_stages=', 'overlap_softmax=True', 'pingpong_handoff=True', 'early_k_load=True'))]
  print(f\"  {r.get('ms', 0):8.4f} ms {r.get('tflops', 0):6.1f} TF/s  {n[:24]} {' '.join(keep)} {r.get('error', '')[:200]}\")
"
}
sweep docs4_overlap "
b = m.default_block_sizes(128, mask='causal_segments')
ov = dc.replace(b, overlap_softmax=True, pingpong_handoff=True, early_k_load=True, k_wait_in_pv=False, softmax_fence=False)
kw = dict(docs=4, configs=[b, ov])"
sweep d64_bk256_more "
b = m.default_block_sizes(64)
r = lambda **k: dc.replace(b, **k)
kw = dict(head_dim=64, configs=[b, r(block_k=256, num_stages=3), r(block_k=256, num_stages=3, pingpong_handoff=True)])"
sweep d64_causal_bk256 "
b = m.default_block_sizes(64, mask='causal')
r = lambda **k: dc.replace(b, **k)
kw = dict(head_dim=64, causal=True, configs=[b, r(block_k=256, num_stages=3), r(block_k=256, num_stages=2)])"
