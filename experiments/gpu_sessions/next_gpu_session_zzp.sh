#!/usr/bin/env bash
# Session 26, second call: jattn's Mosaic forward + Mosaic backward GPU tests (11 cases, the
# masked ones included; the test now fits the table's block sizes as jattn does), the default
# path's masked VJP tests (window / soft cap now take the Mosaic backward by default), and the
# fwd+bwd probe for more window shapes with two backward tile variants.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${T_TESTS:-300} python3 -m pytest -q -m gpu -o addopts="" -p no:cacheprovider -rf \
    tests/test_flash_mosaic_gpu.py -k "test_gpu_registered_forward_and_mosaic_backward or (test_gpu_registered_forward_and_vjp and (window or soft_cap))" \
    > "$OUT/gpu_tests_jattn2.txt" 2>&1
  echo "jattn tests rc=$?"; grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests_jattn2.txt" | head -12
fi
for c in ${CASES:-window512_d64 window2048}; do
  timeout ${T_PROBE:-120} python3 experiments/probe_mosaic_bwd_masks.py --cases $c \
    --configs "${CONFIGS:-64,64,64,64,3,3;64,64,64,128,2,2}" --out "$OUT/probe_$c.json" \
    > "$OUT/probe_$c.txt" 2>&1
  echo "probe $c rc=$?"; grep -v Warn "$OUT/probe_$c.txt" | grep "^{" | cut -c1-260
done
