"""Kernel benchmark: every jattn implementation and the anchors, timed in one process.

    python -m experiments.bench_kernels [--ops flash,decode,sparse] [--out FILE] [--quick]

Writes ``experiments/results/h200_kernels.json`` (or --out):
``{"meta": {date, device, jax_version, ...}, "rows": [{"op", "case", "impl", "ms", ...}]}``
and prints a markdown table. Every timed output is checked against a reference in the same run
(``rel_err``); a row whose check fails is recorded with ``"ok": false``. Inputs are random (never
zeros); each timing rotates over several input sets so repeated calls do not just hit L2.

Anchors: jax.nn.dot_product_attention ("cudnn", "xla"); tokamax ("mosaic", "triton", "cudnn")
when importable; JAX's Pallas GPU decode (``jax.experimental.pallas.ops.gpu.decode_attention``)
when importable. Compare only ratios from one run.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform
import subprocess
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from pallas_kernels.flash.reference import attention_reference

ROWS = []
_OUT = {"path": None}


def _sync(x):
  jax.tree_util.tree_map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, x)
  return x


def time_fn(fn, arg_sets, *, iters=None, min_time=0.25, repeats=3):
  """Median milliseconds per call of ``fn(*args)``, rotating over ``arg_sets``.

  Args:
    fn: a jitted function.
    arg_sets: list of argument tuples (several, to defeat the L2 cache).
    iters: calls per measurement; default: enough for ``min_time`` seconds.
    min_time: target seconds per measurement when ``iters`` is None.
    repeats: measurements; the median is returned.

  Returns:
    (median_ms, spread_ms) where spread is max - min over the measurements.

  Example:
    >>> f = jax.jit(lambda x: x + 1)
    >>> ms, _ = time_fn(f, [(jnp.ones(4),)], iters=3, repeats=2)
  """
  for args in arg_sets:  # compile + warm up
    _sync(fn(*args))
  if iters is None:
    t0 = time.perf_counter()
    _sync(fn(*arg_sets[0]))
    one = max(time.perf_counter() - t0, 1e-5)
    iters = int(min(max(min_time / one, 3), 2000))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = None
    for i in range(iters):
      out = fn(*arg_sets[i % len(arg_sets)])
    _sync(out)
    times.append((time.perf_counter() - t0) * 1e3 / iters)
  return float(np.median(times)), float(max(times) - min(times))


def rel_err(x, ref):
  """||x - ref|| / ||ref|| in fp32 (NaN if x has NaN)."""
  x = jnp.asarray(x, jnp.float32)
  ref = jnp.asarray(ref, jnp.float32)
  return float(jnp.linalg.norm((x - ref).ravel()) / (jnp.linalg.norm(ref.ravel()) + 1e-30))


def record(**row):
  ROWS.append(row)
  if _OUT["path"]:  # write as we go, so a run stopped at its time limit keeps its rows
    with open(_OUT["path"], "w") as fh:
      json.dump({"meta": meta(), "rows": ROWS}, fh, indent=1)
  keys = ("op", "case", "impl", "ms", "tflops", "tbps", "speedup", "rel_err", "ok")
  print("  " + " ".join(f"{k}={row[k]:.4g}" if isinstance(row.get(k), float) else f"{k}={row.get(k)}"
                        for k in keys if k in row), flush=True)


def _tokamax():
  try:
    import tokamax  # noqa: F401
    return tokamax
  except Exception:  # pragma: no cover - optional anchor
    return None


# ----------------------------------------------------------------------------- flash attention
def flash_impls(causal, window):
  """name -> f(q, k, v) for every implementation (one that lacks the mask raises
  NotImplementedError, and ``bench_flash`` prints why it skips it: jattn_mosaic_gpu on windows)."""
  impls = {}
  for impl in ("triton", "mosaic_gpu"):
    impls[f"jattn_{impl}"] = functools.partial(jattn.flash_attention, causal=causal,
                                               local_window_size=window, implementation=impl)

  impls["jattn_default"] = functools.partial(jattn.flash_attention, causal=causal,
                                             local_window_size=window)   # None: see the plan

  def mosaic_triton_bwd(q, k, v):  # Hopper forward + Triton backward (the pre-run-21 default)
    from pallas_kernels.flash import mosaic_gpu as mg
    bs = dataclasses.replace(mg.default_block_sizes(q.shape[-1]), backward="triton")
    return jattn.flash_attention(q, k, v, causal=causal, local_window_size=window,
                                 implementation="mosaic_gpu", block_sizes=bs)
  impls["jattn_mosaic_gpu[triton_bwd]"] = mosaic_triton_bwd

  def prev_default(q, k, v):  # the Triton default before session 12 (A/B in the same run)
    from pallas_kernels.flash import triton as ft
    bs = ft.default_block_sizes(q.shape[-1], q.dtype)
    if (q.shape[-1], q.dtype.itemsize) == (128, 2):
      bs = ft.PREV_D128_BF16
    return jattn.flash_attention(q, k, v, causal=causal, local_window_size=window,
                                 implementation="triton", block_sizes=bs)
  impls["jattn_triton[prev_default]"] = prev_default
  if causal and window is None:  # launch-order A/B: the per-(batch, head) order of runs 1-5
    from pallas_kernels.flash import triton as ft

    def per_head(q, k, v):
      bs = dataclasses.replace(ft.default_block_sizes(q.shape[-1], q.dtype), head_group=1)
      return jattn.flash_attention(q, k, v, causal=True, implementation="triton", block_sizes=bs)
    impls["jattn_triton[head_group1]"] = per_head

    # Causal backward A/B (docs/kernels.md, "Causal backward vs tokamax"): the dK/dV kernel on
    # chunk-sized q tiles, and tokamax-triton's backward tiling/launch parameters.
    def with_config(name):
      def f(q, k, v):
        from experiments.gpu_sweep import causal_bwd_configs
        bs = causal_bwd_configs(q.shape[-1], q.dtype)[name]
        return jattn.flash_attention(q, k, v, causal=True, implementation="triton",
                                     block_sizes=bs)
      return f
    for name in ("dkv_block_q64", "tokamax_tiles"):
      impls[f"jattn_triton[{name}]"] = with_config(name)
    # One fused backward kernel of paired spans (BlockSizes.fused_bwd), default tiles.
    impls["jattn_triton[fused_bwd]"] = with_config("fused")
  impls["jax_nn_cudnn"] = functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                                            local_window_size=window, implementation="cudnn")
  impls["jax_nn_xla"] = functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                                          local_window_size=window, implementation="xla")
  tk = _tokamax()
  if tk is not None:
    for name in ("mosaic", "triton", "cudnn"):
      impls[f"tokamax_{name}"] = functools.partial(tk.dot_product_attention, is_causal=causal,
                                                   local_window_size=window, implementation=name)
  return impls


def bench_flash(cases, *, with_bwd=True, check_heads=2, impls=None, bwd_only=False):
  for (b, s, h, d, causal, window) in cases:
    case = f"B{b} S{s // 1024}K H{h} D{d}" + (" causal" if causal else "") + (
        f" window{window[0] + 1}" if window else "")
    print(f"[flash] {case}", flush=True)
    keys = jax.random.split(jax.random.key(s + d + causal), 9)
    sets = [tuple(jax.random.normal(keys[3 * i + j], (b, s, h, d), jnp.bfloat16) for j in range(3))
            for i in range(3)]
    flops = 4.0 * b * h * s * s * d
    if window is not None:
      # Exact visible pairs of a causal window (left, 0): each query sees min(i+1, left+1) keys.
      i = np.arange(s)
      flops = 4.0 * b * h * d * float(np.minimum(i + 1, window[0] + 1).sum())
    elif causal:
      flops /= 2
    q, k, v = sets[0]
    # Reference on a slice (batch 0, first heads) in fp32.
    sl = lambda x: x[:1, :, :check_heads]
    ref_out, _ = attention_reference(sl(q), sl(k), sl(v), causal=causal, local_window_size=window)
    ct = jax.random.normal(keys[-1], (b, s, h, d), jnp.bfloat16)
    ref_grads = None
    if with_bwd and s <= 4096:
      ref_grads = jax.grad(lambda q_, k_, v_: jnp.sum(attention_reference(
          q_, k_, v_, causal=causal, local_window_size=window)[0].astype(jnp.float32)
          * sl(ct).astype(jnp.float32)), argnums=(0, 1, 2))(sl(q), sl(k), sl(v))
    for name, f in flash_impls(causal, window).items():
      if (impls is not None and name not in impls) or (impls is None and name == "jattn_default"):
        continue   # jattn_default (implementation=None) repeats another row: only when named
      if name == "jax_nn_xla" and s > 4096:
        print("  jax_nn_xla: skipped above 4K (materialises the logits; fwd+bwd needs 80 GiB at 16K)")
        continue
      try:
        fwd = jax.jit(f)
        out = fwd(q, k, v)
        err = rel_err(sl(out), ref_out)
        ms, spread = time_fn(fwd, sets)
        record(op="flash_fwd", case=case, impl=name, ms=ms, spread_ms=spread,
               tflops=flops / ms / 1e9, rel_err=err, ok=bool(err < 2e-2))
        if not with_bwd:
          continue
        def loss(q_, k_, v_, f=f):
          return jnp.sum(f(q_, k_, v_).astype(jnp.float32) * ct.astype(jnp.float32))
        gfn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        grads = gfn(q, k, v)
        gerr = None
        if ref_grads is not None:
          gerr = max(rel_err(sl(g), r) for g, r in zip(grads, ref_grads))
        ms, spread = time_fn(gfn, sets)
        record(op="flash_fwd_bwd", case=case, impl=name, ms=ms, spread_ms=spread,
               tflops=3.5 * flops / ms / 1e9, rel_err=gerr,
               ok=bool(gerr is None or gerr < 2e-2))
        if bwd_only:
          # The backward alone: the VJP closure (a pytree of the saved residuals) is a jit
          # argument, so no forward runs in the timed program (no fwd+bwd - fwd subtraction).
          bsets = [(jax.vjp(f, *s)[1], ct) for s in sets]
          ms, spread = time_fn(jax.jit(lambda fn, c: fn(c)), bsets)
          record(op="flash_bwd", case=case, impl=name, ms=ms, spread_ms=spread,
                 tflops=2.5 * flops / ms / 1e9, ok=True)
      except NotImplementedError as e:  # e.g. jattn_mosaic_gpu on window cases: no row, a reason
        print(f"  {name}: skipped, not supported: {str(e)[:200]}")
      except Exception as e:  # record failures instead of hiding them
        msg = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"  {name}: FAILED {msg}")
        record(op="flash_fwd", case=case, impl=name, ms=None, error=msg, ok=False)


def bench_flash_packed(s=16384, docs=4, h=16, d=128, b=2):
  """Packed documents: four 4K documents per 16K row vs one 4K causal row x4."""
  case = f"B{b} S{s // 1024}K H{h} D{d} causal docs{docs}x{s // docs // 1024}K"
  print(f"[flash] {case}", flush=True)
  keys = jax.random.split(jax.random.key(7), 4)
  q, k, v = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16) for kk in keys[:3])
  seg = jnp.broadcast_to(jnp.repeat(jnp.arange(1, docs + 1, dtype=jnp.int32), s // docs), (b, s))
  for impl in ("triton",):
    f = jax.jit(lambda q, k, v, seg=seg: jattn.flash_attention(
        q, k, v, causal=True, segment_ids=seg, implementation=impl))
    out = f(q, k, v)
    n = s // docs
    ref, _ = attention_reference(q[:1, :n, :2], k[:1, :n, :2], v[:1, :n, :2], causal=True)
    err = rel_err(out[:1, :n, :2], ref)
    ms, spread = time_fn(f, [(q, k, v)])
    flops = 4.0 * b * h * n * n * d / 2 * docs
    record(op="flash_fwd", case=case, impl=f"jattn_{impl}", ms=ms, spread_ms=spread,
           tflops=flops / ms / 1e9, rel_err=err, ok=bool(err < 2e-2))


# ----------------------------------------------------------------------------- decode / sparse
def bench_decode(sweep=True):
  try:
    from jattn import decode as dec
  except ImportError:
    print("[decode] jattn.decode not available")
    return
  if not hasattr(dec, "bench_decode_cases"):
    print("[decode] no bench_decode_cases()")
    return
  for row in dec.bench_decode_cases(time_fn=time_fn, rel_err=rel_err, sweep=sweep):
    record(**row)


def bench_sparse(extra_impls=("mosaic_gpu",)):
  """Sparse training and decode rows (``jattn.sparse.bench_cases``): the Triton rows, plus
  ``extra_impls`` on the training cases (``jattn_mosaic_gpu_sparse``: the Hopper forward walking
  the same selection's schedule, the Triton backward), timed on the same inputs."""
  try:
    from jattn import sparse as sp
  except ImportError:
    print("[sparse] jattn.sparse not available")
    return
  if not hasattr(sp, "bench_cases"):
    print("[sparse] no bench_cases()")
    return
  for row in sp.bench_cases(time_fn=time_fn, rel_err=rel_err, extra_impls=tuple(extra_impls)):
    record(**row)


def meta():
  try:
    commit = os.environ.get("JATTN_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
  except Exception:
    commit = None
  dev = jax.devices()[0]
  tk = _tokamax()
  return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              device=getattr(dev, "device_kind", str(dev)), platform=dev.platform,
              jax_version=jax.__version__, jaxlib_version=jax.lib.__version__ if hasattr(jax.lib, "__version__") else None,
              python=platform.python_version(),
              tokamax_version=getattr(tk, "__version__", None) if tk else None,
              git_commit=commit, timing="median of 3 host-timed loops of async calls after warm-up, "
              "rotating 3 random bf16 input sets; flops 4*B*H*Sq*Sk*D (causal: visible pairs), "
              "fwd+bwd = 3.5x fwd")


def main(argv=None):
  try:
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.ERROR)  # tokamax's autotuning-cache warnings
  except ImportError:
    pass
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--ops", default="flash,decode,sparse")
  p.add_argument("--out", default="experiments/results/h200_kernels.json")
  p.add_argument("--quick", action="store_true", help="4K cases only")
  p.add_argument("--seqs", default="4096,16384", help="flash sequence lengths")
  p.add_argument("--no-sweep", action="store_true", help="decode: no block-size sweep")
  p.add_argument("--impls", default=None,
                 help="flash: comma list of implementation names to time (default: all)")
  p.add_argument("--head-dims", default="128",
                 help="flash: comma list of head dims (the issue's D64 / D256 gates: 64,256)")
  p.add_argument("--masks", default="dense,causal,window",
                 help="flash: comma list of mask kinds among dense, causal, window")
  p.add_argument("--bwd-only", action="store_true",
                 help="flash: also time the backward alone (op flash_bwd: VJP of saved residuals)")
  p.add_argument("--sparse-extra", default="mosaic_gpu",
                 help="sparse: comma list of implementations timed besides triton on the training "
                      "cases (rows jattn_<impl>_sparse; '' for none)")
  args = p.parse_args(argv)
  ops = args.ops.split(",")
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  _OUT["path"] = args.out
  if "flash" in ops:
    cases = []
    masks = args.masks.split(",")
    for d in (int(x) for x in args.head_dims.split(",")):
      for s in ((4096,) if args.quick else tuple(int(x) for x in args.seqs.split(","))):
        for causal, kind in ((False, "dense"), (True, "causal")):
          if kind in masks:
            cases.append((2, s, 16, d, causal, None))
        if "window" in masks:
          cases.append((2, s, 16, d, True, (511, 0)))
    bench_flash(cases, impls=None if args.impls is None else set(args.impls.split(",")),
                bwd_only=args.bwd_only)
    if not args.quick and args.impls is None:
      bench_flash_packed()
  if "decode" in ops:
    bench_decode(sweep=not args.no_sweep)
  if "sparse" in ops:
    bench_sparse(extra_impls=[x for x in args.sparse_extra.split(",") if x])
  result = {"meta": meta(), "rows": ROWS}
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out, "w") as fh:
    json.dump(result, fh, indent=1)
  print(markdown_table(ROWS))
  return result


def markdown_table(rows):
  """Markdown table of benchmark rows (op, case, impl, ms, TFLOP/s or TB/s, rel_err)."""
  lines = ["| op | case | impl | ms | TFLOP/s | TB/s | speedup | rel_err | ok |",
           "|---|---|---|---|---|---|---|---|---|"]
  fmt = lambda x: "" if x is None else (f"{x:.4g}" if isinstance(x, float) else str(x))
  for r in rows:
    lines.append("| " + " | ".join(fmt(r.get(k)) for k in (
        "op", "case", "impl", "ms", "tflops", "tbps", "speedup", "rel_err", "ok")) + " |")
  return "\n".join(lines)


if __name__ == "__main__":
  main()
