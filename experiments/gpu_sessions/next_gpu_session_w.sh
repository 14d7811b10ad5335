#!/usr/bin/env bash
# One GPU call (~8 min; run tool timeout_s 600; carry .whl), session 19: the new H200 defaults
# (D64 dense/causal: 256-key tiles, 3 stages; packed documents: the overlap; jattn no longer
# swaps segment-id calls to the generic entry):
# (1) GPU tests: the 256-key D64 cases, the registered forward + VJP at D64 and with segment ids;
# (2) the bench at D64 (forward and forward+backward, dense and causal) against cuDNN and
#     tokamax, then D128 dense + packed documents, forward only (the packed tile-sum gate);
# (3) ptxas -v of the D256 dense default (overlap): registers and spills (D256 is 0.996x cuDNN).
# Outputs under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && cp -r .whl/shim/xprof /tmp/site/
export PYTHONPATH=/tmp/site:$PWD
timeout ${T_TESTS:-170} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider -o addopts="" \
  tests/test_flash_mosaic_gpu.py -k "bk256 or (forward_and_vjp and (d64 or segments))" \
  > "$OUT/gpu_tests_d64_segments.txt" 2>&1
echo "GPU tests rc=$?"; grep -E "passed|failed|FAILED" "$OUT/gpu_tests_d64_segments.txt" | tail -5
bench() {   # name, head dims, masks, extra args
  timeout ${T_BENCH:-200} python3 -m experiments.bench_kernels --ops flash --seqs 16384 --head-dims $2 \
    --masks $3 --impls jattn_default,jax_nn_cudnn,tokamax_mosaic $4 \
    --out "$OUT/h200_bench_$1.json" > "$OUT/bench_$1.txt" 2>&1
  echo "bench $1 rc=$?"
  grep "op=\|skipped\|FAILED\|tile_sum" "$OUT/bench_$1.txt" | sed -E "s/case=B2 S16K H16 //" | cut -c1-220
}
bench d64 64 dense,causal ""
T_BENCH=${T_BENCH2:-130} bench d128_packed 128 dense,packed "--fwd-only"
MOSAIC_GPU_DUMP_PTXAS=1 timeout 90 python3 -c "
import jax, jax.numpy as jnp
from pallas_kernels.flash import mosaic_gpu as m
q = jax.random.normal(jax.random.key(0), (1, 1024, 2, 256), jnp.bfloat16)
bs = m.default_block_sizes(256, mask='dense')
print(bs)
jax.block_until_ready(jax.jit(lambda q: m.flash_attention(q, q, q, block_sizes=bs)[0])(q))
" > "$OUT/ptxas_d256.txt" 2>&1
echo "ptxas d256 rc=$?"; grep -i -E "BlockSizes|registers|spill|C75" "$OUT/ptxas_d256.txt" | sort | uniq -c | cut -c1-250 | head
