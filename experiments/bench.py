"""Kernel benchmark: jattn and the anchors on named cases, every timed output checked in the run.

  python -m experiments.bench --list                      # the cases and groups
  python -m experiments.bench --all                       # every case -> experiments/results/<device>.json
  python -m experiments.bench --all --resume              # go on where a time limit stopped it
  python -m experiments.bench --case anchors --case decode_b1_s128k --out /tmp/a.json   # some
  python -m experiments.bench --write-docs experiments/results/h200.json   # docs/benchmarks.md, README

Cases (``--case``, names or groups, repeatable or comma lists; unknown names exit with status 2
and the valid ones): flash attention forward and forward+backward (B2 S16K H16 bf16, dense /
causal / causal window 512 / packed documents, D64/D128/D256), flash decoding (B1 S128K and a
paged ragged B8 S32K batch, GQA 32:8 D128), block-sparse training attention at 16K and 64K (B1
H16 D128, top-K keeping ~19% of the causal blocks, selection included, forward+backward, against
jattn's own dense causal kernel) and sparse decoding (B1 S128K, 64-token blocks, ~19% kept,
against jattn's dense decode), serving decode (``serving``: mixed lengths, paged, scheduled,
unified max) and context parallelism (``cp``: the zig-zag ring's chunk-pair kernels for P = 2
and 4, B1 S64K H16 D128 causal and window 512, run one after another on one device against the
fused call; ``overhead`` = ring ms / fused ms, ``kernel_calls`` of ``pairs`` chunk pairs run).
The group ``anchors`` holds the cases compared with cuDNN and tokamax.

Implementations (``--impl``, same syntax): ``jattn`` (``implementation=None``: what a user gets),
``jattn_<name>`` (an explicit implementation), and the anchors ``jax_nn_cudnn`` / ``jax_nn_xla``
(``jax.nn.dot_product_attention``; both by default, XLA recorded as skipped above 4K tokens where
it would materialise the logits) and ``tokamax_mosaic`` / ``tokamax_cudnn``
(``tokamax.dot_product_attention``, when tokamax imports; ``tokamax_mosaic`` by default). Anchors
apply to the flash cases (and jax.nn's to decode); the sparse cases time each jattn
implementation against the same implementation's dense kernel (row ``<impl>_dense``;
``speedup`` = dense ms / sparse ms).

Checks: every timed output is compared with an fp32 reference (HIGHEST precision) computed in the
same run on one (batch row, head) slice: the forward output, and for forward+backward rows the
gradients dq, dk, dv of sum(out * ct) (``rel_err`` = ||x - ref|| / ||ref||, the largest of
them; ``ok`` = rel_err < 2e-2). The reference runs in query chunks, so 64K fits.

Timer (``pallas_kernels.tuning.timing.time_fn``): one warm-up call per input set, then 3 timed loops
of asynchronous calls (at least 5 calls and 0.1 s each) rotating over 3 random bf16 input sets;
the median loop. FLOPs: 4 * B * H * D * (visible query-key pairs), forward+backward 3.5x that;
decode bandwidth: the K and V bytes each sequence reads.

Output: ``{"meta": {...}, "rows": [{"op", "case", "shape", "impl", "ms", "tflops" | "tbps",
"speedup" (sparse rows), "rel_err", "ok", "error" | "skipped" (why no time)}, ...]}``. A run of every case writes
``experiments/results/<device>.json`` unless ``--out`` is given; a subset writes only to ``--out``.
Rows are also written to ``<out>.partial`` as they come (a run stopped early keeps them).
Compare ratios within one file only: each file is one run on one device.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.metadata
import json
import math
import os
import platform
import re
import subprocess
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np

import jattn
from pallas_kernels.tuning.timing import random_sets, sync, time_fn

JATTN_IMPLS = ("jattn", "jattn_xla", "jattn_triton", "jattn_mosaic_gpu", "jattn_mosaic_tpu")
ANCHOR_IMPLS = ("jax_nn_cudnn", "jax_nn_xla", "tokamax_mosaic", "tokamax_cudnn")
IMPLS = JATTN_IMPLS + ANCHOR_IMPLS
DEFAULT_IMPLS = ("jattn", "jax_nn_cudnn", "jax_nn_xla", "tokamax_mosaic")
TOLERANCE = 2e-2
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# ----------------------------------------------------------------------------- cases
@dataclasses.dataclass(frozen=True)
class Case:
  """One benchmark case.

  Attributes:
    name: the case's name (``--case``).
    op: "flash_fwd", "flash_fwd_bwd", "decode", "sparse_fwd_bwd" or "sparse_decode".
    batch, seq, heads, kv_heads, head_dim: the shapes (seq: query = key length; decode: the
      cache length).
    causal, window: the mask (window: (left, right) or None).
    docs: packed causal documents of seq // docs tokens per row (segment ids); 0 for none.
    mask_tiles: a boolean mask array of 128 x 128 tiles, this fraction visible (and the
      diagonal); 0 for none.
    page_size: decode: a paged cache of this page size (0: contiguous).
    lengths: decode: the cache length of each sequence (None: all seq).
    q_block, block: sparse: query / key block sizes of the selection.
    fraction: sparse: the fraction of causally visible blocks to keep.
    softmax: decode, sparse decode: jattn's ``softmax`` ("exact" or "unified_max").
    schedule: decode: jattn runs a length-balanced ``jattn.decode_schedule``, planned once
      per batch composition outside the timed call (as a serving engine plans a step once for
      all its layers).
    chunks: context parallelism ("cp_fwd"): P, the ring's devices; their chunk-pair kernels
      run one after another on one device, against the single fused call.
    layout: context parallelism: the sequence layout, "zigzag" (balances causal work) or
      "contiguous" (a sliding window alone is balanced already, with half the chunk pairs).
  """
  name: str
  op: str
  batch: int
  seq: int
  heads: int
  kv_heads: int
  head_dim: int
  causal: bool = False
  window: tuple | None = None
  docs: int = 0
  mask_tiles: float = 0.0
  page_size: int = 0
  lengths: tuple | None = None
  q_block: int = 128
  block: int = 64
  fraction: float = 0.19
  softmax: str = "exact"
  schedule: bool = False
  chunks: int = 0
  layout: str = "zigzag"

  @property
  def shape(self) -> str:
    """A human description, e.g. "B2 S16K H16 D128 causal window512"."""
    heads = (f"H{self.heads}" if self.heads == self.kv_heads
             else f"GQA{self.heads}:{self.kv_heads}")
    s = f"B{self.batch} S{_k(self.seq)} {heads} D{self.head_dim}"
    if self.causal:
      s += " causal"
    if self.window:
      s += f" window{self.window[0] + 1}"
    if self.docs:
      s += f" docs{self.docs}x{_k(self.seq // self.docs)}"
    if self.mask_tiles:
      s += f" tilemask{self.mask_tiles:.0%}"
    if self.page_size:
      s += f" paged{self.page_size}"
    if self.lengths:
      s += " ragged"
    if self.op == "sparse_fwd_bwd":
      s += f" top{self.fraction:.0%} q{self.q_block} k{self.block}"
    elif self.op == "sparse_decode":
      s += f" top{self.fraction:.0%} blk{self.block}"
    if self.schedule:
      s += " scheduled"
    if self.softmax != "exact":
      s += f" {self.softmax}"
    if self.chunks:
      s += f" ring{self.chunks} {self.layout}"
    return s

  def tiny(self) -> Case:
    """The same case at CPU-test sizes (seq / 64, heads / 8, batch <= 2), same head dim."""
    f = 64
    seq = max(self.seq // f, 512 if self.op == "sparse_fwd_bwd" else 256)   # sparse: top_k >= 1
    return dataclasses.replace(
        self, batch=min(self.batch, 2), seq=seq, heads=max(self.heads // 8, 1),
        kv_heads=max(self.kv_heads // 8, 1),
        window=None if self.window is None else (max(self.window[0] // 16, 1), self.window[1]),
        lengths=None if self.lengths is None else tuple(
            max(n // f, 1) for n in self.lengths[:min(self.batch, 2)]),
        page_size=min(self.page_size, 16))


def _k(n):
  return f"{n // 1024}K" if n % 1024 == 0 else str(n)


_D128 = dict(batch=2, seq=16384, heads=16, kv_heads=16, head_dim=128)
_DEC = dict(heads=32, kv_heads=8, head_dim=128)
_SPARSE = dict(batch=1, heads=16, kv_heads=16, head_dim=128, causal=True)
CASES = {c.name: c for c in (
    Case("flash_d128_fwd", "flash_fwd", **_D128),
    Case("flash_d128_fwdbwd", "flash_fwd_bwd", **_D128),
    Case("flash_d128_causal_fwd", "flash_fwd", causal=True, **_D128),
    Case("flash_d128_causal_fwdbwd", "flash_fwd_bwd", causal=True, **_D128),
    Case("flash_window512_fwd", "flash_fwd", causal=True, window=(511, 0), **_D128),
    Case("flash_window512_fwdbwd", "flash_fwd_bwd", causal=True, window=(511, 0), **_D128),
    Case("flash_packed_fwd", "flash_fwd", causal=True, docs=4, **_D128),
    Case("flash_tilemask10_fwd", "flash_fwd", mask_tiles=0.1, **_D128),
    Case("flash_d64_fwd", "flash_fwd", **dict(_D128, head_dim=64)),
    Case("flash_d64_causal_fwd", "flash_fwd", causal=True, **dict(_D128, head_dim=64)),
    Case("flash_d256_fwd", "flash_fwd", **dict(_D128, head_dim=256)),
    Case("flash_d256_causal_fwd", "flash_fwd", causal=True, **dict(_D128, head_dim=256)),
    Case("decode_b1_s128k", "decode", batch=1, seq=131072, **_DEC),
    Case("decode_b8_s32k_paged", "decode", batch=8, seq=32768, page_size=16,
         lengths=(32768, 1024, 8192, 300, 16384, 4096, 2000, 12000), **_DEC),
    Case("sparse_16k", "sparse_fwd_bwd", seq=16384, **_SPARSE),
    Case("sparse_64k", "sparse_fwd_bwd", seq=65536, **_SPARSE),
    Case("sparse_decode_b1_s128k", "sparse_decode", batch=1, seq=131072, block=64, **_DEC),
    *(Case(f"cp_64k_{m}_p{p}", "cp_fwd", batch=1, seq=65536, heads=16, kv_heads=16,
           head_dim=128, causal=True, window=w, chunks=p, layout=layout)
      for m, w, layout in (("causal", None, "zigzag"), ("window512", (511, 0), "contiguous"))
      for p in (2, 4)),
)}
GROUPS = {
    "anchors": ("flash_d128_fwd", "flash_d128_fwdbwd", "flash_d128_causal_fwd",
                "flash_d128_causal_fwdbwd", "flash_window512_fwd", "flash_window512_fwdbwd",
                "decode_b1_s128k", "sparse_64k"),
    "flash": tuple(n for n, c in CASES.items() if c.op.startswith("flash")),
    "decode": tuple(n for n, c in CASES.items() if c.op == "decode"),
    "sparse": tuple(n for n, c in CASES.items() if c.op.startswith("sparse")),
    "cp": tuple(n for n, c in CASES.items() if c.op == "cp_fwd"),
    "all": tuple(CASES),
}


def lognormal_lengths(batch, *, seed, median=8192, sigma=1.0, lo=1024, hi=131072):
  """Cache lengths of a serving batch: lognormal around ``median``, clipped to [lo, hi].

  Example:
    >>> lens = lognormal_lengths(8, seed=0)
    >>> len(lens), min(lens) >= 1024, max(lens) <= 131072
    (8, True, True)
  """
  rng = np.random.default_rng(seed)
  lens = np.clip(np.exp(np.log(median) + sigma * rng.standard_normal(batch)), lo, hi)
  return tuple(int(n) for n in lens)


def _serving_cases():
  """Continuous-batching decode cases (group "serving"): mixed lognormal lengths (1K-128K,
  B8/32/64; contiguous and paged 16/64; split and scheduled), uniform B8 S32K, the unified-max
  softmax on uniform and mixed batches, sparse decode at B8/B32 (and unified max at B1/B8)."""
  cases = [Case("decode_b8_s32k", "decode", batch=8, seq=32768, **_DEC),
           Case("decode_b1_s128k_umax", "decode", batch=1, seq=131072, softmax="unified_max",
                **_DEC),
           Case("decode_b8_s32k_umax", "decode", batch=8, seq=32768, softmax="unified_max",
                **_DEC)]
  for b in (8, 32, 64):
    lens = lognormal_lengths(b, seed=b)
    cap = -(-max(lens) // 1024) * 1024          # a whole number of pages of 16 and 64
    cases.append(Case(f"decode_mixed_b{b}_even", "decode", batch=b, seq=cap,   # same tokens,
                      lengths=(sum(lens) // b,) * b, **_DEC))                 # equal lengths
    for page in (0, 16, 64):
      name = f"decode_mixed_b{b}" + (f"_paged{page}" if page else "")
      for sched in (False, True):
        cases.append(Case(name + ("_sched" if sched else ""), "decode", batch=b, seq=cap,
                          page_size=page, lengths=lens, schedule=sched, **_DEC))
  lens = lognormal_lengths(32, seed=32)
  cap = -(-max(lens) // 1024) * 1024
  cases += [Case("decode_mixed_b32_umax", "decode", batch=32, seq=cap, lengths=lens,
                 softmax="unified_max", **_DEC),
            Case("decode_mixed_b32_sched_umax", "decode", batch=32, seq=cap, lengths=lens,
                 softmax="unified_max", schedule=True, **_DEC)]
  for b in (8, 32):
    cases.append(Case(f"sparse_decode_b{b}_s128k", "sparse_decode", batch=b, seq=131072,
                      block=64, **_DEC))
  for b in (1, 8):
    cases.append(Case(f"sparse_decode_b{b}_s128k_umax", "sparse_decode", batch=b,
                      seq=131072, block=64, softmax="unified_max", **_DEC))
  return {c.name: c for c in cases}


CASES.update(_serving_cases())
GROUPS["serving"] = tuple(_serving_cases())
GROUPS["all"] = tuple(CASES)
for _name in CASES:   # "flash_d128" = flash_d128_fwd + flash_d128_fwdbwd, ...
  if _name.endswith("_fwd") and _name + "bwd" in CASES:
    GROUPS[_name[:-len("_fwd")]] = (_name, _name + "bwd")


def expand_cases(spec: str) -> list[str]:
  """Case names of a comma list of case and group names, in CASES order, without repeats.

  Raises:
    ValueError: naming the unknown entries.

  Example:
    >>> expand_cases("flash_window512,decode_b1_s128k")
    ['flash_window512_fwd', 'flash_window512_fwdbwd', 'decode_b1_s128k']
  """
  names, unknown = set(), []
  for item in (s.strip() for s in spec.split(",") if s.strip()):
    if item in CASES:
      names.add(item)
    elif item in GROUPS:
      names.update(GROUPS[item])
    else:
      unknown.append(item)
  if unknown:
    raise ValueError(f"unknown case(s) {', '.join(unknown)}; valid cases: {', '.join(CASES)}; "
                     f"groups: {', '.join(GROUPS)}")
  return [n for n in CASES if n in names]


def parse_impls(spec: str) -> list[str]:
  """Implementation names of a comma list, validated against ``IMPLS``.

  Raises:
    ValueError: naming the unknown entries and listing the valid ones.

  Example:
    >>> parse_impls("jattn,jax_nn_xla")
    ['jattn', 'jax_nn_xla']
  """
  impls = list(dict.fromkeys(s.strip() for s in spec.split(",") if s.strip()))
  unknown = [i for i in impls if i not in IMPLS]
  if unknown or not impls:
    raise ValueError(f"unknown implementation(s) {', '.join(unknown) or '(none given)'}; "
                     f"valid: {', '.join(IMPLS)}")
  return impls


# ----------------------------------------------------------------------------- references
def rel_err(x, ref):
  """||x - ref|| / ||ref|| in fp32 (NaN if x has NaN).

  Example:
    >>> rel_err(jnp.ones(4), jnp.ones(4))
    0.0
  """
  x = jnp.asarray(x, jnp.float32)
  ref = jnp.asarray(ref, jnp.float32)
  return float(jnp.linalg.norm((x - ref).ravel()) / (jnp.linalg.norm(ref.ravel()) + 1e-30))


def reference(q, k, v, mask_fn, ct=None, *, chunk=4096):
  """fp32 attention of one head and, with ``ct``, the gradients of sum(out * ct), in query chunks.

  Args:
    q: [q_len, head_dim]; k, v: [kv_len, head_dim] (any float dtype; computed in fp32 at
      HIGHEST precision, scale 1/sqrt(head_dim)).
    mask_fn: ``mask_fn(rows, cols) -> bool [len(rows), len(cols)]``, True where query ``rows[i]``
      sees key ``cols[j]`` (jittable: rows is traced).
    ct: None, or the output cotangent [q_len, head_dim].
    chunk: queries per chunk (bounds the materialised logits to chunk x kv_len).

  Returns:
    out [q_len, head_dim], or (out, (dq, dk, dv)) with ``ct``. Rows that see no key give 0.

  Example:
    >>> x = jnp.ones((8, 4))
    >>> reference(x, x, x, lambda r, c: c[None, :] <= r[:, None]).shape
    (8, 4)
  """
  q, k, v = (jnp.asarray(a, jnp.float32) for a in (q, k, v))
  scale = 1.0 / math.sqrt(q.shape[-1])
  hi = jax.lax.Precision.HIGHEST

  def attend(qc, k, v, offset):
    rows = offset + jnp.arange(qc.shape[0])
    mask = mask_fn(rows, jnp.arange(k.shape[0]))
    s = jnp.where(mask, jnp.einsum("qd,kd->qk", qc, k, precision=hi) * scale, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))                 # [chunk, kv_len]
    l = jnp.sum(p, axis=-1, keepdims=True)
    return jnp.einsum("qk,kd->qd", p / jnp.where(l == 0, 1.0, l), v, precision=hi)

  @jax.jit
  def fwd(qc, k, v, offset):
    return attend(qc, k, v, offset)

  @jax.jit
  def fwd_bwd(qc, k, v, ctc, offset):
    out, vjp = jax.vjp(lambda a, b, c: attend(a, b, c, offset), qc, k, v)
    return out, vjp(ctc)

  outs, dqs = [], []
  dk, dv = jnp.zeros_like(k), jnp.zeros_like(v)
  for start in range(0, q.shape[0], chunk):
    qc = q[start:start + chunk]
    if ct is None:
      outs.append(fwd(qc, k, v, start))
      continue
    out, (dq, dk_c, dv_c) = fwd_bwd(qc, k, v, jnp.asarray(ct[start:start + chunk], jnp.float32),
                                    start)
    outs.append(out)
    dqs.append(dq)
    dk, dv = dk + dk_c, dv + dv_c
  out = jnp.concatenate(outs)
  return out if ct is None else (out, (jnp.concatenate(dqs), dk, dv))


def decode_reference(q, k, v, lengths, keep=None):
  """fp32 decode attention (one query per sequence, GQA) over positions < lengths.

  Args:
    q: [batch, q_heads, head_dim]; k, v: [batch, max_len, kv_heads, head_dim].
    lengths: int [batch].
    keep: None or bool [batch, kv_heads, max_len]: also restrict to these positions.

  Returns:
    [batch, q_heads, head_dim] fp32.

  Example:
    >>> q, kv = jnp.ones((1, 4, 8)), jnp.ones((1, 16, 2, 8))
    >>> decode_reference(q, kv, kv, jnp.array([5])).shape
    (1, 4, 8)
  """
  b, hq, d = q.shape
  n, hk = k.shape[1], k.shape[2]
  keep = jnp.ones((b, hk, n), bool) if keep is None else keep

  def row(args):   # one sequence at a time: fp32 copies of one row's cache, never the batch's
    qr, kr, vr, length, kp = args
    qg = qr.astype(jnp.float32).reshape(hk, hq // hk, d)                    # [hk, group, d]
    s = jnp.einsum("hgd,nhd->hgn", qg, kr.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST) / math.sqrt(d)      # [hk, group, n]
    mask = (jnp.arange(n)[None, None, :] < length) & kp[:, None, :]
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    out = jnp.einsum("hgn,nhd->hgd", p, vr.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    return out.reshape(hq, d)

  return jax.jit(lambda *a: jax.lax.map(row, a))(q, k, v, lengths, keep)


def tile_mask(case, tile=128):
  """bool [seq, seq] of a ``mask_tiles`` case: seeded tile x tile blocks and the diagonal."""
  n = -(-case.seq // tile)
  keep = np.random.default_rng(case.seq).random((n, n)) < case.mask_tiles
  keep[np.arange(n), np.arange(n)] = True
  return np.repeat(np.repeat(keep, tile, 0), tile, 1)[:case.seq, :case.seq]


def flash_mask_fn(case, segment_row=None, tiles=None):
  """The element mask of a flash case as ``mask_fn(rows, cols)`` (for :func:`reference`)."""
  def mask_fn(rows, cols):
    r, c = rows[:, None], cols[None, :]
    m = jnp.ones((rows.shape[0], cols.shape[0]), bool)
    if case.causal:
      m &= c <= r
    if case.window is not None:
      m &= (c >= r - case.window[0]) & (c <= r + case.window[1])
    if segment_row is not None:
      seg_r = segment_row[rows][:, None]
      m &= (seg_r == segment_row[cols][None, :]) & (seg_r != 0)
    if tiles is not None:
      m &= tiles[rows[:, None], cols[None, :]]
    return m
  return mask_fn


def visible_pairs(case):
  """Query-key pairs one (batch row, head) of a flash or sparse case computes (its mask's)."""
  s = case.seq
  if case.mask_tiles:
    return float(tile_mask(case).sum())
  n = s // case.docs if case.docs else s
  i = np.arange(n)
  if case.window is not None:
    per_row = np.minimum(i + 1, case.window[0] + 1)
  elif case.causal:
    per_row = i + 1
  else:
    per_row = np.full(n, n)
  return float(per_row.sum()) * (case.docs or 1)


def causal_top_k(seq, fraction, *, q_block, block, num_init=1, num_local=1):
  """The top_k whose causal self-attention selection keeps about ``fraction`` of visible blocks.

  Query block i keeps its initial blocks, its local blocks (the key blocks its own queries span,
  plus num_local - 1 before them) and min(top_k, the other visible blocks).

  Returns:
    (top_k, kept fraction of the visible blocks).

  Example:
    >>> causal_top_k(65536, 0.19, q_block=128, block=64)
    (100, 0.1908770406920078)
  """
  nq = -(-seq // q_block)
  i = np.arange(nq)
  last = np.minimum((i + 1) * q_block, seq) - 1
  n_vis = last // block + 1
  lo = np.maximum((i * q_block) // block - (num_local - 1), num_init)
  forced = np.minimum(num_init, n_vis) + np.maximum(last // block - lo + 1, 0)
  forced = np.minimum(forced, n_vis)
  ks = np.arange(1, -(-seq // block) + 1)          # top_k >= 1 (jattn rejects 0)
  kept = (forced[None] + np.minimum(ks[:, None], (n_vis - forced)[None])).sum(1) / n_vis.sum()
  i = int(np.argmin(np.abs(kept - fraction)))
  return int(ks[i]), float(kept[i])


# ----------------------------------------------------------------------------- the bench
class Bench:
  """Runs cases, records rows, writes the results file.

  Args:
    impls: implementation names (``IMPLS``).
    out: None or the results path (rows also go to ``out + ".partial"`` as they come).
    interpret: run the explicit jattn Pallas implementations in interpret mode (CPU tests).
    timer: ``timer(fn, arg_sets) -> (ms, spread_ms)``; default ``time_fn``.
    command: recorded in meta.
  """

  def __init__(self, impls, *, out=None, interpret=False, timer=None, command=None):
    self.impls = list(impls)
    self.out = out
    self.interpret = interpret
    self.timer = timer or time_fn
    self.command = command
    self.rows = []
    self.cases = []
    self.started = None   # when the run began (with ``resume``: the first call's start)
    self._tokamax = _import_tokamax() if any(i.startswith("tokamax") for i in impls) else None
    if self._tokamax is None and any(i.startswith("tokamax") for i in impls):
      print("tokamax does not import: its rows are left out", flush=True)

  # -- rows
  def record(self, row):
    self.rows.append(row)
    keys = ("op", "case", "impl", "ms", "tflops", "tbps", "speedup", "rel_err", "ok", "error",
            "skipped")
    print("  " + " ".join(f"{k}={row[k]:.4g}" if isinstance(row.get(k), float)
                          else f"{k}={row.get(k)}" for k in keys if k in row), flush=True)
    if self.out:
      self._write(self.out + ".partial")

  def _failed(self, case, impl, e):
    self.record(dict(op=case.op, case=case.name, shape=case.shape, impl=impl, ms=None, ok=False,
                     error=f"{type(e).__name__}: {str(e)[:300]}"))

  def _timed(self, case, impl, fn, sets, check, work):
    """Jit ``fn``, check its output on ``sets[0]`` (``check(out) -> rel_err``), time it and record
    the row with ``work(ms)`` (a dict: tflops or tbps, ...). Returns ms, or None on failure."""
    try:
      f = jax.jit(fn)
      err = check(sync(f(*sets[0])))
      ms, spread = self.timer(f, sets)
    except Exception as e:   # recorded, never hidden
      self._failed(case, impl, e)
      return None
    self.record(dict(op=case.op, case=case.name, shape=case.shape, impl=impl, ms=ms,
                     spread_ms=spread, **work(ms), rel_err=err,
                     ok=bool(np.isfinite(err) and err < TOLERANCE)))
    return ms

  def _jattn_kw(self, impl):
    """``implementation=`` (and interpret) of a jattn implementation name."""
    if impl == "jattn":
      return {}
    kw = dict(implementation=impl[len("jattn_"):])
    if self.interpret:
      kw["interpret"] = True
    return kw

  # -- flash attention
  def flash(self, case):
    b, s, h, hk, d = case.batch, case.seq, case.heads, case.kv_heads, case.head_dim
    bwd = case.op == "flash_fwd_bwd"
    seed = zlib.crc32(case.shape.encode())
    shapes = [(b, s, h, d), (b, s, hk, d), (b, s, hk, d)] + ([(b, s, h, d)] if bwd else [])
    sets = random_sets(shapes, jnp.bfloat16, seed=seed)
    seg = None
    if case.docs:
      seg = jnp.broadcast_to(jnp.repeat(jnp.arange(1, case.docs + 1, dtype=jnp.int32),
                                        s // case.docs), (b, s))
    # Reference on the last batch row, head 0 (kv head 0).
    sl = lambda x: x[-1, :, 0]
    q, k, v = sets[0][:3]
    tiles = jnp.asarray(tile_mask(case)) if case.mask_tiles else None
    mask_fn = flash_mask_fn(case, None if seg is None else seg[-1], tiles)
    if bwd:
      ref_out, ref_grads = reference(sl(q), sl(k), sl(v), mask_fn, ct=sl(sets[0][3]))
    else:
      ref_out = reference(sl(q), sl(k), sl(v), mask_fn)
    flops = 4.0 * b * h * d * visible_pairs(case) * (3.5 if bwd else 1.0)
    work = lambda ms: dict(tflops=flops / ms / 1e9)
    for impl in self.impls:
      fn = self._flash_fn(case, impl, seg, None if tiles is None else tiles[None, None])
      if fn is None:
        continue
      if not bwd:
        self._timed(case, impl, fn, [t[:3] for t in sets],
                    lambda out: rel_err(sl(out), ref_out), work)
        continue

      def grads(q, k, v, ct, fn=fn):
        _, vjp = jax.vjp(fn, q, k, v)
        return vjp(ct)
      self._timed(case, impl, grads, sets,
                  lambda g: max(rel_err(sl(x), r) for x, r in zip(g, ref_grads)), work)

  def _flash_fn(self, case, impl, seg, mask=None):
    """f(q, k, v) of an implementation for a flash case, or None (printed why) if it has none."""
    window = case.window
    if impl.startswith("jattn"):
      return functools.partial(jattn.flash_attention, causal=case.causal, mask=mask,
                               local_window_size=window, segment_ids=seg, **self._jattn_kw(impl))
    if impl == "jax_nn_xla" and case.seq > 4096:
      self.record(dict(op=case.op, case=case.name, shape=case.shape, impl=impl, ms=None,
                       ok=None, skipped="above 4K tokens (it materialises the logits)"))
      return None
    if impl.startswith("jax_nn"):
      f = functools.partial(jax.nn.dot_product_attention, is_causal=case.causal, mask=mask,
                            local_window_size=window, implementation=impl[len("jax_nn_"):])
    elif impl.startswith("tokamax"):
      if self._tokamax is None:
        return None
      f = functools.partial(self._tokamax.dot_product_attention, is_causal=case.causal, mask=mask,
                            local_window_size=window, implementation=impl[len("tokamax_"):])
    else:
      return None
    if not case.docs:
      return f
    # Packed documents: the anchor runs the equivalent b * docs separate causal rows.
    n = case.seq // case.docs
    split = lambda x: x.reshape(x.shape[0] * case.docs, n, *x.shape[2:])
    return lambda q, k, v: f(split(q), split(k), split(v)).reshape(q.shape)

  # -- decode
  def decode(self, case):
    b, n, hq, hk, d = case.batch, case.seq, case.heads, case.kv_heads, case.head_dim
    lengths = jnp.array(case.lengths or [n] * b, jnp.int32)
    sets = []
    shapes = [(b, hq, d), (b, n, hk, d), (b, n, hk, d)]
    for i, (q, k, v) in enumerate(random_sets(shapes, jnp.bfloat16, num_sets=_num_sets(shapes),
                                              seed=zlib.crc32(case.shape.encode()))):
      sets.append((q, k, v, lengths) + (_paginate(jax.random.key(100 + i), k, v, case.page_size,
                                                  lengths) if case.page_size else ()))
    ref = decode_reference(*sets[0][:4])
    nbytes = float(jnp.sum(lengths)) * hk * d * 2 * 2   # K and V, bf16
    work = lambda ms: dict(tbps=nbytes / (ms * 1e-3) / 1e12)
    ragged = case.lengths is not None
    for impl in self.impls:
      if impl.startswith("jattn"):
        kw = self._jattn_kw(impl)
        if case.softmax != "exact":
          kw["softmax"] = case.softmax
        if case.schedule:   # planned once per batch composition, outside the timed call
          q, k, v, lens, *paged = sets[0]
          kw["schedule"] = jattn.decode_schedule(
              q, *(paged[:2] or (k, v)), lens, page_table=paged[2] if paged else None,
              implementation=kw.get("implementation"))
        if case.page_size:
          fn = lambda q, k, v, lens, kp, vp, table, kw=kw: jattn.paged_decode_attention(
              q, kp, vp, table, lens, **kw)
        else:
          fn = lambda q, k, v, lens, *_, kw=kw: jattn.decode_attention(q, k, v, lens, **kw)
      elif impl.startswith("jax_nn"):
        name = impl[len("jax_nn_"):]
        fn = lambda q, k, v, lens, *_, name=name: jax.nn.dot_product_attention(
            q[:, None], k, v, implementation=name,
            key_value_seq_lengths=lens if ragged else None)[:, 0]
      else:
        continue   # tokamax: no decode anchor
      self._timed(case, impl, fn, sets, lambda out: rel_err(out, ref), work)

  # -- block-sparse training attention
  def sparse(self, case):
    s, h, hk, d = case.seq, case.heads, case.kv_heads, case.head_dim
    qbs, bs = case.q_block, case.block
    top_k, _ = causal_top_k(s, case.fraction, q_block=qbs, block=bs)
    sets = random_sets([(1, s, h, d), (1, s, hk, d), (1, s, hk, d), (1, s, h, d)], jnp.bfloat16,
                       seed=zlib.crc32(case.shape.encode()))
    sl = lambda x: x[0, :, 0]
    q, k, v, ct = sets[0]
    causal_mask = flash_mask_fn(dataclasses.replace(case, window=None))
    dense_ref = None
    flops = 4.0 * h * d * visible_pairs(case) * 3.5

    def checker(ref):
      out_ref, grads_ref = ref
      return lambda r: max(rel_err(sl(x), y) for x, y in zip((r[0],) + tuple(r[1]),
                                                            (out_ref,) + tuple(grads_ref)))

    def fwd_bwd(attn):
      def f(q, k, v, ct):
        out, vjp = jax.vjp(attn, q, k, v)
        return out, vjp(ct)
      return f

    for impl in (i for i in self.impls if i.startswith("jattn")):
      kw = self._jattn_kw(impl)
      if dense_ref is None:
        dense_ref = reference(sl(q), sl(k), sl(v), causal_mask, ct=sl(ct))
      dense_ms = self._timed(
          case, impl + "_dense",
          fwd_bwd(functools.partial(jattn.flash_attention, causal=True, **kw)), sets,
          checker(dense_ref), lambda ms: dict(tflops=flops / ms / 1e9))
      skw = dict(block_size=bs, q_block_size=qbs, top_k=top_k, **kw)
      try:   # the reference needs this call's selection (kv head 0 of batch row 0)
        _, sel = jax.jit(functools.partial(jattn.sparse_attention, return_selection=True,
                                           **skw))(q, k, v)
        tiles = sel.tile_mask()[0, 0]                                      # [nq, nk]
        kept = float(jnp.sum(sel.counts)) / (_visible_blocks(s, qbs, bs)
                                             * sel.counts.shape[0] * sel.counts.shape[1])
      except Exception as e:
        self._failed(case, impl, e)
        continue

      def sparse_mask(rows, cols, tiles=tiles):
        return causal_mask(rows, cols) & jnp.take(tiles[rows // qbs], cols // bs, axis=1)
      ref = reference(sl(q), sl(k), sl(v), sparse_mask, ct=sl(ct))
      self._timed(case, impl, fwd_bwd(functools.partial(jattn.sparse_attention, **skw)), sets,
                  checker(ref), lambda ms: dict(
                      tflops=flops * kept / ms / 1e9, top_k=top_k, kept_fraction=kept,
                      **({} if dense_ms is None else dict(speedup=dense_ms / ms))))

  # -- sparse decode
  def sparse_decode(self, case):
    b, n, hq, hk, d, bs = case.batch, case.seq, case.heads, case.kv_heads, case.head_dim, case.block
    nb = n // bs
    top_k = max(1, int(round(case.fraction * nb)) - 2)   # besides 1 initial + 1 local block
    lengths = jnp.full((b,), n, jnp.int32)
    sets = []
    shapes = [(b, hq, d), (b, n, hk, d), (b, n, hk, d)]
    for q, k, v in random_sets(shapes, jnp.bfloat16, num_sets=_num_sets(shapes),
                               seed=zlib.crc32(case.shape.encode())):
      sets.append((q, k, v, jattn.init_block_summaries(k, lengths, block_size=bs)))
    q, k, v, summ = sets[0]
    dense_ref = decode_reference(q, k, v, lengths)
    nbytes = float(b * n) * hk * d * 2 * 2
    for impl in (i for i in self.impls if i.startswith("jattn")):
      kw = self._jattn_kw(impl)
      dense_ms = self._timed(
          case, impl + "_dense", lambda q, k, v, summ, kw=kw: jattn.decode_attention(
              q, k, v, lengths, **kw), sets, lambda out: rel_err(out, dense_ref),
          lambda ms: dict(tbps=nbytes / (ms * 1e-3) / 1e12))
      skw = dict(block_size=bs, top_k=top_k, **kw)
      if case.softmax != "exact":
        skw["softmax"] = case.softmax
      try:   # the reference keeps the blocks this implementation selected
        _, idx = jax.jit(functools.partial(jattn.sparse_decode_attention, return_indices=True,
                                           **skw))(q, k, v, lengths, summ)
        blocks = jnp.zeros((b, hk, nb + 1), bool).at[
            jnp.arange(b)[:, None, None], jnp.arange(hk)[None, :, None],
            jnp.where(idx < 0, nb, idx)].set(True)[..., :nb]
        ref = decode_reference(q, k, v, lengths, keep=jnp.repeat(blocks, bs, axis=-1))
        kept = float(jnp.mean(jnp.sum(blocks, -1))) / nb
      except Exception as e:
        self._failed(case, impl, e)
        continue
      self._timed(case, impl, lambda q, k, v, summ, skw=skw: jattn.sparse_decode_attention(
          q, k, v, lengths, summ, **skw), sets, lambda out: rel_err(out, ref),
          lambda ms: dict(tbps=nbytes * kept / (ms * 1e-3) / 1e12, top_k=top_k,
                          kept_fraction=kept,
                          **({} if dense_ms is None else dict(speedup=dense_ms / ms))))

  # -- context parallelism: the ring's kernels one after another on one device
  def cp(self, case):
    from jattn.context_parallel import (context_parallel_permute, context_parallel_unpermute,
                                        ring_device_forward)
    b, s, h, d, p = case.batch, case.seq, case.heads, case.head_dim, case.chunks
    mask = {"causal": case.causal, "local_window_size": case.window}
    plan = jattn.context_parallel_plan(s, s, p, **mask, layout=case.layout)
    sets = random_sets([(b, s, h, d), (b, s, case.kv_heads, d)] * 2, jnp.bfloat16,
                       seed=zlib.crc32(case.shape.encode()))
    sets = [t[:3] for t in sets]
    # Each device's shards, in the layout's order, as separate arrays (as on p devices).
    shard = lambda x: tuple(jnp.split(context_parallel_permute(x, p, layout=case.layout), p,
                                      axis=1))
    ring_sets = [sum((shard(x) for x in t), ()) for t in sets]

    def ring(*xs, kw):   # every device's forward, one after another: p outputs
      q, kv = xs[:p], list(zip(xs[p:2 * p], xs[2 * p:]))
      return tuple(ring_device_forward(plan, q[i], kv, i, **kw)[0] for i in range(p))

    sl = lambda x: x[-1, :, 0]
    q, k, v = sets[0]
    ref = reference(sl(q), sl(k), sl(v), flash_mask_fn(case))
    whole = lambda outs: context_parallel_unpermute(jnp.concatenate(outs, axis=1), p,
                                                    layout=case.layout)
    flops = 4.0 * b * h * d * visible_pairs(case)
    for impl in (i for i in self.impls if i.startswith("jattn")):
      kw = self._jattn_kw(impl)
      fused = self._timed(case, impl + "_fused", functools.partial(
          jattn.flash_attention, **mask, **kw), sets, lambda out: rel_err(sl(out), ref),
          lambda ms: {"tflops": flops / ms / 1e9})
      self._timed(case, impl, functools.partial(ring, kw=kw), ring_sets,
                  lambda outs: rel_err(sl(whole(outs)), ref), lambda ms, f=fused: {
                      "tflops": flops / ms / 1e9, "kernel_calls": plan.kernel_calls,
                      "pairs": p * p * plan.table.shape[-1] ** 2,
                      **({} if f is None else {"overhead": ms / f})})

  # -- driver
  def resume(self):
    """Take the rows of the cases that ``<out>.partial`` finished (a run stopped by a time
    limit); ``run`` then skips those cases. The last case the partial file names is run again
    (it may have stopped midway). Returns the cases taken.

    Raises:
      ValueError: no partial file, or one written on another device or for other
        implementations.
    """
    path = (self.out or "") + ".partial"
    if not self.out or not os.path.exists(path):
      raise ValueError(f"--resume: no partial results file {path!r}")
    with open(path) as fh:
      old = json.load(fh)
    here = meta(self.impls, [], None, self._tokamax)
    for key in ("device", "impls"):
      if old["meta"].get(key) != here[key]:
        raise ValueError(f"--resume: {path} has {key} {old['meta'].get(key)!r}, this run "
                         f"{here[key]!r}")
    done = old["meta"]["cases"][:-1]
    self.cases = list(done)
    self.rows = [r for r in old["rows"] if r["case"] in done]
    self.started = old["meta"]["date"].split(" to ")[0]
    return done

  def run(self, names, *, tiny=False):
    self.started = self.started or _now()
    for name in names:
      if name in self.cases:
        continue
      case = CASES[name].tiny() if tiny else CASES[name]
      self.cases.append(name)
      print(f"[{name}] {case.shape}", flush=True)
      runner = dict(flash_fwd=self.flash, flash_fwd_bwd=self.flash, decode=self.decode,
                    sparse_fwd_bwd=self.sparse, sparse_decode=self.sparse_decode,
                    cp_fwd=self.cp)[case.op]
      try:
        runner(case)
      except Exception as e:   # e.g. inputs or reference out of memory: the case fails, not the run
        self._failed(case, "(case)", e)
    result = self.result()
    if self.out:
      self._write(self.out)
      if os.path.exists(self.out + ".partial"):
        os.remove(self.out + ".partial")
      print(f"wrote {self.out}", flush=True)
    return result

  def result(self):
    m = meta(self.impls, self.cases, self.command, self._tokamax)
    if self.started:
      m["date"] = f"{self.started} to {m['date']}"
    return {"meta": m, "rows": self.rows}

  def _write(self, path):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as fh:
      json.dump(self.result(), fh, indent=1)
      fh.write("\n")


def _visible_blocks(seq, q_block, block):
  """Causally visible (query block, key block) pairs of one self-attention head."""
  i = np.arange(-(-seq // q_block))
  return int(((np.minimum((i + 1) * q_block, seq) - 1) // block + 1).sum())


def _num_sets(shapes, itemsize=2):
  """Input sets a case rotates: 3 (so that no timed call reads inputs a previous call left in
  the L2 cache) while they total at most 2 GiB each, else 1 (far larger than any cache; three
  would not fit the largest serving batches in 80 GB)."""
  return 3 if sum(math.prod(s) for s in shapes) * itemsize <= 2 ** 31 else 1


def _paginate(key, k, v, page_size, lengths):
  """A shuffled page pool holding the pages that cover each sequence's ``lengths`` (no more, as
  a serving pool): (k_pages, v_pages, page_table); table entries past a sequence's pages are 0."""
  b, n, hk, d = k.shape
  pages = n // page_size
  used = -(-np.asarray(lengths) // page_size)
  src = np.concatenate([i * pages + np.arange(u) for i, u in enumerate(used)]).astype(np.int32)
  perm = np.asarray(jax.random.permutation(key, len(src)), np.int32)   # pool slot of src[t]
  table = np.zeros((b, pages), np.int32)
  table[np.repeat(np.arange(b), used), np.concatenate([np.arange(u) for u in used])] = perm
  gather = jax.jit(lambda x, idx: x.reshape(b * pages, page_size, hk, d)[idx])
  idx = jnp.asarray(src[np.argsort(perm)])
  return gather(k, idx), gather(v, idx), jnp.asarray(table)


def _import_tokamax():
  try:
    import tokamax
    return tokamax
  except Exception:   # optional anchor
    return None


def device_slug(kind: str) -> str:
  """The results file's name for a jax ``device_kind``.

  Example:
    >>> device_slug("NVIDIA H100 80GB HBM3"), device_slug("NVIDIA H200"), device_slug("cpu")
    ('h100', 'h200', 'cpu')
  """
  words = kind.lower().split()
  if words and words[0] == "nvidia" and len(words) > 1:
    return re.sub(r"[^a-z0-9]+", "_", words[1]).strip("_")
  return re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_") or "device"


def results_path(names, out=None, *, tiny=False, device_kind=None):
  """Where a run writes: ``out`` if given; else experiments/results/<device>.json for a run of
  every case at full size; else None (a subset or a tiny run writes no file).

  Example:
    >>> results_path(["decode_b1_s128k"]) is None
    True
    >>> os.path.basename(results_path(list(CASES), device_kind="NVIDIA H200"))
    'h200.json'
  """
  if out is not None:
    return out
  if tiny or list(names) != list(CASES):
    return None
  kind = device_kind or jax.devices()[0].device_kind
  return os.path.join(RESULTS_DIR, device_slug(kind) + ".json")


def _git_commit():
  try:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run(["git", "-C", root, "describe", "--always", "--dirty"],
                          capture_output=True, text=True, timeout=10).stdout.strip() or None
  except Exception:
    return None


def _version(package):
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return None


def _now():
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def meta(impls, cases, command, tokamax=None):
  """The results file's meta block: date, device, versions, commit, command, timing rules."""
  dev = jax.devices()[0]
  return dict(
      date=_now(),
      device=getattr(dev, "device_kind", str(dev)), platform=dev.platform,
      jax_version=jax.__version__, jaxlib_version=_version("jaxlib"),
      jattn_version=jattn.__version__, python=platform.python_version(),
      tokamax_version=getattr(tokamax, "__version__", None) if tokamax else None,
      commit=os.environ.get("JATTN_COMMIT") or _git_commit(), command=command,
      cases=list(cases), impls=list(impls),
      timing="median of 3 host-timed loops of async calls (>= 5 calls, >= 0.1 s each) after one "
             "warm-up call per input set, rotating 3 random bf16 input sets (1 set above 2 GiB)",
      work="flash: 4*B*H*D*visible pairs (fwd+bwd 3.5x); sparse: the same times the kept "
           "fraction; decode: K and V bytes read",
      check=f"rel_err vs an fp32 reference on one (batch row, head) slice; ok = rel_err < "
            f"{TOLERANCE}")


# ----------------------------------------------------------------------------- summary
def summary(result, cases=None) -> str:
  """Markdown tables of a results file: per case jattn's ms, each anchor's ms and the best
  anchor's ms / jattn's ms (flash, decode; above 1: jattn is faster); jattn's sparse ms, its dense
  ms and the speedup (sparse); the ring's ms, the fused call's and their ratio (cp).

  Args:
    result: a results file's content.
    cases: None (every case) or the case names to show.

  Returns:
    The markdown.

  Example:
    >>> rows = [dict(op="flash_fwd", case="c", shape="s", impl="jattn", ms=2.0, ok=True),
    ...         dict(op="flash_fwd", case="c", shape="s", impl="jax_nn_cudnn", ms=4.0, ok=True)]
    >>> print(summary({"meta": {}, "rows": rows}).splitlines()[-1])
    | c | s | 2.000 | 4.000 | 2.00 |
  """
  rows = result["rows"]
  meta_ = result.get("meta", {})
  fmt = lambda r: ("n/a" if r is not None and r.get("skipped") else
                   "fail" if r is None or not r.get("ok") or r.get("ms") is None
                   else f"{r['ms']:.3f}")
  by = {(r["case"], r["impl"]): r for r in rows}
  cases = [c for c in dict.fromkeys(r["case"] for r in rows if r["impl"] != "(case)")
           if cases is None or c in cases]
  shape = {r["case"]: r.get("shape", "") for r in rows}
  op = {r["case"]: r["op"] for r in rows}
  lines = []
  if meta_:
    lines.append(f"{meta_.get('device')}, jax {meta_.get('jax_version')}, "
                 f"commit {meta_.get('commit')}, {meta_.get('date')}\n")
  dense = [c for c in cases if op[c].startswith(("flash", "decode"))]
  anchors = [a for a in ANCHOR_IMPLS if any((c, a) in by for c in dense)]
  if dense:
    lines.append("| case | shape | jattn ms | " + " | ".join(f"{a} ms" for a in anchors)
                 + " | speed vs best anchor |")
    lines.append("|---|---|---|" + "---|" * len(anchors) + "---|")
    for c in dense:
      j = by.get((c, "jattn"))
      good = [by[(c, a)]["ms"] for a in anchors
              if (c, a) in by and by[(c, a)].get("ok") and by[(c, a)].get("ms")]
      ratio = (f"{min(good) / j['ms']:.2f}" if good and j and j.get("ok") and j.get("ms")
               else "")
      cells = [fmt(by.get((c, a))) if (c, a) in by else "" for a in anchors]
      lines.append(f"| {c} | {shape[c]} | {fmt(j)} | " + " | ".join(cells) + f" | {ratio} |")
  sparse = [c for c in cases if op[c].startswith("sparse")]
  if sparse:
    if dense:
      lines.append("")
    lines.append("| case | shape | jattn ms | jattn dense ms | speedup |")
    lines.append("|---|---|---|---|---|")
    for c in sparse:
      j, dn = by.get((c, "jattn")), by.get((c, "jattn_dense"))
      sp = f"{j['speedup']:.2f}x" if j and j.get("ok") and j.get("speedup") else ""
      lines.append(f"| {c} | {shape[c]} | {fmt(j)} | {fmt(dn)} | {sp} |")
  ring = [c for c in cases if op[c] == "cp_fwd"]
  if ring:
    lines += ["", "| case | shape | ring ms | fused ms | ring / fused |", "|---|---|---|---|---|"]
    for c in ring:
      j, f = by.get((c, "jattn")), by.get((c, "jattn_fused"))
      ov = f"{j['overhead']:.3f}" if j and j.get("ok") and j.get("overhead") else ""
      lines.append(f"| {c} | {shape[c]} | {fmt(j)} | {fmt(f)} | {ov} |")
  return "\n".join(lines)


def rows_of(rows, case):
  return [r for r in rows if r["case"] == case]


# ----------------------------------------------------------------------------- docs
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS_PAGE = os.path.join(ROOT, "docs", "benchmarks.md")
README = os.path.join(ROOT, "README.md")
README_BEGIN = "<!-- benchmark table: python -m experiments.bench --write-docs RESULTS -->"
README_END = "<!-- end of benchmark table -->"
README_CASES = GROUPS["anchors"] + ("flash_tilemask10_fwd", "flash_d64_fwd", "flash_d64_causal_fwd",
                                    "decode_b8_s32k_paged", "decode_mixed_b32",
                                    "sparse_decode_b1_s128k", "cp_64k_window512_p2")
_META_KEYS = ("device", "platform", "date", "commit", "jattn_version", "jax_version",
              "jaxlib_version", "python", "tokamax_version", "command", "timing", "work", "check")


def benchmarks_page(results, sources) -> str:
  """docs/benchmarks.md for results files (one per device): per device, the summary tables, the
  run's meta block and every row.

  Args:
    results: the results files' contents (``{"meta": ..., "rows": ...}`` each).
    sources: their paths as the page names them (relative to the repository root).

  Returns:
    The page's markdown.

  Example:
    >>> page = benchmarks_page([{"meta": {"device": "cpu"}, "rows": []}], ["r.json"])
    >>> page.splitlines()[0]
    '# Benchmarks'
  """
  cell = lambda x: "" if x is None else str(x).replace("|", "/").replace("\n", " ")
  num = lambda r, k, f: "" if r.get(k) is None else format(r[k], f)
  lines = ["# Benchmarks", "",
           f"Generated by `python -m experiments.bench --write-docs {' '.join(sources)}` from "
           f"those results files (each one run on one device: compare ratios within a run). "
           f"Reproduce on a GPU with `python -m experiments.bench --all` (every case, `--list` "
           f"names them; `--case NAME` for some).", "",
           "ms, lower is better; the anchors ran in the same process and every output was "
           "checked against an fp32 reference; \"speed vs best anchor\" is the best anchor's "
           "time over jattn's (above 1: jattn is faster). Sparse rows compare with jattn's own "
           "dense kernel."]
  for result, source in zip(results, sources):
    lines += ["", f"## {result['meta'].get('device')} (`{source}`)", "", summary(result), "",
              "### The run", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {cell(result['meta'].get(k))} |" for k in _META_KEYS
              if result["meta"].get(k) is not None]
    lines += ["", "### Every row", "",
              "| case | impl | ms | TFLOP/s | TB/s | speedup | rel_err | ok |",
              "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
      ok = r.get("skipped") and f"skipped: {r['skipped']}" or r.get("error") or r.get("ok")
      lines.append(f"| {r['case']} | {r['impl']} | {num(r, 'ms', '.3f')} | "
                   f"{num(r, 'tflops', '.1f')} | {num(r, 'tbps', '.2f')} | "
                   f"{num(r, 'speedup', '.2f')} | {num(r, 'rel_err', '.1e')} | {cell(ok)} |")
  return "\n".join(lines) + "\n"


def write_docs(paths):
  """Rewrite docs/benchmarks.md from results files (one per device) and the README's table
  (between ``README_BEGIN`` and ``README_END``) from the first.

  Args:
    paths: the results files.

  Returns:
    None.

  Example:
    >>> callable(write_docs)
    True
  """
  results = []
  for path in paths:
    with open(path) as fh:
      results.append(json.load(fh))
  sources = [os.path.relpath(os.path.abspath(p), ROOT) for p in paths]
  with open(DOCS_PAGE, "w") as fh:
    fh.write(benchmarks_page(results, sources))
  with open(README) as fh:
    text = fh.read()
  if README_BEGIN not in text or README_END not in text:
    raise ValueError(f"README.md lacks the markers {README_BEGIN!r} ... {README_END!r}")
  head, rest = text.split(README_BEGIN, 1)
  tail = rest.split(README_END, 1)[1]
  with open(README, "w") as fh:
    fh.write(f"{head}{README_BEGIN}\n{summary(results[0], README_CASES)}\n{README_END}{tail}")


# ----------------------------------------------------------------------------- command line
def _parser():
  p = argparse.ArgumentParser(
      prog="python -m experiments.bench",
      description="Kernel benchmark: jattn and its anchors on named cases, every timed output "
                  "checked against an fp32 reference in the same run.",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="cases: " + ", ".join(CASES) + "\ngroups: " + ", ".join(
          f"{g} ({len(v)})" for g, v in GROUPS.items()) + "\nimplementations: " + ", ".join(IMPLS))
  what = p.add_mutually_exclusive_group()
  what.add_argument("--list", action="store_true", help="print the cases and groups and exit")
  what.add_argument("--case", action="append", metavar="NAME",
                    help="a case or group name, or a comma list; repeatable (see --list)")
  what.add_argument("--all", action="store_true", help="every case")
  what.add_argument("--write-docs", metavar="RESULTS", default=None, nargs="+",
                    help="regenerate docs/benchmarks.md from results files (one per device) "
                         "and the README's table from the first, and exit")
  p.add_argument("--impl", action="append", metavar="NAME",
                 help=f"an implementation or a comma list; repeatable (default: "
                      f"{', '.join(DEFAULT_IMPLS)}; tokamax_* when tokamax imports)")
  p.add_argument("--out", default=None,
                 help="results file (default: experiments/results/<device>.json for --all at "
                      "full size; otherwise rows are only printed)")
  p.add_argument("--tiny", action="store_true",
                 help="every case at CPU-test sizes (seq / 64, heads / 8); writes only to --out")
  p.add_argument("--interpret", action="store_true",
                 help="run the explicit jattn_* Pallas implementations in interpret mode (CPU)")
  p.add_argument("--resume", action="store_true",
                 help="continue a run that a time limit stopped: keep the cases its "
                      "<out>.partial file finished and run the rest (same cases, device and "
                      "implementations)")
  return p


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  p = _parser()
  args = p.parse_args(argv)
  if args.write_docs:
    write_docs(args.write_docs)
    print(f"wrote {os.path.relpath(DOCS_PAGE)} and the table in {os.path.relpath(README)}")
    return 0
  if args.list:
    for name, c in CASES.items():
      print(f"{name:28s} {c.op:15s} {c.shape}")
    for g, names in GROUPS.items():
      print(f"{g:28s} group: {', '.join(names)}")
    return 0
  if not (args.all or args.case):
    p.error("say what to run: --all, --case NAME (names: --list) or --write-docs RESULTS")
  try:
    names = expand_cases(",".join(args.case or ["all"]))
    impls = parse_impls(",".join(args.impl or DEFAULT_IMPLS))
  except ValueError as e:
    p.error(str(e))   # exit status 2
  out = results_path(names, args.out, tiny=args.tiny)
  if out is None:
    print("a subset of the cases (or --tiny): rows are printed, no file written (give --out)")
  try:
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.ERROR)   # tokamax's autotuning-cache warnings
  except ImportError:
    pass
  bench = Bench(impls, out=out, interpret=args.interpret,
                command=" ".join(["python -m experiments.bench", *argv]))
  if args.resume:
    try:
      print(f"resuming: {len(bench.resume())} cases taken from {out}.partial", flush=True)
    except ValueError as e:
      p.error(str(e))
  result = bench.run(names, tiny=args.tiny)
  print(summary(result))
  return 0


if __name__ == "__main__":
  sys.exit(main())
