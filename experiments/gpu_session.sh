#!/usr/bin/env bash
# One GPU call: GPU tests, then the kernel benchmark, logs under $OUT (device tool) or ./gpu_out.
#   bash experiments/gpu_session.sh [bench args...]
# Env: SKIP_TESTS=1 / SKIP_BENCH=1, TEST_TIMEOUT / MOSAIC_TIMEOUT / BENCH_TIMEOUT (s), GPU_TESTS
# (paths; default: every GPU test but the Mosaic GPU backward's, the Mosaic GPU forward's last in
# their own run; the never-run backward has its own call: experiments/mosaic_gpu_bwd_session.sh).
# Expects tokamax wheels in .whl/ (../shared/scripts/tokamax_wheels.sh) when comparing with it.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && cp -r .whl/shim/xprof /tmp/site/ && export PYTHONPATH=/tmp/site:$PWD || echo "tokamax install failed"
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/nvidia_smi.txt"
python3 -c "import jax; print(jax.__version__, jax.devices())"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # The Mosaic GPU (Hopper) tests run last with their own limit: a first run of a barrier-driven
  # kernel can hang, and must not take the other GPU tests' results with it.
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider -o addopts="" \
    ${GPU_TESTS:-tests --ignore tests/test_flash_mosaic_gpu.py --ignore tests/test_flash_mosaic_gpu_bwd.py} > "$OUT/gpu_tests.txt" 2>&1
  tail -60 "$OUT/gpu_tests.txt"
  if [ -z "${GPU_TESTS:-}" ]; then
    timeout ${MOSAIC_TIMEOUT:-180} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider -o addopts="" \
      tests/test_flash_mosaic_gpu.py > "$OUT/gpu_tests_mosaic.txt" 2>&1
    echo "mosaic_gpu tests rc=$?"; tail -30 "$OUT/gpu_tests_mosaic.txt"
  fi
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout ${BENCH_TIMEOUT:-280} python3 -m experiments.bench_kernels --out "$OUT/h200_kernels.json" "$@" > "$OUT/bench.txt" 2>&1
  tail -80 "$OUT/bench.txt"
fi
