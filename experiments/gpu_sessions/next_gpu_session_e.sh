#!/usr/bin/env bash
# One GPU call (~7-8 min; run tool timeout_s 600), written in session 15 for session 16 (issue 8):
# (1) ptxas registers/spills of the two-kernel Mosaic backward and the forward (is "168 registers
# + spills" what every 3-warpgroup kernel reports, or only the fused backward? run 31), then
# (2) the Hopper forward's D128 sweep with BlockSizes.softmax_fence (never timed), non-causal and
# causal, one process each; rows print as they finish. Outputs under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
MOSAIC_GPU_DUMP_PTXAS=1 timeout ${T_PTXAS:-120} python3 -c "
import sys, jax, jax.numpy as jnp
from pallas_kernels.flash import mosaic_gpu as mg, mosaic_gpu_bwd as mb
x = jax.random.normal(jax.random.key(0), (1, 256, 2, 128), jnp.bfloat16)
lse = jnp.zeros((1, 2, 256), jnp.float32)
for causal in (False, True):
  print(f'== two-kernel backward causal={causal}', flush=True); sys.stderr.flush()
  jax.block_until_ready(jax.jit(lambda *a: mb.flash_attention_bwd(*a, causal=causal))(x, x, x, x, lse, x))
  sys.stderr.flush()
  for fence in (False, True):
    print(f'== forward causal={causal} softmax_fence={fence}', flush=True); sys.stderr.flush()
    bs = mg.BlockSizes(64, 128, 2, softmax_fence=fence)
    jax.block_until_ready(jax.jit(lambda q, k, v: mg.flash_attention(q, k, v, causal=causal, block_sizes=bs))(x, x, x))
    sys.stderr.flush()
print('ran')
" > "$OUT/ptxas_two_kernel_bwd_and_fwd.txt" 2>&1
echo "ptxas dump rc=$?"
grep -E "^== |spill|Used [0-9]+ registers|error|^ran" "$OUT/ptxas_two_kernel_bwd_and_fwd.txt" | head -40
for causal in False True; do
  timeout ${T_SWEEP:-170} python3 -c "
import json, jax
from pallas_kernels.flash import mosaic_gpu as m
rows = m._sweep(causal=$causal, iters=10)
json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, causal=$causal, rows=rows),
          open('$OUT/h200_mosaic_fwd_fence_sweep_causal_$causal.json', 'w'), indent=1, default=str)
" > "$OUT/fwd_fence_sweep_causal_$causal.txt" 2>&1
  echo "fwd sweep causal=$causal rc=$?"; grep "^{" "$OUT/fwd_fence_sweep_causal_$causal.txt" | cut -c1-200
done
