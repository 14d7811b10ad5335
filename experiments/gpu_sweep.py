"""Block-size sweep and A/B cases of the Triton flash kernels on the GPU (JSON rows to OUT).

    python -m experiments.gpu_sweep OUT.json [--cases causal_bwd,...] [--seqs 4096,16384]
    python -m experiments.gpu_sweep OUT.json --dry-run   # CPU: tiny sizes, Pallas interpreter

Case sets (``--cases``, default ``causal_bwd``):
  * ``causal_bwd``: why the causal backward trails tokamax-triton (docs/kernels.md, "Causal
    backward vs tokamax"): B2 H16 D128 bf16 causal, the default against each backward option
    (``CAUSAL_BWD_CONFIGS``), each with forward, forward+backward, backward alone and each
    backward kernel alone (bwd_ms, dkv_ms, dq_ms, prep_ms; the ``fused*`` configs run one
    backward kernel, so no dkv_ms / dq_ms), plus tokamax's Triton op timed the same way in the
    same process when it imports.
  * ``causal_bwd_dense``: the same configs non-causal (an option must not slow it down).
  * ``launch``: launch order A/B (the default groups 4 (batch, head) pairs, heaviest first;
    head_group=1 is the per-head order of runs 1-5).
  * ``tiles``: the tile sweep of run 3 (the default, the old single-tile default, others).

The winners go into ``_DEFAULT_BLOCK_SIZES`` in ``pallas_kernels/flash/triton.py``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp

from pallas_kernels.flash import triton as ft


def causal_bwd_configs(head_dim: int = 128, dtype=jnp.bfloat16) -> dict:
  """name -> BlockSizes for the causal-backward A/B (the first is the default)."""
  d = ft.default_block_sizes(head_dim, dtype)
  return {
      "default": d,
      # the D128 default before session 12 (8 warps x 3 stages, 64-row steps)
      "prev_default": ft.PREV_D128_BF16 if (head_dim, jnp.dtype(dtype).itemsize) == (128, 2)
                      else d,
      # dK/dV walks 64-row q tiles (= its chunk): the diagonal's all-masked chunks are skipped
      # and only the chunk that crosses the diagonal is masked (bit-for-bit the same terms).
      "dkv_block_q64": dataclasses.replace(d, dkv_block_q=d.dkv_q_chunk),
      # tokamax 0.0.17's Triton VJP heuristic on an H200 (no H200 autotuning cache): dK/dV steps
      # of 64 kv x 32 q, dQ steps of 64 q x 32 kv, 4 warps, 2 stages (two CTAs per SM).
      "tokamax_tiles": dataclasses.replace(d, bwd_block_q=64, bwd_block_k=64, bwd_num_warps=4,
                                           bwd_num_stages=2, dkv_q_chunk=32, dq_k_chunk=32),
      "tokamax_tiles+dkv_block_q32": dataclasses.replace(
          d, bwd_block_q=64, bwd_block_k=64, bwd_num_warps=4, bwd_num_stages=2, dkv_q_chunk=32,
          dq_k_chunk=32, dkv_block_q=32),
      # default tiles, 4 warps x 2 stages with 32-row steps (two CTAs per SM if registers allow)
      "bwd_w4s2_chunk32": dataclasses.replace(d, bwd_num_warps=4, bwd_num_stages=2,
                                              dkv_q_chunk=32, dq_k_chunk=32, dkv_block_q=32),
      # One fused backward kernel (BlockSizes.fused_bwd): program t does dK/dV of kv span t, then
      # dQ of q span t (spans of max(bwd tiles) rows), constant work per program under causal.
      # With the default tiles (8 warps, 3 stages, one CTA per SM), with the diagonal chunks
      # skipped, and with tokamax's tiling/launch (4 warps, 2 stages: two CTAs per SM, so an
      # SM can hold one program in its dK/dV phase and another in its dQ phase).
      "fused": dataclasses.replace(d, fused_bwd=True),
      "fused+dkv_block_q64": dataclasses.replace(d, fused_bwd=True, dkv_block_q=d.dkv_q_chunk),
      "fused+tokamax_tiles": dataclasses.replace(
          d, bwd_block_q=64, bwd_block_k=64, bwd_num_warps=4, bwd_num_stages=2, dkv_q_chunk=32,
          dq_k_chunk=32, fused_bwd=True),
  }


def _tokamax_rows(batch, seq, heads, head_dim, causal, dtype, iters):
  """tokamax-triton timed like ``ft._sweep`` (same inputs, same timer); [] if not importable."""
  try:
    import tokamax
  except Exception as e:  # pragma: no cover - optional anchor
    print(f"tokamax not importable: {e}")
    return []
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (batch, seq, heads, head_dim), dtype)
  k = jax.random.normal(keys[1], (batch, seq, heads, head_dim), dtype)
  v = jax.random.normal(keys[2], (batch, seq, heads, head_dim), dtype)
  f = lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=causal,
                                                    implementation="triton")

  def timeit(fn, *args):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3

  row = dict(config="tokamax_triton")
  try:
    row["fwd_ms"] = timeit(jax.jit(f), q, k, v)
    row["fwd_bwd_ms"] = timeit(jax.jit(jax.grad(
        lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))), q, k, v)
    out, vjp_fn = jax.vjp(f, q, k, v)
    ct = jax.random.normal(keys[3], out.shape, out.dtype)
    row["bwd_ms"] = timeit(jax.jit(lambda fn, ct: fn(ct)), vjp_fn, ct)
  except Exception as e:
    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
  print(row, flush=True)
  return [row]


def plan(case_sets, seqs):
  """[(seq, causal, window, {name: BlockSizes}, time_bwd, with_tokamax)] for the case sets."""
  out = []
  ab = causal_bwd_configs()
  for cs in case_sets:
    if cs == "causal_bwd":
      out += [(s, True, None, ab, True, True) for s in seqs]
    elif cs == "causal_bwd_dense":
      out += [(s, False, None, ab, True, True) for s in seqs]
    elif cs == "launch":
      d = ft.default_block_sizes(128, jnp.bfloat16)
      cfgs = {"default": d, "head_group1": dataclasses.replace(d, head_group=1)}
      out += [(s, True, None, cfgs, False, False) for s in seqs]
    elif cs == "tiles":
      allc = ft._bench_configs()
      # 0: the default (per-pass tiles), 3: the previous single-tile default, then other tilings.
      cfgs = {f"bench{i}": allc[i] for i in (0, 3, 6, 7, 9, 11) if i < len(allc)}
      out += [(16384, causal, window, cfgs, False, False) for causal, window in
              ((False, None), (True, None), (True, (511, 0)))]
    else:
      raise ValueError(f"unknown case set {cs!r}")
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("out", help="JSON file (rewritten after every row)")
  p.add_argument("--cases", default="causal_bwd",
                 help="comma list of: causal_bwd, causal_bwd_dense, launch, tiles")
  p.add_argument("--seqs", default="4096,16384")
  p.add_argument("--iters", type=int, default=10, help="timed calls per row (median)")
  p.add_argument("--configs", default=None,
                 help="causal_bwd*: comma list of config names to keep (default: all)")
  p.add_argument("--no-tokamax", action="store_true")
  p.add_argument("--dry-run", action="store_true",
                 help="CPU smoke test: seq 128, B1 H2 D32 fp32 configs, Pallas interpreter")
  args = p.parse_args(argv)
  seqs = [int(s) for s in args.seqs.split(",")]
  cases = plan(args.cases.split(","), seqs)
  keep = None if args.configs is None else set(args.configs.split(","))
  rows = []
  for seq, causal, window, cfgs, time_bwd, with_tk in cases:
    names = [n for n in cfgs if keep is None or n in keep or not time_bwd]
    kw = dict(seq=seq, causal=causal, local_window_size=window, iters=args.iters,
              time_bwd=time_bwd)
    if args.dry_run:
      # Tiny problem in the interpreter: only checks that every config builds and runs.
      small = {n: dataclasses.replace(cfgs[n], block_q=16, block_k=16,
                                      bwd_block_q=32 if cfgs[n].bwd_tiles[0] > 64 else 16,
                                      bwd_block_k=16, dkv_q_chunk=16, dq_k_chunk=16,
                                      dkv_block_q=16 if cfgs[n].dkv_block_q else None)
               for n in names}
      kw.update(seq=128, batch=1, q_heads=2, kv_heads=2, head_dim=32, dtype=jnp.float32,
                interpret=True, iters=1)
      cfg_list = [small[n] for n in names]
    else:
      cfg_list = [cfgs[n] for n in names]
    for name, r in zip(names, ft._sweep(configs=cfg_list, **kw)):
      r = dict(r)
      r["config"] = dataclasses.asdict(r["config"])
      r.update(name=name, seq=seq, causal=causal, window=window)
      rows.append(r)
      with open(args.out, "w") as fh:
        json.dump(rows, fh, indent=1)
    if with_tk and not args.no_tokamax and not args.dry_run:
      for r in _tokamax_rows(2, seq, 16, 128, causal, jnp.bfloat16, args.iters):
        r.update(name="tokamax_triton", seq=seq, causal=causal, window=window)
        rows.append(r)
        with open(args.out, "w") as fh:
          json.dump(rows, fh, indent=1)
  return rows


if __name__ == "__main__":
  main()
