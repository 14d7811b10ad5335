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

Timer: ``pallas_kernels._timing.time_fn`` (also the Mosaic GPU sweeps'). Forward rows of the
Mosaic forward on a causal window (jattn_mosaic_gpu, its [no_fence] variant, and jattn_default
where it runs it) or on packed documents (jattn_mosaic_gpu, jattn_default) carry issue 8's gate, ``tile_sum_ms`` (the same implementation's
dense ms in this run x needed / all tiles, ``mosaic_tile_counts``) and ``tile_sum_ratio`` = ms /
tile_sum_ms (gate <= 1.2), when the dense row of the same shape ran first.
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
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from pallas_kernels._timing import random_sets, sync as _sync, time_fn  # noqa: F401 (re-exported)
from pallas_kernels.flash.reference import attention_reference

ROWS = []
_OUT = {"path": None}


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
  keys = ("op", "case", "impl", "ms", "tflops", "tbps", "speedup", "rel_err", "ok", "tile_sum_ms",
          "tile_sum_ratio")
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
  NotImplementedError, and ``bench_flash`` prints why it skips it)."""
  impls = {}
  for impl in ("triton", "mosaic_gpu"):
    impls[f"jattn_{impl}"] = functools.partial(jattn.flash_attention, causal=causal,
                                               local_window_size=window, implementation=impl)

  impls["jattn_default"] = functools.partial(jattn.flash_attention, causal=causal,
                                             local_window_size=window)   # None: see the plan

  def mosaic_with(**changes):  # the Hopper forward's default tiles for the mask kind, changed
    def f(q, k, v):
      bs = dataclasses.replace(jattn.flash_attention_plan(
          q, k, v, causal=causal, local_window_size=window, implementation="mosaic_gpu").config,
          **changes)
      return jattn.flash_attention(q, k, v, causal=causal, local_window_size=window,
                                   implementation="mosaic_gpu", block_sizes=bs)
    return f
  # Hopper forward + Triton backward (the pre-run-21 default); the forward without the softmax
  # fence (the D128 default since run 37: its A/B in one process).
  impls["jattn_mosaic_gpu[triton_bwd]"] = mosaic_with(backward="triton")
  impls["jattn_mosaic_gpu[no_fence]"] = mosaic_with(softmax_fence=False)
  if not causal and window is None:   # the last partial wave by key chunks (run 69; session 21)
    impls["jattn_mosaic_gpu[tail8]"] = mosaic_with(tail_kv_splits=8)
    impls["jattn_mosaic_gpu[no_tail]"] = mosaic_with(tail_kv_splits=0)

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


def mosaic_tile_counts(seq, head_dim, *, causal=False, window=None, docs=None, tiles=None,
                       device_kind=None):
  """(needed, all): the (query tile, kv tile) pairs of the Mosaic GPU forward's tiles in which
  some query sees some key, for one (batch row, head) of a self-attention of length ``seq``, and
  all pairs (the dense problem's).

  Tiles: a program's rows (``2 * block_q``) by ``block_k`` keys of
  ``mosaic_gpu.default_block_sizes(head_dim, mask=tuning.mask_kind(...))``, the tiles
  ``jattn.flash_attention(implementation="mosaic_gpu")`` uses. Exact, from each query's visible
  key range (contiguous for causal, windows and packed documents). The forward walks exactly
  these tiles, also with packed documents and a last q tile that is partly padding (tile id
  ranges leave the padding id 0 out; so does ``block_schedule.make_schedule``'s count).

  Args:
    seq: sequence length (queries = keys).
    head_dim: picks the default tiles.
    causal, window: the mask (window: None or (left, right), e.g. (511, 0)).
    docs: None, or that many packed causal documents of ``seq // docs`` tokens (segment ids).
    tiles: (rows, block_k) instead of the default tiles.
    device_kind: whose tuning table gives the default tiles (default: the first device's).

  Returns:
    (needed, all) ints; issue 8's tile sum is dense ms x needed / all.

  Example:
    >>> mosaic_tile_counts(1024, 128, causal=True, tiles=(128, 128))
    (36, 64)
    >>> mosaic_tile_counts(1024, 128, docs=4, tiles=(128, 64))   # 4 x (2 + 4)
    (24, 128)
  """
  from pallas_kernels.flash import mosaic_gpu as mg
  if tiles is None:
    from pallas_kernels.tuning import mask_kind
    bs = mg.default_block_sizes(head_dim, device_kind=device_kind,
                                mask=mask_kind(causal or docs is not None, window,
                                               segments=docs is not None))
    tiles = (bs.rows_per_program, bs.block_k)
  rows, bk = tiles
  lo, hi = mg._visible_ranges(seq, causal or docs is not None, window)
  if docs is not None:
    if seq % docs:
      raise ValueError(f"seq ({seq}) must be a multiple of docs ({docs})")
    start = np.arange(seq) // (seq // docs) * (seq // docs)
    lo, hi = np.maximum(lo, start), np.minimum(hi, start + seq // docs - 1)
  nq, nk = -(-seq // rows), -(-seq // bk)
  q = np.arange(seq)[hi >= lo] // rows
  edges = np.zeros((nq, nk + 1), np.int64)   # +1 / -1 at each query's first / past-last kv tile
  np.add.at(edges, (q, lo[hi >= lo] // bk), 1)
  np.add.at(edges, (q, hi[hi >= lo] // bk + 1), -1)
  return int((np.cumsum(edges, 1)[:, :nk] > 0).sum()), nq * nk


TILE_SUM_IMPLS = ("jattn_default", "jattn_mosaic_gpu", "jattn_mosaic_gpu[no_fence]")


def tile_sum_fields(impl, dense_case, ms, q, *, window=None, docs=None, segment_ids=None):
  """Issue 8's gate for a forward row of a causal window or packed documents: ``tile_sum_ms`` =
  the same implementation's dense non-causal ms in this run x needed / all tiles
  (``mosaic_tile_counts``), and ``tile_sum_ratio`` = ms / tile_sum_ms (gate: <= 1.2).

  Args:
    impl: the row's implementation name (only ``TILE_SUM_IMPLS`` get the fields; jattn_default
      only where it runs the Mosaic GPU forward).
    dense_case: the ``case`` of the dense non-causal row of the same shape.
    ms: the row's time.
    q: the row's queries [B, S, H, D] (shape, dtype and the default's plan).
    window, docs: the row's mask (a causal window, or packed causal documents).
    segment_ids: the packed rows' segment ids (for the default's plan).

  Returns:
    A dict (tiles_needed, tiles_all, tile_sum_ms, tile_sum_ratio), or {} after printing why.

  Example:
    >>> q = jnp.zeros((1, 1024, 1, 64), jnp.bfloat16)
    >>> tile_sum_fields("jax_nn_cudnn", "B1 S1K H1 D64", 1.0, q, window=(511, 0))
    {}
  """
  if impl not in TILE_SUM_IMPLS:
    return {}
  if impl == "jattn_default":
    plan = jattn.flash_attention_plan(q, q, q, local_window_size=window, segment_ids=segment_ids)
    if plan.implementation != "mosaic_gpu":
      print(f"  {impl}: no tile_sum_ms: it runs {plan.implementation}, not the Mosaic forward")
      return {}
  dense = [r["ms"] for r in ROWS if (r["op"], r["case"], r["impl"]) == ("flash_fwd", dense_case,
                                                                      impl) and r.get("ms")]
  if not dense:
    print(f"  {impl}: no tile_sum_ms: no dense row '{dense_case}' of it in this run "
          f"(add 'dense' to --masks)")
    return {}
  needed, total = mosaic_tile_counts(q.shape[1], q.shape[-1], causal=True, window=window,
                                     docs=docs)
  t = dense[-1] * needed / total
  return dict(tiles_needed=needed, tiles_all=total, tile_sum_ms=t, tile_sum_ratio=ms / t)


def _timed_row(name, case, fn, sets, check, flops, more=None):
  """Time the forward ``fn`` (jitted here) on ``sets``, check it (``check(out) -> rel_err``),
  record its row (with ``more(ms)``: a dict of more fields) and return the jitted fn; None (and
  a printed reason, or a failed row) when it raises."""
  try:
    fwd = jax.jit(fn)
    err = check(fwd(*sets[0]))
    ms, spread = time_fn(fwd, sets)
  except NotImplementedError as e:  # e.g. a mask the implementation lacks: no row, a reason
    print(f"  {name}: skipped, not supported: {str(e)[:200]}")
    return None
  except Exception as e:  # record failures instead of hiding them
    _failed("flash_fwd", name, case, e)
    return None
  try:    # a timed row is recorded even if its extra fields fail
    extra = more(ms) if more else {}
  except Exception as e:
    extra = dict(extra_error=f"{type(e).__name__}: {str(e)[:200]}")
    print(f"  {name}: extra fields failed: {extra['extra_error']}")
  record(op="flash_fwd", case=case, impl=name, ms=ms, spread_ms=spread,
         tflops=flops / ms / 1e9, rel_err=err, ok=bool(err < 2e-2), **extra)
  return fwd


def _failed(op, name, case, e):
  msg = f"{type(e).__name__}: {str(e)[:300]}"
  print(f"  {name}: FAILED {msg}")
  record(op=op, case=case, impl=name, ms=None, error=msg, ok=False)


def _case(b, s, h, d):
  return f"B{b} S{s // 1024}K H{h} D{d}"


def bench_flash(cases, *, with_bwd=True, check_heads=2, impls=None, bwd_only=False):
  for (b, s, h, d, causal, window) in cases:
    case = _case(b, s, h, d) + (" causal" if causal else "") + (
        f" window{window[0] + 1}" if window else "")
    print(f"[flash] {case}", flush=True)
    sets = random_sets([(b, s, h, d)] * 3, jnp.bfloat16, seed=s + d + causal)
    flops = 4.0 * b * h * s * s * d
    if window is not None:
      # Exact visible pairs of a causal window (left, 0): each query sees min(i+1, left+1) keys.
      i = np.arange(s)
      flops = 4.0 * b * h * d * float(np.minimum(i + 1, window[0] + 1).sum())
    elif causal:
      flops /= 2
    q, k, v = sets[0]
    # Reference on a slice (the last batch row, first heads) in fp32.
    sl = lambda x: x[-1:, :, :check_heads]   # the last batch row: where tail_kv_splits writes
    ref_out, _ = attention_reference(sl(q), sl(k), sl(v), causal=causal, local_window_size=window)
    ct = jax.random.normal(jax.random.key(s + d + causal + 1), (b, s, h, d), jnp.bfloat16)
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
      more = None if window is None else (lambda ms, name=name: tile_sum_fields(
          name, _case(b, s, h, d), ms, q, window=window))
      if _timed_row(name, case, f, sets, lambda out: rel_err(sl(out), ref_out), flops,
                    more) is None or not with_bwd:
        continue
      try:
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
      except NotImplementedError as e:  # e.g. a backward the implementation lacks
        print(f"  {name}: backward skipped, not supported: {str(e)[:200]}")
      except Exception as e:  # record failures instead of hiding them
        _failed("flash_fwd_bwd", name, case, e)


PACKED_IMPLS = ("jattn_default", "jattn_triton", "jattn_mosaic_gpu", "jax_nn_cudnn")


def bench_flash_packed(s=16384, docs=4, h=16, d=128, b=2, impls=None, check_heads=2):
  """Packed documents: ``docs`` causal documents of ``s // docs`` tokens per row of ``s``
  (segment ids), forward only, for ``PACKED_IMPLS`` (or those of ``impls``) in one process:
  jattn_default, jattn_triton, jattn_mosaic_gpu, and jax_nn_cudnn on the equivalent
  ``b * docs`` separate causal rows of ``s // docs`` (the anchor: the work the packed kernels
  should match). Each is checked against the fp32 reference on the first document of batch 0,
  first heads; the Mosaic rows get issue 8's tile sum (``tile_sum_fields``) when the dense
  row of the same shape ran first."""
  n = s // docs
  case = _case(b, s, h, d) + f" causal docs{docs}x{n // 1024}K"
  print(f"[flash] {case}", flush=True)
  sets = random_sets([(b, s, h, d)] * 3, jnp.bfloat16, seed=7)
  seg = jnp.broadcast_to(jnp.repeat(jnp.arange(1, docs + 1, dtype=jnp.int32), n), (b, s))
  q, k, v = sets[0]
  sl = lambda x: x[:1, :n, :check_heads]
  ref, _ = attention_reference(sl(q), sl(k), sl(v), causal=True)
  split = lambda x: x.reshape(b * docs, n, *x.shape[2:])
  fns = {name: functools.partial(jattn.flash_attention, causal=True, segment_ids=seg,
                                 implementation=impl)
         for name, impl in (("jattn_default", None), ("jattn_triton", "triton"),
                            ("jattn_mosaic_gpu", "mosaic_gpu"))}
  fns["jax_nn_cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
      split(q), split(k), split(v), is_causal=True, implementation="cudnn").reshape(q.shape)
  flops = 4.0 * b * h * n * n * d / 2 * docs
  for name, f in fns.items():
    if impls is None or name in impls:
      _timed_row(name, case, f, sets, lambda out: rel_err(sl(out), ref), flops,
                 more=lambda ms, name=name: tile_sum_fields(name, _case(b, s, h, d), ms, q,
                                                            docs=docs, segment_ids=seg))


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
  p.add_argument("--masks", default="dense,causal,window,packed",
                 help="flash: comma list of mask kinds among dense, causal, window, packed (4 "
                      "causal 4K documents per 16K row; not with --quick); the window and packed "
                      "rows' tile sums need dense")
  p.add_argument("--fwd-only", action="store_true", help="flash: forward rows only")
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
    impls = None if args.impls is None else set(args.impls.split(","))
    bench_flash(cases, impls=impls, bwd_only=args.bwd_only, with_bwd=not args.fwd_only)
    if "packed" in masks and not args.quick:
      for d in (int(x) for x in args.head_dims.split(",")):
        bench_flash_packed(d=d, impls=impls)
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
