#!/usr/bin/env bash
# One GPU call (~6 min; run tool timeout_s 600; carry .whl), session 17 (run 46): the new D64 and
# D256 Mosaic forward defaults (run 45: k_wait_in_pv at D64, k_wait_in_pv + pingpong_handoff at
# D256): their GPU tests, then the bench's forward rows against cuDNN and tokamax. Outputs in $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && cp -r .whl/shim/xprof /tmp/site/
export PYTHONPATH=/tmp/site:$PWD
timeout ${T_TESTS:-150} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider -o addopts="" \
  tests/test_flash_mosaic_gpu.py -k "(matches_reference and (d64] or d64_causal] or d256] or d256_causal])) or (forward_and_vjp and (d64] or d256]))" \
  > "$OUT/gpu_tests_d64_d256.txt" 2>&1
echo "GPU tests rc=$?"; tail -3 "$OUT/gpu_tests_d64_d256.txt"
timeout ${T_BENCH:-260} python3 -m experiments.bench_kernels --ops flash --seqs 16384 --head-dims 64,256 \
  --masks dense,causal --fwd-only --impls jattn_default,jax_nn_cudnn,tokamax_mosaic \
  --out "$OUT/h200_bench_d64_d256.json" > "$OUT/bench_d64_d256.txt" 2>&1
echo "bench rc=$?"
grep "op=\|skipped\|FAILED" "$OUT/bench_d64_d256.txt" | sed -E "s/case=B2 S16K H16 //" | cut -c1-200
