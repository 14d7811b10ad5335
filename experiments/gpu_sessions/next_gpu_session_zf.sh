#!/usr/bin/env bash
# One GPU call (~5 min; carry .whl), session 21, after the H200 table took tail_kv_splits=8 in
# its D128/D256 dense entries (run 74; jattn applies it through fit_tail_kv_splits) and
# one_segment_static_mask in causal_segments (run 71): the bench's forward rows through jattn's
# default (the dense rows now checked on the last batch row, where the tail launch writes),
# with the dense entry without the tail ([no_tail]) as the A/B, against cuDNN and tokamax:
# D128 dense, causal, window 512, packed documents; D256 dense, causal. Outputs under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && cp -r .whl/shim/xprof /tmp/site/
export PYTHONPATH=/tmp/site:$PWD
bench() {   # name, head dims, masks
  timeout ${T_BENCH:-230} python3 -m experiments.bench_kernels --ops flash --seqs 16384 --head-dims $2 \
    --masks $3 --impls jattn_default,jattn_mosaic_gpu[no_tail],jax_nn_cudnn,tokamax_mosaic --fwd-only \
    --out "$OUT/h200_bench_$1.json" > "$OUT/bench_$1.txt" 2>&1
  echo "bench $1 rc=$?"
  grep "op=\|skipped\|FAILED\|tile_sum\|Error" "$OUT/bench_$1.txt" | sed -E "s/case=B2 S16K H16 //" | cut -c1-220
}
bench d128 128 ${MASKS_D128:-dense,causal,window,packed}
T_BENCH=${T_BENCH_D256:-170} bench d256 256 ${MASKS_D256:-dense,causal}
