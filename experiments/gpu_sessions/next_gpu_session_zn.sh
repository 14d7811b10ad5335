#!/usr/bin/env bash
# One GPU call (~2 min; carry .whl), session 22: the bench's D128 dense and causal-window
# forward rows (the window's tile sum needs the dense row) through jattn's default after the
# causal_window entry took the overlap (run 82's sweep), against cuDNN and tokamax.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && cp -r .whl/shim/xprof /tmp/site/
export PYTHONPATH=/tmp/site:$PWD
timeout ${T_BENCH:-150} python3 -m experiments.bench_kernels --ops flash --seqs 16384 --head-dims 128 \
  --masks dense,window --impls jattn_default,jax_nn_cudnn,tokamax_mosaic --fwd-only \
  --out "$OUT/h200_bench_d128_window.json" > "$OUT/bench_d128_window.txt" 2>&1
echo "bench rc=$?"
grep "op=\|skipped\|FAILED\|tile_sum\|Error" "$OUT/bench_d128_window.txt" | sed -E "s/case=B2 S16K H16 //" | cut -c1-220
