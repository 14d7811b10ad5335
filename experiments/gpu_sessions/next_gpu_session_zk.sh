#!/usr/bin/env bash
# One GPU call (~5-6 min), written in session 22: (1) edge masks (default since session 22:
# a window's left-edge tiles without the right bound, right-edge tiles without the left bound,
# no padded-key compare for whole tiles; BlockSizes.all_bounds_mask=True is the previous mask)
# on the causal window 512 (issue 8: 1.59x its tile sum in run 76), interleaved A/B, with the
# entry's 64-key tiles and with 128-key tiles (whose masked tiles cost ~2x a full one in run
# 52's profile, which is why 64 won in run 33); (2) FlashAttention-3's register split
# (compute 240 / memory 24, BlockSizes.memory_registers) on the D128 dense / causal entries.
# GPU tests first (the new *edges* / *registers* cases and every window case). Outputs
# under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_TESTS:-150} python3 -m pytest -q -rfE --tb=short -m gpu -p no:cacheprovider -o addopts="" \
  tests/test_flash_mosaic_gpu.py -k "edges or registers or window" > "$OUT/gpu_tests_edges.txt" 2>&1
echo "edge/register GPU tests rc=$?"; tail -2 "$OUT/gpu_tests_edges.txt"
MOSAIC_GPU_DUMP_PTXAS=1 timeout 90 python3 -c "
import jax, jax.numpy as jnp
from pallas_kernels.flash import mosaic_gpu as m
q = jax.random.normal(jax.random.key(0), (1, 1024, 2, 128), jnp.bfloat16)
bs = m.default_block_sizes(128, mask='causal_window')
print(bs)
jax.block_until_ready(jax.jit(lambda q: m.flash_attention(q, q, q, block_sizes=bs, causal=True,
    local_window_size=(511, 0))[0])(q))
" > "$OUT/ptxas_window_edges.txt" 2>&1
echo "ptxas window rc=$?"; grep -i -E "registers|spill|C75" "$OUT/ptxas_window_edges.txt" | sort | uniq -c | cut -c1-160 | head -6
short='s/BlockSizes\(block_q=64, block_k=([0-9]+).*compute_registers=([0-9]+).*all_bounds_mask=([A-Za-z]+), memory_registers=([0-9]+)\)/bk=\1 regs=\2\/\4 all_bounds=\3/'
timeout ${T_WINDOW:-130} python3 -c "
import dataclasses as dc, json
from pallas_kernels.flash import mosaic_gpu as m
e = m.default_block_sizes(128, mask='causal_window')
old = dc.replace(e, all_bounds_mask=True)
e128 = dc.replace(e, block_k=128)
old128 = dc.replace(e128, all_bounds_mask=True)
rows = m._sweep(head_dim=128, causal=True, local_window_size=(511, 0),
                configs=[e, old, e128, old128, e, old, e128, old128])
json.dump(rows, open('$OUT/sweep_window_edges.json', 'w'), indent=1, default=str)
" 2>&1 | grep -v "^WARNING" | sed -E "$short" | tail -9
for causal in False True; do
  timeout ${T_REGS:-110} python3 -c "
import dataclasses as dc, json
from pallas_kernels.flash import mosaic_gpu as m
from pallas_kernels.tuning import mask_kind
base = m.default_block_sizes(128, mask=mask_kind($causal, None))
base = m.fit_tail_kv_splits(base, (2, 16384, 16, 128), (2, 16384, 16, 128), causal=$causal)
r = dc.replace(base, compute_registers=240, memory_registers=24)
rows = m._sweep(head_dim=128, causal=$causal, configs=[base, r, base, r])
json.dump(rows, open('$OUT/sweep_registers_causal_$causal.json', 'w'), indent=1, default=str)
" 2>&1 | grep -v "^WARNING" | sed -E "$short" | tail -5
done
