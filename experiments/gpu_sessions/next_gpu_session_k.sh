#!/usr/bin/env bash
# One GPU call (~8-9 min; run tool timeout_s 600), session 17 (run 44): (1) combinations of the
# two barrier-protocol options that won in run 43 (k_wait_in_pv, pingpong_handoff) with and
# without the softmax fence, D128 S16K: dense, causal, causal window 512 (64-key tiles), one
# _sweep process per mask; (2) the nn GPU tests' MLA cases (absorbed single-token decode on the
# Triton kernel, never run on a GPU; in run 42 the whole file needed > 170 s). Outputs under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
sweep() {  # name, timeout s, mask, causal, window
  timeout "$2" python3 -c "
import dataclasses as dc, json
from pallas_kernels.flash import mosaic_gpu as m
b = m.default_block_sizes(128, mask='$3')
r = lambda **kw: dc.replace(b, **kw)
f = not b.softmax_fence
cfgs = [b, r(k_wait_in_pv=True), r(k_wait_in_pv=True, pingpong_handoff=True),
        r(softmax_fence=f), r(k_wait_in_pv=True, softmax_fence=f),
        r(k_wait_in_pv=True, pingpong_handoff=True, softmax_fence=f)]
rows = m._sweep(causal=$4, local_window_size=$5, configs=cfgs)
json.dump(rows, open('$OUT/h200_mosaic_kwait_$1.json', 'w'), indent=1, default=str)
" > "$OUT/kwait_$1.txt" 2>&1
  echo "sweep $1 rc=$?"
  grep "^{" "$OUT/kwait_$1.txt" | sed -E "s/compute_registers=232, //; s/backward='triton', //; s/block_q=64, //; s/early_k_load=False, q_major_grid=False, //; s/no_reduction_scratch=False, //" | cut -c1-230
}
sweep dense ${T_DENSE:-110} dense False None
sweep causal ${T_CAUSAL:-100} causal True None
sweep window ${T_WINDOW:-90} causal_window True "(511, 0)"
timeout ${T_TESTS:-240} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider \
  -o addopts="" tests/test_nn_layers.py -k mla > "$OUT/gpu_tests_nn_mla.txt" 2>&1
echo "nn mla gpu tests rc=$?"; tail -5 "$OUT/gpu_tests_nn_mla.txt"
