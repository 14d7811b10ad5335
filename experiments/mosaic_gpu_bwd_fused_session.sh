#!/usr/bin/env bash
# One GPU call for the fused Mosaic GPU backward (pallas_kernels/flash/mosaic_gpu_bwd_fused.py:
# dQ inside the dK/dV kernel by TMA reduce-add; v1 GPU-verified in runs 27-28, the v2 options
# (FusedOptions: pipelined / lean / 240-24 registers) never run on a GPU): a ptxas
# register/spill dump per variant (small calls, non-causal and causal), the GPU tests under their
# own limit (a first run of a barrier-driven kernel can hang; TEST_K selects), then
# _sweep_bwd_fused non-causal and causal at B2 S16K H16 D128 bf16 (v1, v2 and each change alone
# against cuDNN fwd+bwd and the two-kernel backward). Logs and JSON under $OUT.
#   bash experiments/mosaic_gpu_bwd_fused_session.sh
# Env: SKIP_PTXAS=1 / SKIP_TESTS=1 / SKIP_SWEEP=1, PTXAS_TIMEOUT / TEST_TIMEOUT /
# SWEEP_TIMEOUT (s per sweep), SEQ (16384), TEST_K (pytest -k expression, default: all).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/nvidia_smi.txt"
python3 -c "import jax; print(jax.__version__, jax.devices())"
if [ "${SKIP_PTXAS:-0}" != 1 ]; then
  # Registers and spills of the fused kernel (ptxas -v through Mosaic GPU), one small D128 call.
  # One labelled block per (variant, mask): ptxas prints after the '== label' line.
  MOSAIC_GPU_DUMP_PTXAS=1 timeout ${PTXAS_TIMEOUT:-150} python3 -c "
import sys, jax, jax.numpy as jnp
from pallas_kernels.flash import mosaic_gpu_bwd_fused as mf
x = jax.random.normal(jax.random.key(0), (1, 256, 2, 128), jnp.bfloat16)
lse = jnp.zeros((1, 2, 256), jnp.float32)
for label, bs, opts in mf._default_sweep_configs():
  for causal in (False, True):
    print(f'== {label} causal={causal}', flush=True); sys.stderr.flush()
    f = lambda *a: mf.flash_attention_bwd(*a, causal=causal, block_sizes=bs, options=opts)
    jax.block_until_ready(jax.jit(f)(x, x, x, x, lse, x))
    sys.stderr.flush()
print('ran')
" > "$OUT/ptxas_mosaic_bwd_fused.txt" 2>&1
  echo "ptxas dump rc=$?"
  grep -E "^== |spill|Used [0-9]+ registers|error|^ran" "$OUT/ptxas_mosaic_bwd_fused.txt" | head -40
fi
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider \
    -o addopts="" -k "${TEST_K:-}" tests/test_flash_mosaic_gpu_bwd_fused.py \
    > "$OUT/gpu_tests_mosaic_bwd_fused.txt" 2>&1
  echo "mosaic_gpu_bwd_fused tests rc=$?"; tail -40 "$OUT/gpu_tests_mosaic_bwd_fused.txt"
fi
if [ "${SKIP_SWEEP:-0}" != 1 ]; then
  for causal in False True; do
    timeout ${SWEEP_TIMEOUT:-200} python3 -c "
import json
from pallas_kernels.flash import mosaic_gpu_bwd_fused as mf
rows = mf._sweep_bwd_fused(seq=${SEQ:-16384}, causal=$causal)
json.dump(rows, open('$OUT/h200_mosaic_gpu_bwd_fused_sweep_causal_$causal.json', 'w'), indent=1)
" > "$OUT/sweep_bwd_fused_causal_$causal.txt" 2>&1
    echo "sweep causal=$causal rc=$?"; tail -20 "$OUT/sweep_bwd_fused_causal_$causal.txt"
  done
fi
