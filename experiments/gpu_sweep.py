"""Block-size sweep and A/B cases of the Triton flash kernels on the GPU (JSON rows to OUT).

    python -m experiments.gpu_sweep OUT.json [--cases causal_bwd,...] [--seqs 4096,16384]
    python -m experiments.gpu_sweep OUT.json --dry-run   # CPU: tiny sizes, Pallas interpreter
    python -m experiments.gpu_sweep OUT.json --cases tiles,causal_bwd,causal_bwd_dense \
        --write-tuning CANDIDATE.json --run "run 23"     # also a candidate tuning table
    python -m experiments.gpu_sweep OUT.json --cases bwd_d256 --head-dim 256 --seqs 16384 \
        --iters 5 --budget-s 200 --write-tuning CANDIDATE.json   # D256 backward alone

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
  * ``bwd_d256``: the head-dim-256 backward alone (``--head-dim 256``; ``bwd_d256_configs``),
    non-causal and causal: ``triton.flash_attention_bwd`` (the backward behind the Mosaic GPU
    forward, which is what every D256 call on Hopper runs) on the residuals of one Triton
    forward per mask, timed as bwd_ms (both kernels + the row terms), dkv_ms / dq_ms (one
    kernel + row terms) and prep_ms (row terms alone, once per mask); fwd_ms is that shared
    forward's time and fwd_bwd_ms = fwd_ms + bwd_ms (``fwd_bwd_from``). Every program is
    compiled up front on a thread pool (``--compile-workers``), so the ~2-3 s Triton compile
    of each kernel overlaps; ``--budget-s`` skips the timings left once it has passed. With
    ``--write-tuning`` each config's gradients of the timed call itself are checked against
    the fp32 reference VJP on ``CHECK_HEADS`` (batch, head) pairs at the full length; the
    candidate table then has "triton_bwd" entries only (the forward was not swept).

With ``--write-tuning PATH`` every config is also checked against the fp32 reference (outputs
and gradients at B1 H2, ``min(seq, CHECK_SEQ)`` keys, same mask, head dim and dtype; each row
gets ``check``), and PATH receives a candidate table in the format of ``pallas_kernels/tuning``
(see ``tuning_table``): per mask kind the checked config with the lowest median forward time
(entry "triton_fwd") and backward time (entry "triton_bwd") at the longest sequence measured
for that mask kind (``--from-rows`` merges the rows of several calls), one "all" entry per pass
when every measured mask kind picks the same. Review it, then merge its entries into the device's
table (``pallas_kernels/tuning/nvidia_h200.json``; docs/kernels.md, "Tuning data").
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

from pallas_kernels.flash import triton as ft
from pallas_kernels.tuning import mask_kind  # the tables' mask key of a case (also used below)


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


def bwd_d256_configs(dtype=jnp.bfloat16) -> dict:
  """name -> BlockSizes: head-dim-256 backward candidates (the first is the current default).

  Names: q<bwd_block_q>_w<bwd warps>s<bwd stages>_c<dkv_q_chunk>d<dq_k_chunk>[_fused]; each
  keeps the default's forward fields and a 64-row kv tile (``BWD_D256_CANDIDATES`` says why).
  """
  d = ft.default_block_sizes(256, dtype)

  def cfg(bq, w, s, cq, ck, fused):
    return dataclasses.replace(d, bwd_block_q=bq, bwd_block_k=64, bwd_num_warps=w,
                               bwd_num_stages=s, dkv_q_chunk=cq, dq_k_chunk=ck,
                               dkv_block_q=None, fused_bwd=fused)

  return {"default": d,
          **{f"q{bq}_w{w}s{s}_c{cq}d{ck}" + ("_fused" if f else ""): cfg(bq, w, s, cq, ck, f)
             for bq, w, s, cq, ck, f in BWD_D256_CANDIDATES}}


# D256 backward candidates: (bwd_block_q, bwd_num_warps, bwd_num_stages, dkv_q_chunk,
# dq_k_chunk, fused_bwd). Constraints:
#  * bwd_block_k = 64: the dK/dV kernel keeps two fp32 [block_k, 256] accumulators, 128
#    registers a thread at 8 warps for 64 rows (256 at 128 rows).
#  * 8 warps: at 4 every dK/dV kernel spills 3-5 KB, at 16 (128-register cap) 0.4-2 KB.
#  * dkv_q_chunk <= 32: 64-row chunks spill ~270 B (255 registers) at every stage count.
#  * shared memory (227 KiB): dK/dV = K + V tile (64 KiB) + stages x (Q + dO chunk, cq KiB);
#    dQ = Q + dO of the q tile (bq KiB) + stages x (K + V chunk, ck KiB).
#  * Triton's wgmma layout for a 64-row dot at 8 warps is warpsPerCTA [8, 1]: both
#    warpgroups compute the same [64, chunk] logits and dP (the two [64 x 256] accumulating
#    dots are split [4, 2]). A 128-row dQ tile gives each warpgroup its own 64 rows.
# Upstream Triton 3.9 + ptxas for sm_90a (experiments/triton_resources.py dump-flash /
# compile, TTIR passes run first; experiments/results/triton_resources_flash_bwd_d256_cpu_
# 20261130.json), registers / spill bytes / shared KiB of dK/dV; dQ:
#   default  q64 s2 c16 d32: 235/0/96;   184/0/128 (+ 64-row logits computed twice)
#   q64 s2 c32 d32:          255/0/128;  184/0/128
#   q128 s2 c16 d32:         235/0/96;   207/0/192
#   q128 s2 c32 d32:         255/0/128;  207/0/192
#   q128 s2 c32 d16:         255/0/128;  180/0/160
#   q128 s3 c16 d16:         243/0/112;  181/0/176
#   q64 s3 c32 d32:          255/0/161;  184/0/160
#   q128 s2 c16 d32 fused:   one kernel 255/0/192 (c32: 116 B of spills)
BWD_D256_CANDIDATES = (
    (64, 8, 2, 32, 32, False),    # only the dK/dV step doubled (half the steps, K=32 wgmmas)
    (128, 8, 2, 16, 32, False),   # only the dQ tile doubled (no duplicated logits in dQ)
    (128, 8, 2, 32, 32, False),   # both
    (128, 8, 2, 32, 16, False),   # both, smaller dQ steps (less dQ shared memory / registers)
    (128, 8, 3, 16, 16, False),   # 3 stages (both kernels) at 16-row steps
    (64, 8, 3, 32, 32, False),    # 3 stages with 32-row dK/dV steps
    (128, 8, 2, 16, 32, True),    # one fused kernel (causal: the same work in every program)
)

CHECK_HEADS = ((0, 0), (1, 15))  # (batch, head) pairs whose gradients bwd_d256 checks


def _median_ms(fn, *args, iters):
  """Median wall milliseconds of ``fn(*args)`` (synchronised) over ``iters`` calls after one
  warm-up call.

  Args:
    fn: a callable returning jax arrays.
    *args: its arguments.
    iters: timed calls.

  Returns:
    The median in milliseconds.

  Example:
    >>> _median_ms(jax.jit(lambda x: x + 1), jnp.ones(4), iters=2) > 0
    True
  """
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts) * 1e3


def _bwd_programs(cfg, *, causal, scale, interpret, split):
  """[(key, fn)] of the backward-alone programs of one config (fn(q, k, v, out, lse, do))."""
  parts = ["all"] + (["dkv", "dq"] if split and not cfg.fused_bwd else [])
  return [(f"{p}_ms" if p != "all" else "bwd_ms",
           lambda q, k, v, o, l, do, p=p: ft.flash_attention_bwd(
               q, k, v, o, l, do, jnp.zeros_like(l), causal=causal, scale=scale,
               block_sizes=cfg, interpret=interpret, _bwd_parts=p))
          for p in parts]


def bwd_rows(cfgs, *, seq, causal, head_dim, batch=2, heads=16, dtype=jnp.bfloat16, iters=10,
             interpret=False, check=False, split=True, workers=None, deadline=None,
             on_row=None):
  """The ``bwd_d256`` case: every config's backward alone on one forward's residuals.

  Args:
    cfgs: name -> ``BlockSizes`` (backward fields used; the forward is ``cfgs``' first).
    seq, causal, head_dim, batch, heads, dtype: the problem (self-attention, MHA).
    iters: timed calls per program (median, after one warm-up call).
    interpret: Pallas interpreter (CPU dry run).
    check: compare each config's dq / dk / dv (of the timed "all" program) on ``CHECK_HEADS``
      with the fp32 reference VJP (row ``check``: relative L2 errors, ok).
    split: also time each kernel alone (dkv_ms, dq_ms; not for fused configs).
    workers: compile threads (default: the CPU count, at most the number of programs).
    deadline: ``time.monotonic()`` after which no further program is timed (row ``skipped``).
    on_row: called with each row as it is finished.

  Returns:
    A list of dicts (``main``'s row format): config (``BlockSizes``), fwd_ms, bwd_ms,
    fwd_bwd_ms, bwd_tflops, dkv_ms / dq_ms, prep_ms, error or check, bwd_only.
  """
  import concurrent.futures
  import os

  import numpy as np

  from pallas_kernels.block_schedule import make_schedule
  from pallas_kernels.flash.reference import attention_reference

  names = list(cfgs)
  fwd_cfg = cfgs[names[0]]
  scale = head_dim ** -0.5
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(kk, (batch, seq, heads, head_dim), dtype) for kk in keys)
  sched = make_schedule(seq, seq, fwd_cfg.block_q, fwd_cfg.block_k, causal=causal)
  fwd = jax.jit(lambda q, k, v: ft.flash_attention(
      q, k, v, None, None, sched, causal=causal, local_window_size=None, scale=scale,
      logits_soft_cap=None, block_sizes=fwd_cfg, interpret=interpret))

  timeit = functools.partial(_median_ms, iters=iters)

  fwd_ms = timeit(fwd, q, k, v)
  out, lse = fwd(q, k, v)
  args = (q, k, v, out, lse, do)
  prep = jax.jit(lambda q, k, v, o, l, do: ft.flash_attention_bwd(
      q, k, v, o, l, do, jnp.zeros_like(l), causal=causal, scale=scale, block_sizes=fwd_cfg,
      interpret=interpret, _bwd_parts="none"))
  prep_ms = timeit(prep, *args)
  pairs = ft._visible_pairs(seq, seq, causal, None)
  fwd_flops = 4.0 * batch * heads * head_dim * pairs

  # Lower here (tracing is cheap), compile on threads (XLA releases the GIL): "all" first.
  jobs = []
  for name in names:
    for key, fn in _bwd_programs(cfgs[name], causal=causal, scale=scale, interpret=interpret,
                                 split=split):
      try:
        jobs.append((name, key, jax.jit(fn).lower(*args), None))
      except Exception as e:  # noqa: BLE001 - a config that does not lower is reported
        jobs.append((name, key, None, e))
  jobs.sort(key=lambda j: j[1] != "bwd_ms")
  workers = workers or max(1, min(len(jobs), os.cpu_count() or 1))
  t0 = time.monotonic()
  pool = concurrent.futures.ThreadPoolExecutor(workers)
  futs = {(n, key): pool.submit(low.compile) if low is not None else err
          for n, key, low, err in jobs}

  refs = {}
  if check:  # fp32 reference VJP of one (batch, head) at a time, full length
    ref = jax.jit(lambda q, k, v, do: jax.vjp(
        lambda q, k, v: attention_reference(q, k, v, causal=causal, scale=scale)[0],
        q, k, v)[1](do))
    for b, h in CHECK_HEADS:
      if b < batch and h < heads:
        sl = [x[b:b + 1, :, h:h + 1].astype(jnp.float32) for x in (q, k, v, do)]
        refs[(b, h)] = [np.asarray(g, np.float64) for g in ref(*sl)]

  rows = []
  for name in names:
    cfg = cfgs[name]
    row = dict(config=cfg, fwd_ms=fwd_ms, prep_ms=prep_ms, bwd_only=True,
               fwd_bwd_from="fwd_ms + bwd_ms")
    for key, _ in _bwd_programs(cfg, causal=causal, scale=scale, interpret=interpret,
                                split=split):
      fut = futs[(name, key)]
      if deadline is not None and time.monotonic() > deadline:
        row.setdefault("skipped", []).append(key)
        continue
      try:
        if isinstance(fut, Exception):
          raise fut
        compiled = fut.result()
        row[key] = timeit(compiled, *args)
        if key == "bwd_ms" and check:
          got = compiled(*args)
          res = dict(seq=seq, heads=[list(bh) for bh in refs], ok=True)
          for (b, h), want in refs.items():
            for gname, g, w in zip(("dq", "dk", "dv"), got, want):
              a = np.asarray(g[b:b + 1, :, h:h + 1].astype(jnp.float32), np.float64)
              err = float(np.linalg.norm(a - w) / max(np.linalg.norm(w), 1e-30))
              res[gname] = max(res.get(gname, 0.0), err)
              res["ok"] = (res["ok"] and bool(np.isfinite(a).all())
                           and err < CHECK_TOL[jnp.dtype(dtype).itemsize])
          row["check"] = res
      except Exception as e:  # noqa: BLE001 - e.g. out of shared memory at compile time
        msg = f"{key}: {type(e).__name__}: {str(e)[:200]}"
        if key == "bwd_ms":
          row["error"] = msg
          break
        row["split_error"] = msg  # a kernel alone failed: not the config's error
    if "bwd_ms" in row:
      row["fwd_bwd_ms"] = fwd_ms + row["bwd_ms"]
      row["bwd_tflops"] = 2.5 * fwd_flops / row["bwd_ms"] * 1e-9
    elif "error" not in row:
      row["error"] = "skipped: --budget-s passed"
    row["compile_wall_s"] = round(time.monotonic() - t0, 1)
    print({k: v for k, v in row.items() if k != "config"} | dict(name=name), flush=True)
    rows.append(row)
    if on_row is not None:
      on_row(name, row)
  pool.shutdown(wait=False, cancel_futures=True)
  return rows


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

  timeit = functools.partial(_median_ms, iters=iters)

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


def plan(case_sets, seqs, head_dim=128):
  """[(seq, causal, window, {name: BlockSizes}, time_bwd, with_tokamax)] for the case sets."""
  out = []
  ab = causal_bwd_configs(head_dim)
  for cs in case_sets:
    if cs == "causal_bwd":
      out += [(s, True, None, ab, True, True) for s in seqs]
    elif cs == "causal_bwd_dense":
      out += [(s, False, None, ab, True, True) for s in seqs]
    elif cs == "launch":
      d = ft.default_block_sizes(head_dim, jnp.bfloat16)
      cfgs = {"default": d, "head_group1": dataclasses.replace(d, head_group=1)}
      out += [(s, True, None, cfgs, False, False) for s in seqs]
    elif cs == "bwd_d256":
      if head_dim != 256:
        raise ValueError(f"case set bwd_d256 needs --head-dim 256, got {head_dim}")
      cfgs = bwd_d256_configs()
      out += [(s, causal, None, cfgs, "bwd_only", False) for s in seqs
              for causal in (False, True)]
    elif cs == "tiles":
      allc = ft._bench_configs(head_dim)
      # D128: 0: the default (per-pass tiles), 3: the previous single-tile default, then other
      # tilings. Other head dims: the default and every candidate of ft._SWEEP_CANDIDATES.
      idx = (0, 3, 6, 7, 9, 11) if head_dim == 128 else range(len(allc))
      cfgs = {f"bench{i}": allc[i] for i in idx if i < len(allc)}
      out += [(16384, causal, window, cfgs, False, False) for causal, window in
              ((False, None), (True, None), (True, (511, 0)))]
    else:
      raise ValueError(f"unknown case set {cs!r}")
  return out


CHECK_SEQ = 1024
CHECK_TOL = {2: 2e-2, 4: 2e-3}  # relative L2 error of out / dq / dk / dv, by input itemsize
_FWD_FIELDS, _BWD_FIELDS = ft._FWD_FIELDS, ft._BWD_FIELDS


def check_config(cfg, *, seq, causal, window, head_dim, dtype, interpret=False, heads=2):
  """The Triton kernels with ``cfg`` against the fp32 reference (outputs and gradients).

  Args:
    cfg: a Triton ``BlockSizes``.
    seq, causal, window, head_dim, dtype: the case (checked at ``min(seq, CHECK_SEQ)`` keys).
    interpret: run the kernels in the Pallas interpreter.
    heads: query and kv heads (batch 1).

  Returns:
    A dict: seq, out/dq/dk/dv (relative L2 errors), ok (all finite and below ``CHECK_TOL``),
    or error and ok False.
  """
  import numpy as np

  import jattn
  from pallas_kernels.flash.reference import attention_reference

  n = min(seq, CHECK_SEQ)
  keys = jax.random.split(jax.random.key(1), 4)
  q, k, v, do = (jax.random.normal(kk, (1, n, heads, head_dim), dtype) for kk in keys)
  mask = dict(causal=causal, local_window_size=None if window is None else tuple(window))

  def vjp(f, *args):
    out, fn = jax.vjp(f, *args)
    return (out, *fn(do.astype(out.dtype)))

  res = dict(seq=n)
  try:
    got = jax.jit(lambda q, k, v: vjp(lambda q, k, v: jattn.flash_attention(
        q, k, v, implementation="triton", interpret=interpret, block_sizes=cfg, **mask),
        q, k, v))(q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = jax.jit(lambda q, k, v: vjp(lambda q, k, v: attention_reference(
        q, k, v, **mask)[0], q, k, v))(*f32)
    ok = True
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
      a = np.asarray(a.astype(jnp.float32), np.float64)
      b = np.asarray(b, np.float64)
      err = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
      res[name] = err
      ok = ok and bool(np.isfinite(a).all()) and err < CHECK_TOL[jnp.dtype(dtype).itemsize]
    res["ok"] = ok
  except Exception as e:  # a config that does not compile fails its check
    res.update(error=f"{type(e).__name__}: {str(e)[:200]}", ok=False)
  return res




def _git_commit():
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
  except Exception:
    return "unknown"


def tuning_table(rows, *, head_dim, dtype, device_kind, provenance,
                 kernels=("triton_fwd", "triton_bwd")):
  """A candidate tuning table (format of ``pallas_kernels/tuning``) from checked sweep rows.

  Per mask kind (``mask_kind``), among the configs timed at the longest sequence measured for
  that kind whose every row of that kind has no error and ``check["ok"]`` (configs compared by
  value, not name; tokamax rows ignored): the lowest median forward time at that length gives
  the "triton_fwd" entry (the forward's fields), the lowest backward time (``bwd_ms`` when every
  such row has it, else fwd_bwd_ms - fwd_ms) the "triton_bwd" entry (the backward's fields; its
  tiles written out when the forward winner has other tiles). A pass whose winner is the same
  for every measured mask kind (two or more) gets one entry with mask "all".

  Args:
    rows: the sweep's rows (``main``'s output: config as a dict, name, seq, causal, window,
      fwd_ms, fwd_bwd_ms, optional bwd_ms, error, check).
    head_dim, dtype: the sweep's head dim and input dtype (the table's keys).
    device_kind: jax ``device_kind`` of the machine that ran the sweep.
    provenance: fields for every entry's provenance (status, run, date, commit, command,
      results, device).
    kernels: the passes to write entries for (``bwd_d256`` rows: "triton_bwd" only).

  Returns:
    A dict: format, device_kinds, description, entries (possibly empty).
  """
  d_key = max(32, ft._pow2(head_dim))
  dcls = "32bit" if jnp.dtype(dtype).itemsize >= 4 else "16bit"
  default = json.dumps(dataclasses.asdict(ft.default_block_sizes(head_dim, dtype)),
                       sort_keys=True)
  groups, seqs = {}, {}
  for r in rows:
    if not isinstance(r.get("config"), dict):
      continue  # tokamax rows
    m = mask_kind(r["causal"], r.get("window"))
    seqs.setdefault(m, set()).add(r["seq"])
    key = json.dumps(r["config"], sort_keys=True)
    g = groups.setdefault(m, {}).setdefault(
        key, dict(config=r["config"], names=set(), fwd={}, bwd={}, fwd_bwd={}, ok=True))
    g["names"].add(r["name"])
    if "error" in r or not (r.get("check") or {}).get("ok") or "fwd_ms" not in r:
      g["ok"] = False
      continue
    s = r["seq"]
    g["fwd"][s] = min(g["fwd"].get(s, math.inf), r["fwd_ms"])
    g["fwd_bwd"][s] = min(g["fwd_bwd"].get(s, math.inf), r["fwd_bwd_ms"] - r["fwd_ms"])
    if "bwd_ms" in r:
      g["bwd"][s] = min(g["bwd"].get(s, math.inf), r["bwd_ms"])
  winners = {}  # mask -> (fwd params, bwd params, provenance extras)
  for m, cands in sorted(groups.items()):
    top = max(seqs[m])
    ok = [g for g in cands.values() if g["ok"] and top in g["fwd"]]
    if not ok:
      continue
    bwd_key = "bwd" if all(top in g["bwd"] for g in ok) else "fwd_bwd"
    best_f = min(ok, key=lambda g: g["fwd"][top])
    best_b = min(ok, key=lambda g: g[bwd_key][top])
    dflt = cands.get(default)
    fwd = {k: best_f["config"][k] for k in _FWD_FIELDS}
    bwd = {k: best_b["config"][k] for k in _BWD_FIELDS}
    cb = best_b["config"]
    if (cb["block_q"], cb["block_k"]) != (fwd["block_q"], fwd["block_k"]):
      bwd["bwd_block_q"] = cb["bwd_block_q"] or cb["block_q"]
      bwd["bwd_block_k"] = cb["bwd_block_k"] or cb["block_k"]

    def measured(best, k, metric):
      out = dict(metric=metric, selected_at_seq=top, configs=sorted(best["names"]),
                 ms={str(s): round(t, 4) for s, t in sorted(best[k].items())},
                 candidates=len(ok), of=len(cands))
      if dflt is not None and dflt["ok"]:
        out["current_default_ms"] = {str(s): round(t, 4) for s, t in sorted(dflt[k].items())}
      return out

    winners[m] = (fwd, bwd, measured(best_f, "fwd", "fwd_ms"),
                  measured(best_b, bwd_key, "bwd_ms" if bwd_key == "bwd"
                           else "fwd_bwd_ms - fwd_ms"))
  entries = []
  for kernel, i in (("triton_fwd", 0), ("triton_bwd", 1)):
    if kernel not in kernels:
      continue
    same = len(winners) >= 2 and all(w[i] == next(iter(winners.values()))[i]
                                     for w in winners.values())
    for m, w in winners.items():
      mask = "all" if same else m
      prov = dict(provenance, selection="lowest median time at the longest measured seq "
                  "among configs whose outputs and gradients matched the fp32 reference",
                  measured={mm: ww[2 + i] for mm, ww in winners.items()} if same
                  else {m: w[2 + i]})
      entries.append(dict(kernel=kernel, head_dim=d_key, dtype=dcls, mask=mask,
                          params=dict(w[i]), provenance=prov))
      if same:
        break
  return {"format": 1, "device_kinds": [device_kind],
          "description": "Candidate written by experiments/gpu_sweep.py --write-tuning: review, "
                         "then merge its entries into the device's table in "
                         "pallas_kernels/tuning (docs/kernels.md, 'Tuning data').",
          "entries": entries}


def _dry_config(cfg):
  """``cfg`` at the dry run's tiny sizes (16-row tiles and chunks; a q tile over 64 rows: 32)."""
  return dataclasses.replace(cfg, block_q=16, block_k=16,
                             bwd_block_q=32 if cfg.bwd_tiles[0] > 64 else 16,
                             bwd_block_k=16, dkv_q_chunk=16, dq_k_chunk=16,
                             dkv_block_q=16 if cfg.dkv_block_q else None)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("out", help="JSON file (rewritten after every row)")
  p.add_argument("--cases", default="causal_bwd",
                 help="comma list of: causal_bwd, causal_bwd_dense, launch, tiles, bwd_d256")
  p.add_argument("--seqs", default="4096,16384")
  p.add_argument("--head-dim", type=int, default=128,
                 help="head dim of every case (bf16, B2 H16); 64 and 256 have untimed defaults")
  p.add_argument("--iters", type=int, default=10, help="timed calls per row (median)")
  p.add_argument("--configs", default=None,
                 help="causal_bwd*: comma list of config names to keep (default: all)")
  p.add_argument("--no-tokamax", action="store_true")
  p.add_argument("--budget-s", type=float, default=None,
                 help="bwd_d256: time no further program once this many seconds have passed "
                      "since the start (rows so far are kept; skipped ones say so)")
  p.add_argument("--compile-workers", type=int, default=None,
                 help="bwd_d256: compile threads (default: the CPU count)")
  p.add_argument("--no-split", action="store_true",
                 help="bwd_d256: time the backward only as a whole (no dkv_ms / dq_ms)")
  p.add_argument("--dry-run", action="store_true",
                 help="CPU smoke test: seq 128, B1 H2 D32 fp32 configs, Pallas interpreter")
  p.add_argument("--write-tuning", metavar="PATH", default=None,
                 help="check every config against the reference and write a candidate tuning "
                      "table (format of pallas_kernels/tuning) to PATH")
  p.add_argument("--run", default=None,
                 help="run label for the candidate table's provenance (e.g. 'run 23')")
  p.add_argument("--from-rows", default=None, metavar="A.json[,B.json]",
                 help="with --write-tuning: no sweep, the candidate from these rows files of "
                      "earlier --write-tuning calls (e.g. case sets split over calls); OUT unused")
  args = p.parse_args(argv)
  if args.from_rows:
    if not args.write_tuning:
      p.error("--from-rows needs --write-tuning")
    rows = []
    for path in args.from_rows.split(","):
      with open(path) as fh:
        rows += json.load(fh)
    _write_tuning(args, argv, rows, args.from_rows.replace(",", "; "))
    return rows
  seqs = [int(s) for s in args.seqs.split(",")]
  cases = plan(args.cases.split(","), seqs, args.head_dim)
  keep = None if args.configs is None else set(args.configs.split(","))
  rows = []
  device, commit = jax.devices()[0].device_kind, _git_commit()
  t_start = time.monotonic()
  deadline = None if args.budget_s is None else t_start + args.budget_s

  def record(name, r, seq):
    r = dict(r)
    r["config"] = dataclasses.asdict(r["config"])
    r.update(name=name, seq=seq, causal=causal, window=window, device=device, commit=commit)
    rows.append(r)
    with open(args.out, "w") as fh:
      json.dump(rows, fh, indent=1)

  for seq, causal, window, cfgs, time_bwd, with_tk in cases:
    names = [n for n in cfgs if keep is None or n in keep or not time_bwd]
    if time_bwd == "bwd_only":
      sel = {n: cfgs[n] for n in names}
      kw = dict(seq=seq, causal=causal, head_dim=args.head_dim, iters=args.iters,
                check=bool(args.write_tuning), split=not args.no_split,
                workers=args.compile_workers, deadline=deadline)
      if args.dry_run:
        sel = {n: _dry_config(c) for n, c in sel.items()}
        kw.update(seq=128, batch=1, heads=2, head_dim=32, dtype=jnp.float32, interpret=True,
                  iters=1)
      bwd_rows(sel, on_row=lambda n, r, s=kw["seq"]: record(n, r, s), **kw)
      continue
    kw = dict(seq=seq, causal=causal, local_window_size=window, iters=args.iters,
              time_bwd=time_bwd, head_dim=args.head_dim)
    if args.dry_run:
      # Tiny problem in the interpreter: only checks that every config builds and runs.
      small = {n: _dry_config(cfgs[n]) for n in names}
      kw.update(seq=128, batch=1, q_heads=2, kv_heads=2, head_dim=32, dtype=jnp.float32,
                interpret=True, iters=1)
      cfg_list = [small[n] for n in names]
    else:
      cfg_list = [cfgs[n] for n in names]
    for name, r in zip(names, ft._sweep(configs=cfg_list, **kw)):
      r = dict(r)
      if args.write_tuning and "error" not in r:
        r["check"] = check_config(r["config"], seq=kw["seq"], causal=causal, window=window,
                                  head_dim=kw["head_dim"], dtype=kw.get("dtype", jnp.bfloat16),
                                  interpret=kw.get("interpret", False))
        print(name, r["check"], flush=True)
      r["config"] = dataclasses.asdict(r["config"])
      r.update(name=name, seq=kw["seq"], causal=causal, window=window, device=device,
               commit=commit)
      rows.append(r)
      with open(args.out, "w") as fh:
        json.dump(rows, fh, indent=1)
    if with_tk and not args.no_tokamax and not args.dry_run:
      for r in _tokamax_rows(2, seq, 16, args.head_dim, causal, jnp.bfloat16, args.iters):
        r.update(name="tokamax_triton", seq=seq, causal=causal, window=window)
        rows.append(r)
        with open(args.out, "w") as fh:
          json.dump(rows, fh, indent=1)
  if args.write_tuning:
    _write_tuning(args, argv, rows, args.out)
  return rows


def _write_tuning(args, argv, rows, results):
  """Write ``tuning_table`` of ``rows`` to ``args.write_tuning`` (device and commit: the rows')."""
  head_dim, dtype = (32, jnp.float32) if args.dry_run else (args.head_dim, jnp.bfloat16)
  kinds = {r["device"] for r in rows if "device" in r}
  commits = sorted({r["commit"] for r in rows if "commit" in r})
  if len(kinds) > 1:
    raise ValueError(f"rows from several devices: {sorted(kinds)}")
  kind = kinds.pop() if kinds else jax.devices()[0].device_kind
  now = datetime.datetime.now(datetime.timezone.utc)
  prov = dict(status="dry-run" if args.dry_run else "tuned",
              run=args.run or f"gpu_sweep {now:%Y-%m-%dT%H:%M}Z", date=f"{now:%Y-%m-%d}",
              device=kind, commit=", ".join(commits) or _git_commit(),
              command="python -m experiments.gpu_sweep " + " ".join(
                  sys.argv[1:] if argv is None else argv),
              results=results)
  cfg_rows = [r for r in rows if isinstance(r.get("config"), dict)]
  bwd_only = bool(cfg_rows) and all(r.get("bwd_only") for r in cfg_rows)
  table = tuning_table(rows, head_dim=head_dim, dtype=dtype, device_kind=kind, provenance=prov,
                       kernels=("triton_bwd",) if bwd_only else ("triton_fwd", "triton_bwd"))
  with open(args.write_tuning, "w") as fh:
    json.dump(table, fh, indent=1)
  print(f"candidate tuning table ({len(table['entries'])} entries): {args.write_tuning}")


if __name__ == "__main__":
  main()
