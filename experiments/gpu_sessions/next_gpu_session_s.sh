#!/usr/bin/env bash
# One GPU call (~8-9 min; run tool timeout_s 600; carry .whl), session 18: the new H200 defaults
# (D128 and D256 dense/causal: overlap_softmax + early_k_load + pingpong_handoff, runs 55-56):
# the registered forward + VJP GPU tests at D128/D256, then the bench against cuDNN and tokamax
# (D128 forward and forward+backward, D256 forward). Outputs under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && cp -r .whl/shim/xprof /tmp/site/
export PYTHONPATH=/tmp/site:$PWD
timeout ${T_TESTS:-110} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider -o addopts="" \
  tests/test_flash_mosaic_gpu.py -k "forward_and_vjp and (d128 or d256)" > "$OUT/gpu_tests_defaults.txt" 2>&1
echo "GPU tests rc=$?"; tail -3 "$OUT/gpu_tests_defaults.txt"
bench() {   # name, head dims, extra args
  timeout ${T_BENCH:-250} python3 -m experiments.bench_kernels --ops flash --seqs 16384 --head-dims $2 \
    --masks dense,causal --impls jattn_default,jax_nn_cudnn,tokamax_mosaic $3 \
    --out "$OUT/h200_bench_$1.json" > "$OUT/bench_$1.txt" 2>&1
  echo "bench $1 rc=$?"
  grep "op=\|skipped\|FAILED" "$OUT/bench_$1.txt" | sed -E "s/case=B2 S16K H16 //" | cut -c1-200
}
bench d128 128 ""
T_BENCH=${T_BENCH2:-150} bench d256 256 "--fwd-only"
