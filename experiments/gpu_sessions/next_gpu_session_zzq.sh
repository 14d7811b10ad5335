#!/usr/bin/env bash
# Session 26, third call: segment ids in the Mosaic GPU backward (now jattn's default backward
# for every mask at D64/D128). GPU tests of mosaic_gpu_bwd's segment cases, jattn's Mosaic
# forward + backward with segment ids (explicit and default path), and the fwd+bwd probe on
# packed documents (cuDNN on the same documents as separate rows).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${T_TESTS:-150} python3 -m pytest -q -m gpu -o addopts="" -p no:cacheprovider -rf \
    tests/test_flash_mosaic_gpu_bwd.py -k "segments" > "$OUT/gpu_tests_bwd_seg.txt" 2>&1
  echo "bwd seg tests rc=$?"; grep -E "passed|failed|FAILED" "$OUT/gpu_tests_bwd_seg.txt" | head
  timeout ${T_TESTS2:-200} python3 -m pytest -q -m gpu -o addopts="" -p no:cacheprovider -rf \
    tests/test_flash_mosaic_gpu.py -k "(test_gpu_registered_forward_and_mosaic_backward or test_gpu_registered_forward_and_vjp) and segments" \
    > "$OUT/gpu_tests_jattn_seg.txt" 2>&1
  echo "jattn seg tests rc=$?"; grep -E "passed|failed|FAILED" "$OUT/gpu_tests_jattn_seg.txt" | head
fi
for c in ${CASES:-packed4 packed16_d64}; do
  timeout ${T_PROBE:-100} python3 experiments/probe_mosaic_bwd_masks.py --cases $c \
    --configs "${CONFIGS:-}" --out "$OUT/probe_$c.json" > "$OUT/probe_$c.txt" 2>&1
  echo "probe $c rc=$?"; grep -v Warn "$OUT/probe_$c.txt" | grep "^{" | cut -c1-260
done
