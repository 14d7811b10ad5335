#!/usr/bin/env bash
# Session 26: the Mosaic GPU backward with local windows and soft cap.
#  1. GPU tests: mosaic_gpu_bwd's new window / soft-cap cases (+ two old ones) against the fp32
#     reference, and jattn's Mosaic forward + Mosaic backward with those masks.
#  2. Timing (experiments/probe_mosaic_bwd_masks.py): fwd+bwd with the Mosaic backward against
#     the Triton backward (the masked default until now) and cuDNN, one process per case.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${T_TESTS:-330} python3 -m pytest -q -m gpu -o addopts="" -p no:cacheprovider \
    tests/test_flash_mosaic_gpu_bwd.py -k "window or soft_cap or d128_causal_gqa or after_mosaic" \
    > "$OUT/gpu_tests_bwd.txt" 2>&1
  echo "bwd tests rc=$?"; tail -4 "$OUT/gpu_tests_bwd.txt"
  timeout ${T_TESTS2:-200} python3 -m pytest -q -m gpu -o addopts="" -p no:cacheprovider \
    tests/test_flash_mosaic_gpu.py -k "test_gpu_registered_forward_and_mosaic_backward" \
    > "$OUT/gpu_tests_jattn.txt" 2>&1
  echo "jattn tests rc=$?"; tail -4 "$OUT/gpu_tests_jattn.txt"
fi
for c in ${CASES:-window512 soft_cap_causal}; do
  timeout ${T_PROBE:-150} python3 experiments/probe_mosaic_bwd_masks.py --cases $c \
    --configs "${CONFIGS:-}" --out "$OUT/probe_$c.json" > "$OUT/probe_$c.txt" 2>&1
  echo "probe $c rc=$?"; grep -v Warn "$OUT/probe_$c.txt" | cut -c1-260
done
