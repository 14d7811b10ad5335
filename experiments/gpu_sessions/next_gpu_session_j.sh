#!/usr/bin/env bash
# One GPU call (~9 min; run tool timeout_s 600), written in session 16 for session 17 (issue 8's
# D128 forward 1.05x): the five default-off Mosaic GPU forward options modelled on tokamax's sm90
# kernel (docs/mosaic_fwd_vs_tokamax.md). First their GPU correctness tests, then one _sweep
# process per mask (the bench's timer since session 16; rows print as they finish). The two
# options that change the barrier protocol (pingpong_handoff, k_wait_in_pv) come last: a hang
# there is cut by the process timeout and the earlier rows survive. Outputs under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_TESTS:-150} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider -o addopts="" \
  tests/test_flash_mosaic_gpu.py -k "early_k_load or handoff or q_major or reduction_scratch or k_wait or all_options" \
  > "$OUT/gpu_tests_tokamax_options.txt" 2>&1
echo "option GPU tests rc=$?"; tail -3 "$OUT/gpu_tests_tokamax_options.txt"
for c in False True; do
  timeout ${T_SWEEP:-200} python3 -c "
import dataclasses as dc, json
from pallas_kernels.flash import mosaic_gpu as m
causal = $c
b = m.default_block_sizes(128, mask='causal' if causal else 'dense')
r = lambda **kw: dc.replace(b, **kw)
cfgs = [b, r(early_k_load=True), r(q_major_grid=True), r(no_reduction_scratch=True, num_stages=3),
        r(pingpong_handoff=True), r(k_wait_in_pv=True), r(k_wait_in_pv=True, pingpong_handoff=True)]
rows = m._sweep(causal=causal, configs=cfgs)
json.dump(rows, open('$OUT/h200_mosaic_tokamax_options_causal_$c.json', 'w'), indent=1, default=str)
" > "$OUT/tokamax_options_causal_$c.txt" 2>&1
  echo "sweep causal=$c rc=$?"; grep "^{" "$OUT/tokamax_options_causal_$c.txt" | sed -E "s/compute_registers=232, //" | cut -c1-260
done
