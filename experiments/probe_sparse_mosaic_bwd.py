"""Block-sparse training on Hopper: the Mosaic GPU backward walking a selection's schedule
(session 27) against the Triton backward on the same schedule, in one process.

B1 H16 D128 bf16 causal, a top-K selection of (q_block_size, block_size) blocks keeping ~19% of
the causal tiles (``jattn.sparse.causal_top_k_for_density``, the bench's recipe), forward +
backward (``jax.vjp``), timed with the bench's timer on 3 rotating input sets:

  * ``kernels[mosaic_fwd+triton_bwd]`` / ``kernels[mosaic_fwd+mosaic_bwd]``: the Mosaic GPU
    forward walking the schedule (built once, outside the timing) with either backward;
  * ``sparse_attention[mosaic_gpu]`` / ``sparse_attention[triton]``: the whole call, selection
    included (jattn's "mosaic_gpu" path runs the Mosaic backward since session 27);
  * the dense causal baselines: ``jattn.flash_attention`` default (Mosaic GPU forward and
    backward on sm90) and ``implementation="triton"``.
  * forward only (op "sparse_fwd_ab"): the Mosaic GPU forward on the schedule and the dense
    default's forward, so the fwd+bwd rows split into their passes.
  * ``--trace`` (op "sparse_trace"): per-kernel device time (``experiments.kernel_trace``, a
    CUPTI trace) of the whole Hopper call and of the dense default, fwd+bwd: where the time
    goes between selection, list building and the three kernels.

Checks in the same run: the two kernel variants' gradients against each other, the two
``sparse_attention`` paths' gradients against each other, and the Mosaic path's output on the
last 512 queries of two heads against the fp32 reference over the selection.

Usage (GPU): python -m experiments.probe_sparse_mosaic_bwd --seqs 16384,65536 --out rows.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np


def _rel(a, b):
  a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _fwdbwd(attn):
  def f(q, k, v, do):
    out, vjp = jax.vjp(attn, q, k, v)
    return out, vjp(do)
  return jax.jit(f)


def probe(seq, *, heads=16, head_dim=128, q_block_size=128, block_size=64, fraction=0.19,
          rows=None, bwd_configs=(), kernels_only=False, trace=False):
  """Rows (dicts) of one sequence length; see the module docstring. ``bwd_configs``: more
  ``mosaic_gpu_bwd.BlockSizes`` timed as ``kernels[mosaic_fwd+mosaic_bwd <config>]`` on the same
  schedule (their gradients checked against the Triton backward's); ``kernels_only``: skip the
  dense baselines and the whole calls; ``trace``: only the per-kernel trace rows."""
  from jattn import sparse as sp
  from jattn.attention import flash_attention
  from pallas_kernels._timing import time_fn
  from pallas_kernels.block_schedule import make_schedule
  from pallas_kernels.flash import mosaic_gpu as mg
  from pallas_kernels.flash import triton as ft
  rows = [] if rows is None else rows
  keys = jax.random.split(jax.random.key(seq), 12)
  sets = [tuple(jax.random.normal(keys[4 * i + j], (1, seq, heads, head_dim), jnp.bfloat16)
                for j in range(4)) for i in range(3)]
  top_k, _ = sp.causal_top_k_for_density(seq, fraction, block_size=block_size,
                                         q_block_size=q_block_size)
  base = f"B1 S{seq // 1024}K H{heads} D{head_dim} causal"
  case = f"{base} top{fraction:.0%} q{q_block_size} k{block_size}"
  kw = dict(block_size=block_size, q_block_size=q_block_size, top_k=top_k)

  def row(impl, fn, argsets, **extra):
    ms, spread = time_fn(fn, argsets)
    r = dict(op="sparse_fwd_ab" if "forward only" in impl else "sparse_fwdbwd_ab",
             case=case if "dense" not in impl else base, impl=impl, ms=ms, spread_ms=spread,
             **extra)
    rows.append(r)
    print(json.dumps(r), flush=True)
    return ms

  if trace:
    return _trace_rows(seq, sets, kw, case, base, rows)
  if not kernels_only:
    dense_ms = row("jattn_default_dense", _fwdbwd(lambda q, k, v: flash_attention(
        q, k, v, causal=True)), sets)
    row("jattn_triton_dense", _fwdbwd(lambda q, k, v: flash_attention(
        q, k, v, causal=True, implementation="triton")), sets)

  # The kernels on a fixed schedule (selected once from the first set).
  q0, k0 = sets[0][0], sets[0][1]
  sel = jax.jit(lambda q, k: sp.select_blocks(q, k, **kw))(q0, k0)
  sched = jax.jit(lambda sel: make_schedule(seq, seq, q_block_size, block_size, causal=True,
                                            block_mask=sel.tile_mask(),
                                            max_kv_blocks=sel.max_selected))(sel)
  fwd_bs, _ = sp.attention._mosaic_gpu_block_sizes(mg, sel, head_dim, jnp.bfloat16, causal=True)
  variants = {
      "kernels[mosaic_fwd+triton_bwd]": dict(
          block_sizes=dataclasses.replace(fwd_bs, backward="triton"),
          bwd_block_sizes=sp.attention._kernel_block_sizes("triton", ft, sel, head_dim, jnp.bfloat16)),
      "kernels[mosaic_fwd+mosaic_bwd]": dict(
          block_sizes=dataclasses.replace(fwd_bs, backward="mosaic"), bwd_block_sizes=None),
  }
  # The forward alone on the schedule (its share of the fwd+bwd rows; the dense forward too,
  # for the per-pass sparse efficiency), forward only: out of jitted calls.
  fwd_only = jax.jit(lambda q, k, v, do: mg.flash_attention(q, k, v, schedule=sched, causal=True,
                                                            block_sizes=fwd_bs)[0])
  row("kernels[mosaic_fwd] (forward only)", fwd_only, sets, top_k=top_k)
  if not kernels_only:
    row("jattn_default_dense (forward only)", jax.jit(lambda q, k, v, do: flash_attention(
        q, k, v, causal=True)), sets)
  grads = {}
  for name, bsz in variants.items():
    fn = _fwdbwd(lambda q, k, v, bsz=bsz: mg.flash_attention(q, k, v, schedule=sched,
                                                            causal=True, **bsz)[0])
    grads[name] = fn(*sets[0])
    row(name, fn, sets, top_k=top_k)
  a, b = grads.values()
  diff = {n: _rel(x, y) for n, x, y in zip(("out", "dq", "dk", "dv"), (a[0],) + a[1],
                                           (b[0],) + b[1])}
  print("kernels mosaic vs triton backward rel diff:", diff, flush=True)
  rows[-1].update(rel_diff_vs_triton_bwd=diff, ok=bool(max(diff.values()) < 1e-2))
  for cfg in bwd_configs:
    name = f"kernels[mosaic_fwd+mosaic_bwd {cfg}]"
    try:
      fn = _fwdbwd(lambda q, k, v, cfg=cfg: mg.flash_attention(
          q, k, v, schedule=sched, causal=True, block_sizes=fwd_bs, bwd_block_sizes=cfg)[0])
      g = fn(*sets[0])
      row(name, fn, sets, top_k=top_k)
      d = {n: _rel(x, y) for n, x, y in zip(("dq", "dk", "dv"), g[1], a[1])}
      rows[-1].update(rel_diff_vs_triton_bwd=d, ok=bool(max(d.values()) < 1e-2))
    except Exception as e:   # e.g. shared memory: record and go on
      rows.append(dict(op="sparse_fwdbwd_ab", case=case, impl=name, ok=False,
                       error=f"{type(e).__name__}: {e}"[:300]))
      print(rows[-1], flush=True)
  if kernels_only:
    return rows

  # The whole call, selection included.
  full = {}
  for impl in ("triton", "mosaic_gpu"):
    fn = _fwdbwd(lambda q, k, v, impl=impl: sp.sparse_attention(q, k, v, implementation=impl,
                                                                **kw))
    full[impl] = fn(*sets[0])
    ms = row(f"sparse_attention[{impl}]", fn, sets, top_k=top_k, speedup_vs_default_dense=None)
    rows[-1]["speedup_vs_default_dense"] = dense_ms / ms
  a, b = full["mosaic_gpu"], full["triton"]
  diff = {n: _rel(x, y) for n, x, y in zip(("out", "dq", "dk", "dv"), (a[0],) + a[1],
                                           (b[0],) + b[1])}
  # The output's last 512 queries of two heads against the fp32 reference over the selection.
  q, k, v, _ = sets[0]
  out, sel = jax.jit(lambda q, k, v: sp.sparse_attention(q, k, v, return_selection=True,
                                                          implementation="mosaic_gpu",
                                                          **kw))(q, k, v)
  tail, nqt = 512, 512 // q_block_size
  sub = sp.BlockSelection(indices=sel.indices[:, :2, -nqt:], counts=sel.counts[:, :2, -nqt:],
                          num_visible=sel.num_visible[:, :2, -nqt:], scores=None,
                          block_size=block_size, q_block_size=q_block_size, q_len=tail,
                          kv_len=seq)
  ref = sp.block_sparse_attention(q[:, -tail:, :2].astype(jnp.float32),
                                  k[:, :, :2].astype(jnp.float32),
                                  v[:, :, :2].astype(jnp.float32), sub, implementation="xla")
  err = _rel(out[:, -tail:, :2], ref)
  print("sparse_attention mosaic_gpu vs triton rel diff:", diff, "out vs reference:", err,
        flush=True)
  rows[-1].update(rel_diff_vs_triton=diff, rel_err=err,
                  ok=bool(max(diff.values()) < 2e-2 and err < 2e-2))
  return rows


def _trace_rows(seq, sets, kw, case, base, rows, calls=6, top=24):
  """Per-kernel device time per call (CUPTI trace) of the Hopper ``sparse_attention`` call and
  the dense default, fwd+bwd; the kernels' names, sums and spans go in the rows."""
  from experiments.kernel_trace import format_times, kernel_times
  from jattn import sparse as sp
  from jattn.attention import flash_attention
  fns = {
      "sparse_attention[mosaic_gpu]": (case, _fwdbwd(lambda q, k, v: sp.sparse_attention(
          q, k, v, implementation="mosaic_gpu", **kw))),
      "jattn_default_dense": (base, _fwdbwd(lambda q, k, v: flash_attention(q, k, v,
                                                                            causal=True))),
  }
  for impl, (c, fn) in fns.items():
    r = kernel_times(fn, sets, calls=calls, warmup=2)
    per = {k: round(v, 2) for k, v in list(r["per_kernel_us"].items())[:top]}
    rows.append(dict(op="sparse_trace", case=c, impl=impl, sum_us=r["sum_us"],
                     span_us=r["span_us"], events_per_call=r["events"] / r["calls"],
                     per_kernel_us=per))
    print(format_times(f"S{seq} {impl}", r, top=top), flush=True)
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seqs", default="16384,65536")
  p.add_argument("--q-block-size", type=int, default=128)
  p.add_argument("--block-size", type=int, default=64)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--bwd-configs", default="",
                 help="';'-separated mosaic_gpu_bwd.BlockSizes fields, e.g. '64,64,64,64,3,3'")
  p.add_argument("--kernels-only", action="store_true")
  p.add_argument("--trace", action="store_true",
                 help="only the per-kernel trace rows (experiments.kernel_trace)")
  p.add_argument("--out", default=None)
  a = p.parse_args(argv)
  from pallas_kernels.flash import mosaic_gpu_bwd as mb
  cfgs = [mb.BlockSizes(*(int(x) for x in c.split(","))) for c in a.bwd_configs.split(";") if c]
  rows = []
  for s in (int(x) for x in a.seqs.split(",")):
    try:
      probe(s, head_dim=a.head_dim, q_block_size=a.q_block_size, block_size=a.block_size,
            rows=rows, bwd_configs=cfgs, kernels_only=a.kernels_only, trace=a.trace)
    except Exception as e:   # record and go on
      rows.append(dict(op="sparse_fwdbwd_ab", case=f"S{s}", ok=False,
                       error=f"{type(e).__name__}: {e}"[:800]))
      print(rows[-1], file=sys.stderr, flush=True)
  meta = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__)
  if a.out:
    with open(a.out, "w") as f:
      json.dump(dict(meta=meta, rows=rows), f, indent=1)
  return rows


if __name__ == "__main__":
  main()
