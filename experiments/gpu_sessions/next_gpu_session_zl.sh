#!/usr/bin/env bash
# One GPU call (~6 min; carry .whl), session 22, after run 81 (edge masks; the H200
# causal_window entry back to 128-key tiles): the bench's D128 forward rows (dense, causal,
# window 512 with its tile sum, packed documents) through jattn's default against cuDNN and
# tokamax; then the 2 window forward+VJP GPU tests run 81's time limit cut off; then the
# window with the dense entry's overlap (+ early_k_load) against the entry. Outputs under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && cp -r .whl/shim/xprof /tmp/site/
export PYTHONPATH=/tmp/site:$PWD
timeout ${T_BENCH:-240} python3 -m experiments.bench_kernels --ops flash --seqs 16384 --head-dims 128 \
  --masks ${MASKS:-dense,causal,window,packed} --impls jattn_default,jax_nn_cudnn,tokamax_mosaic --fwd-only \
  --out "$OUT/h200_bench_d128.json" > "$OUT/bench_d128.txt" 2>&1
echo "bench rc=$?"
grep "op=\|skipped\|FAILED\|tile_sum\|Error" "$OUT/bench_d128.txt" | sed -E "s/case=B2 S16K H16 //" | cut -c1-220
timeout ${T_TESTS:-110} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider -o addopts="" \
  tests/test_flash_mosaic_gpu.py -k "registered and window" > "$OUT/gpu_tests_window_vjp.txt" 2>&1
echo "window VJP GPU tests rc=$?"; tail -2 "$OUT/gpu_tests_window_vjp.txt"
timeout ${T_SWEEP:-70} python3 -c "
import dataclasses as dc, json
from pallas_kernels.flash import mosaic_gpu as m
e = m.default_block_sizes(128, mask='causal_window')
o = dc.replace(e, softmax_fence=False, overlap_softmax=True, pingpong_handoff=True, early_k_load=True)
rows = m._sweep(head_dim=128, causal=True, local_window_size=(511, 0), configs=[e, o, e, o])
json.dump(rows, open('$OUT/sweep_window_overlap.json', 'w'), indent=1, default=str)
" 2>&1 | grep -v "^WARNING" | sed -E "s/BlockSizes\(block_q=64, block_k=([0-9]+).*softmax_fence=([A-Za-z]+).*overlap_softmax=([A-Za-z]+).*\)/bk=\1 fence=\2 overlap=\3/" | tail -5
