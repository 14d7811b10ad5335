#!/usr/bin/env bash
# Next session (27): the bench's own rows for session 26's masked Mosaic backward, and the D64
# backward tiles that run 110 suggested. ~8 minutes on a warm machine; print what matters.
#  1. bench_kernels, B2 S16K H16 D128, dense / window / packed, fwd and fwd+bwd (jattn's default
#     now runs the Mosaic backward for every mask), against cuDNN (tokamax with --carry .whl:
#     IMPLS=jattn_default,jax_nn_cudnn,tokamax_mosaic).
#  2. mosaic_gpu_bwd._sweep_bwd at D64 dense and causal with 64-key dQ tiles (run 110: 4% faster
#     on the D64 causal window; the D64 'all' entry, 128-key dQ tiles, was never swept).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_BENCH:-300} python3 -m experiments.bench_kernels --ops flash --seqs 16384 \
  --masks dense,window,packed --impls ${IMPLS:-jattn_default,jax_nn_cudnn} \
  --out "$OUT/bench_masks.json" > "$OUT/bench_masks.txt" 2>&1
echo "bench rc=$?"; grep -E "fwd|tile_sum" "$OUT/bench_masks.txt" | grep -v Warn | cut -c1-220 | head -30
for causal in False True; do
  timeout ${T_SWEEP:-120} python3 -c "
import dataclasses
from pallas_kernels.flash import mosaic_gpu_bwd as mb
base = mb.default_block_sizes(64)
mb._sweep_bwd(head_dim=64, causal=$causal, configs=[base, dataclasses.replace(base, block_k_dq=64),
              dataclasses.replace(base, block_k_dq=64, num_stages_dq=2)])
" > "$OUT/sweep_bwd_d64_causal$causal.txt" 2>&1
  echo "sweep d64 causal=$causal rc=$?"; grep "'ms'" "$OUT/sweep_bwd_d64_causal$causal.txt" | cut -c1-200
done
