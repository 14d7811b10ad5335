#!/usr/bin/env bash
# Issue 8's gates in one place: the bench's rows with every anchor in the same process (tokamax
# from .whl: `bash ../shared/scripts/tokamax_wheels.sh .whl`, then run with carry [".whl"]).
# PART=d128 (default; ~5 min): B2 S16K H16 D128 dense, causal, causal window 512, packed 4 x 4K,
#   forward and forward+backward, jattn's default against jax.nn cuDNN and tokamax's Mosaic GPU.
# PART=other (~4 min): D64 and D256 dense and causal, forward only; then decode (no sweep).
# Outputs under $OUT (json per part + the bench's log); the rows that matter go to stdout.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && cp -r .whl/shim/xprof /tmp/site/
fi
export PYTHONPATH=/tmp/site:$PWD
IMPLS=${IMPLS:-jattn_default,jax_nn_cudnn,tokamax_mosaic}
show() { grep "op=\|skipped\|FAILED\|tile_sum\|Error" "$1" | sed -E "s/case=B2 S16K H16 //" | cut -c1-230; }
if [ "${PART:-d128}" = d128 ]; then
  timeout ${T_BENCH:-420} python3 -m experiments.bench_kernels --ops flash --seqs 16384 \
    --head-dims 128 --masks dense,causal,window,packed --impls "$IMPLS" \
    --out "$OUT/bench_d128.json" > "$OUT/bench_d128.txt" 2>&1
  echo "bench d128 rc=$?"; show "$OUT/bench_d128.txt"
else
  timeout ${T_BENCH:-300} python3 -m experiments.bench_kernels --ops flash --seqs 16384 \
    --head-dims 64,256 --masks dense,causal --fwd-only --impls "$IMPLS" \
    --out "$OUT/bench_d64_d256.json" > "$OUT/bench_d64_d256.txt" 2>&1
  echo "bench d64/d256 rc=$?"; show "$OUT/bench_d64_d256.txt"
  timeout ${T_DECODE:-200} python3 -m experiments.bench_kernels --ops decode --no-sweep \
    --out "$OUT/bench_decode.json" > "$OUT/bench_decode.txt" 2>&1
  echo "bench decode rc=$?"; grep "op=" "$OUT/bench_decode.txt" | cut -c1-200 | head -20
fi
