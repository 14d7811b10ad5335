#!/usr/bin/env bash
# One GPU call (~6-8 min; carry .whl from ../shared/scripts/tokamax_wheels.sh), session 21: the
# bench's forward rows after runs 71-72 decided the one_segment_static_mask / tail_kv_splits
# defaults of the H200 table: D128 dense, causal and packed documents (the packed row's
# tile_sum_ratio is issue 8's 1.2x gate), then D256 dense and causal, each against cuDNN and
# tokamax's Mosaic kernel in the same process, with jattn_mosaic_gpu[tail8] (tail_kv_splits=8 on
# the dense entry: the last partial wave; its in-place write replaced run 72's .at[].set, which
# XLA failed to compile) on the dense rows. First the two tail_kv_splits GPU tests. Outputs
# under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && cp -r .whl/shim/xprof /tmp/site/
export PYTHONPATH=/tmp/site:$PWD
timeout ${T_TESTS:-120} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider -o addopts="" \
  tests/test_flash_mosaic_gpu.py -k "tail_kv_splits" > "$OUT/gpu_tests_tail.txt" 2>&1
echo "tail GPU tests rc=$?"; tail -3 "$OUT/gpu_tests_tail.txt"
bench() {   # name, head dims, masks
  timeout ${T_BENCH:-230} python3 -m experiments.bench_kernels --ops flash --seqs 16384 --head-dims $2 \
    --masks $3 --impls jattn_default,jattn_mosaic_gpu[tail8],jax_nn_cudnn,tokamax_mosaic --fwd-only \
    --out "$OUT/h200_bench_$1.json" > "$OUT/bench_$1.txt" 2>&1
  echo "bench $1 rc=$?"
  grep "op=\|skipped\|FAILED\|tile_sum\|Error" "$OUT/bench_$1.txt" | sed -E "s/case=B2 S16K H16 //" | cut -c1-220
}
bench d128 128 ${MASKS_D128:-dense,causal,packed}
T_BENCH=${T_BENCH_D256:-200} bench d256 256 ${MASKS_D256:-dense,causal}
