#!/usr/bin/env bash
# One GPU call (~4 min), session 19:
# (1) block-sparse forward at 64K (B1 H16 D128 bf16, q128 k64 selection, ~19% of causal tiles):
#     the Mosaic GPU forward walking the schedule with its default tiles against the same with
#     overlap_softmax (+ early_k_load + pingpong_handoff; its walk GPU tests pass since run 61),
#     outputs compared with each other and with the "triton" implementation;
# (2) packed 4 x 4K documents (the tile-sum gate was 1.209 in run 63): the overlap entry against
#     3 stages (no_reduction_scratch) and 64-key tiles. Outputs under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
timeout ${T_AB:-150} python3 -c "
import dataclasses as dc, json
import jax, jax.numpy as jnp
from jattn import sparse as sp
from pallas_kernels._timing import timed
s, h, d, qbs, bs = 65536, 16, 128, 128, 64
top_k, frac = sp.causal_top_k_for_density(s, 0.19, block_size=bs, q_block_size=qbs)
ks = jax.random.split(jax.random.key(1), 9)
sets = [tuple(jax.random.normal(ks[3 * i + j], (1, s, h, d), jnp.bfloat16) for j in range(3)) for i in range(3)]
sel = jax.jit(lambda q, k: sp.select_blocks(q, k, block_size=bs, q_block_size=qbs, top_k=top_k))(*sets[0][:2])
orig = sp._mosaic_gpu_block_sizes
ov = lambda *a: (lambda f, b: (dc.replace(f, overlap_softmax=True, pingpong_handoff=True, early_k_load=True, k_wait_in_pv=False, softmax_fence=False), b))(*orig(*a))
rows, outs = [], {}
for name, fn in [('default', orig), ('overlap', ov), ('default_again', orig)]:
  sp._mosaic_gpu_block_sizes = fn
  f = lambda q, k, v: sp.block_sparse_attention(q, k, v, sel, implementation='mosaic_gpu')
  out, ms = timed(jax.jit(f), sets)
  outs[name] = jax.jit(f)(*sets[0]).astype(jnp.float32)
  rows.append(dict(name=name, ms=ms))
  print(name, round(ms, 4), 'ms', flush=True)
sp._mosaic_gpu_block_sizes = orig
tri = jax.jit(lambda q, k, v: sp.block_sparse_attention(q, k, v, sel, implementation='triton'))(*sets[0]).astype(jnp.float32)
for n, o in outs.items():
  print(n, 'max abs diff vs triton', float(jnp.max(jnp.abs(o - tri))), 'density', frac)
json.dump(dict(rows=rows, top_k=int(top_k), density=float(frac)), open('$OUT/h200_sparse_fwd_overlap_ab.json', 'w'), indent=1)
" > "$OUT/sparse_fwd_overlap_ab.txt" 2>&1
echo "sparse fwd overlap A/B rc=$?"; grep -v Warning "$OUT/sparse_fwd_overlap_ab.txt" | tail -8
timeout ${T_SWEEP:-150} python3 -c "
import dataclasses as dc, json
from pallas_kernels.flash import mosaic_gpu as m
b = m.default_block_sizes(128, mask='causal_segments')
r = lambda **k: dc.replace(b, **k)
rows = m._sweep(docs=4, configs=[b, r(num_stages=3, no_reduction_scratch=True), r(block_k=64)])
json.dump(rows, open('$OUT/h200_docs4_variants.json', 'w'), indent=1, default=str)
" > "$OUT/sweep_docs4_variants.txt" 2>&1
echo "sweep docs4 variants rc=$?"; grep "^{" "$OUT/sweep_docs4_variants.txt" | sed -E "s/compute_registers=232, //; s/backward='triton', //; s/block_q=64, //; s/q_major_grid=False, //; s/q_tiles_per_program=1, //" | cut -c1-300
