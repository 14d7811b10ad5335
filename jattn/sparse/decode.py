"""Sparse decode: running key sums per cache block (:class:`BlockSummaries`, O(1) per appended
token) score the blocks of a contiguous or paged cache; each new token attends to its initial,
local and top-K blocks (:func:`sparse_decode_attention`, :func:`sparse_paged_decode_attention`)."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jattn._layout import check_kv_layout as _check_kv_layout
from jattn._layout import hnd_as_sequences as _hnd_as_sequences
from jattn._layout import hnd_pages_as_sequences
from jattn._plan import Plan
from jattn._validate import (as_array, check_flags, check_float, check_int, check_lengths,
                             check_nonempty, check_scale_and_cap)
from jattn.decode import check_decode_call, check_page_table, resolve_decode_implementation
from jattn.decode_serving import check_serving_args, newest_key_logits, run_decode
from jattn.sparse.selection import (_HIGHEST, _selected_lists_by_sort, cdiv,
                                    check_selection_args, top_k_cut)
from pallas_kernels import compat
from pallas_kernels.common.util import pad_axis
from pallas_kernels.sparse.decode import default_num_splits
from pallas_kernels.sparse.decode_select import decode_width, default_score_splits


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockSummaries:
  """Running per-block key sums of a contiguous KV cache, for decode-time block scoring.

  Attributes:
    sums: fp32 [batch, num_blocks, kv_heads, head_dim] ("nhd", kv_heads first for "hnd"):
      key sums of each block over the positions < lengths.
    lengths: int32 [batch]: number of cache positions summarised.
    block_size, layout: positions per block; "nhd" or "hnd", the summarised cache's (static).

  Example:
    >>> k = jax.random.normal(jax.random.key(0), (1, 128, 2, 16))
    >>> s = init_block_summaries(k, jnp.array([100]), block_size=32)
    >>> s.sums.shape, s.num_blocks, s.layout
    ((1, 4, 2, 16), 4, 'nhd')
  """
  sums: jax.Array
  lengths: jax.Array
  block_size: int = dataclasses.field(metadata=dict(static=True))
  layout: str = dataclasses.field(default="nhd", metadata=dict(static=True))

  def __post_init__(self):
    _check_kv_layout(self.layout)

  @property
  def num_blocks(self) -> int:
    return self.sums.shape[1 if self.layout == "nhd" else 2]

  def counts(self):
    """Summarised positions per block: int32 [batch, num_blocks].

    Example:
      >>> k = jnp.ones((1, 100, 1, 4))
      >>> init_block_summaries(k, jnp.array([70]), block_size=32).counts().tolist()
      [[32, 32, 6, 0]]
    """
    starts = jnp.arange(self.num_blocks, dtype=jnp.int32) * self.block_size
    return jnp.clip(self.lengths[:, None] - starts, 0, self.block_size).astype(jnp.int32)

  def means(self):
    """Mean key per block (the decode-time block summary): fp32, the shape of ``sums``; 0 for
    empty blocks.

    Example:
      >>> k = jnp.ones((1, 100, 1, 4))
      >>> float(init_block_summaries(k, jnp.array([70]), block_size=32).means()[0, 2, 0, 0])
      1.0
    """
    cnt = jnp.maximum(self.counts(), 1).astype(jnp.float32)                # [b, nb]
    return self.sums / (cnt[:, None, :, None] if self.layout == "hnd" else cnt[:, :, None, None])


def _check_summaries(summaries, name="block_summaries"):
  if not isinstance(summaries, BlockSummaries):
    raise TypeError(f"{name} must be a BlockSummaries, got {type(summaries).__name__}")


def _gather_positions(k, page_table, pos, hnd=False):
  """Rows k[b, pos[b, t]] of a contiguous cache, or via the page table of a page pool
  (head-major caches or pages with ``hnd``): [b, t, hk, d]."""
  if page_table is None:
    bi = jnp.arange(k.shape[0])[:, None]
    return k[bi, :, pos] if hnd else k[bi, pos]                              # [b, t, hk, d]
  ps = k.shape[2 if hnd else 1]
  page = jnp.clip(jnp.take_along_axis(page_table, pos // ps, axis=1), 0, k.shape[0] - 1)
  return k[page, :, pos % ps] if hnd else k[page, pos % ps]                  # [b, t, hk, d]


def init_block_summaries(k_cache, kv_lengths, *, block_size, page_table=None, kv_layout="nhd"):
  """Block key sums of a cache from scratch (after prefill; O(cache) once).

  Args:
    k_cache: the cache in ``kv_layout`` (see :func:`sparse_decode_attention`), or with
      ``page_table`` a page pool (see :func:`sparse_paged_decode_attention`).
    kv_lengths: int [batch]: valid positions per sequence.
    block_size: positions per block (the page size for a paged cache).
    page_table: None or int32 [batch, max_pages] (as :func:`sparse_paged_decode_attention`).
    kv_layout: "nhd" (default) or "hnd" (head-major).

  Returns:
    A :class:`BlockSummaries` with ceil(max_len / block_size) (or max_pages) blocks and
    ``layout=kv_layout``.

  Example:
    >>> k = jax.random.normal(jax.random.key(0), (2, 256, 2, 16))
    >>> s = init_block_summaries(k, jnp.array([10, 200]), block_size=64)
    >>> s.sums.shape
    (2, 4, 2, 16)
  """
  _check_kv_layout(kv_layout)
  check_float("k_cache", k_cache)
  if k_cache.ndim != 4:
    raise ValueError(f"k_cache must be 4-d, got {k_cache.shape}")
  check_nonempty(k_cache=k_cache)
  check_selection_args(block_size, 1, 1, 0, 0)
  hnd = kv_layout == "hnd"
  if page_table is not None:
    if (ps := k_cache.shape[2 if hnd else 1]) != block_size:
      raise ValueError(f"page size {ps} must equal block_size {block_size}")
    page_table, kv_lengths = check_page_table(page_table, kv_lengths, k_cache.shape[0], ps)
    n = page_table.shape[1] * block_size
    pos = jnp.broadcast_to(jnp.arange(n)[None], (page_table.shape[0], n))
    k_cache = _gather_positions(k_cache, page_table, pos, hnd)               # [b, n, hk, d]
    k_cache = jnp.swapaxes(k_cache, 1, 2) if hnd else k_cache
  b, n = k_cache.shape[0], k_cache.shape[2 if hnd else 1]
  lengths = jnp.clip(check_lengths("kv_lengths", kv_lengths, b, n), 0, n)   # traced: clamped
  sums = _block_sums(k_cache, lengths, int(block_size), hnd)
  return BlockSummaries(sums=sums, lengths=lengths, block_size=int(block_size), layout=kv_layout)


@functools.partial(jax.jit, static_argnums=(2, 3))   # fused: no fp32 copy of the cache
def _block_sums(k_cache, lengths, block_size, hnd):
  axis = 2 if hnd else 1
  valid = jnp.arange(k_cache.shape[axis])[None, :] < lengths[:, None]      # [b, n]
  valid = valid[:, None, :, None] if hnd else valid[:, :, None, None]
  kf = jnp.where(valid, k_cache.astype(jnp.float32), 0.0)
  kf = pad_axis(kf, axis, cdiv(kf.shape[axis], block_size) * block_size)
  shape = kf.shape[:axis] + (-1, block_size) + kf.shape[axis + 1:]
  return kf.reshape(shape).sum(axis + 1)                # [b, nb, hk, d] or [b, hk, nb, d]


def update_block_summaries(summaries, k_cache, kv_lengths, *, page_table=None, kv_layout=None):
  """Add the newest key of each sequence (at ``kv_lengths - 1``) to its block sum; sequences
  that did not grow are unchanged (growth by several tokens needs :func:`init_block_summaries`).

  Args:
    summaries: a :class:`BlockSummaries`.
    k_cache: the cache (or page pool) in the summaries' layout, holding the new keys.
    kv_lengths: int [batch], lengths including the new token.
    page_table: None or int32 [batch, max_pages].
    kv_layout: None (``summaries.layout``) or that layout, else ValueError.

  Returns:
    The updated :class:`BlockSummaries` (same layout).

  Example:
    >>> k = jax.random.normal(jax.random.key(0), (1, 128, 1, 8))
    >>> s = init_block_summaries(k, jnp.array([5]), block_size=64)
    >>> s = update_block_summaries(s, k, jnp.array([6]))
    >>> int(s.lengths[0])
    6
  """
  _check_summaries(summaries, "summaries")
  if kv_layout is not None:
    _check_kv_layout(kv_layout)
    if kv_layout != summaries.layout:
      raise ValueError(f"kv_layout={kv_layout!r} but the summaries were made for a "
                       f"{summaries.layout!r} cache (init_block_summaries(kv_layout=...))")
  hnd = summaries.layout == "hnd"
  check_float("k_cache", k_cache)
  ax = 1 if hnd else 2   # the kv-head axis; [ax::3 - ax]: (kv_heads, head_dim) in both layouts
  if k_cache.ndim != 4 or k_cache.shape[ax::3 - ax] != summaries.sums.shape[ax::3 - ax] or (
      page_table is not None and k_cache.shape[3 - ax] != summaries.block_size) or (
      page_table is None and k_cache.shape[0] != summaries.sums.shape[0]) or 0 in k_cache.shape:
    raise ValueError(f"k_cache {k_cache.shape} does not match the {summaries.layout!r} "
                     f"summaries {summaries.sums.shape} of block_size {summaries.block_size}")
  bsz = summaries.sums.shape[0]
  if page_table is not None:
    page_table, kv_lengths = check_page_table(page_table, kv_lengths, k_cache.shape[0],
                                              summaries.block_size, bsz)
  cap = summaries.num_blocks * summaries.block_size
  cap = cap if page_table is not None else min(cap, k_cache.shape[2 if hnd else 1])
  lengths = jnp.clip(check_lengths("kv_lengths", kv_lengths, bsz, cap), 0, cap)
  pos = jnp.maximum(lengths - 1, 0)
  new = lengths > summaries.lengths
  bi, blk = jnp.arange(bsz), pos // summaries.block_size
  k_new = _gather_positions(k_cache, page_table, pos[:, None], hnd)[:, 0]    # [b, hk, d]
  k_new = jnp.where(new[:, None, None], k_new.astype(jnp.float32), 0.0)
  sums = (summaries.sums.at[bi, :, blk] if hnd else summaries.sums.at[bi, blk]).add(k_new)
  return BlockSummaries(sums=sums, lengths=jnp.where(new, lengths, summaries.lengths),
                        block_size=summaries.block_size, layout=summaries.layout)


def select_decode_blocks(q, block_summaries, kv_lengths, *, top_k, num_init_blocks=1,
                         num_local_blocks=1):
  """Block selection for one new query per sequence: ``select_blocks(q_block_size=1)``'s rules
  for the query at kv_lengths - 1, scored by (summed group queries) . (mean block key).

  Args:
    q: [batch, q_heads, head_dim].
    block_summaries: :class:`BlockSummaries` of the cache (holding the new token).
    kv_lengths: int [batch], lengths including the new token.
    top_k, num_init_blocks, num_local_blocks: as in :func:`select_blocks`.

  Returns:
    int32 [batch, kv_heads, max_selected]: kept block ids ascending, then -1.

  Example:
    >>> k = jax.random.normal(jax.random.key(0), (1, 512, 2, 16))
    >>> s = init_block_summaries(k, jnp.array([500]), block_size=64)
    >>> q = jax.random.normal(jax.random.key(1), (1, 4, 16))
    >>> select_decode_blocks(q, s, jnp.array([500]), top_k=2).shape
    (1, 2, 4)
  """
  _check_summaries(block_summaries)
  kv_lengths = check_lengths("kv_lengths", kv_lengths, q.shape[0])
  return _decode_select(q, block_summaries, kv_lengths, top_k=top_k,
                        num_init_blocks=num_init_blocks, num_local_blocks=num_local_blocks)


def _decode_select(q, block_summaries, kv_lengths, *, top_k, num_init_blocks, num_local_blocks):
  """select_decode_blocks in XLA: scores fp32 [b, kv_heads, num_blocks], then the rules."""
  top_k = check_selection_args(block_summaries.block_size, 1, top_k, num_init_blocks,
                               num_local_blocks)
  b, hq, d = q.shape
  sums = block_summaries.sums              # [b, nb, hk, d] ("nhd") or [b, hk, nb, d] ("hnd")
  hnd = block_summaries.layout == "hnd"
  hk = sums.shape[1 if hnd else 2]
  qsum = q.astype(jnp.float32).reshape(b, hk, hq // hk, d).sum(2)          # [b, hk, d]
  # q . mean_key = (q . key_sum) / count: divide the [b, hk, nb] scores, not the sums.
  scores = jnp.einsum("bhd,bhjd->bhj" if hnd else "bhd,bjhd->bhj", qsum, sums,
                      precision=_HIGHEST)                                  # [b, hk, nb]
  scores = scores / jnp.maximum(block_summaries.counts(), 1)[:, None, :].astype(jnp.float32)
  return _decode_select_from_scores(scores, kv_lengths, block_size=block_summaries.block_size,
                                    top_k=top_k, num_init_blocks=num_init_blocks,
                                    num_local_blocks=num_local_blocks)


def _decode_select_from_scores(scores, kv_lengths, *, block_size, top_k, num_init_blocks,
                               num_local_blocks):
  """The decode selection rules applied to given scores [b, hk, nb] (XLA, lax.top_k)."""
  b, hk, nb = scores.shape
  lengths = jnp.minimum(jnp.asarray(kv_lengths, jnp.int32), nb * block_size)
  diag = jnp.where(lengths > 0, (lengths - 1) // block_size, -1)[:, None, None]   # [b, 1, 1]
  j = jnp.arange(nb)[None, None, :]
  visible = j <= diag
  forced = visible & ((j < num_init_blocks) | (j > diag - num_local_blocks))
  cand = jnp.broadcast_to(visible & ~forced, (b, hk, nb))
  ni, nl = min(num_init_blocks, nb), min(num_local_blocks, nb)
  is_local = jnp.arange(ni + nl) >= ni        # forced slots: ni initial, then nl local blocks
  fidx = jnp.concatenate([jnp.arange(ni), jnp.arange(1 - nl, 1)])
  fidx = jnp.where(is_local, fidx + diag, fidx)                            # [b, 1, ni + nl]
  ok = (fidx >= 0) & (fidx <= diag) & ~(is_local & (fidx < num_init_blocks))  # listed once
  fidx = jnp.broadcast_to(jnp.where(ok, fidx, -1), (b, hk, ni + nl))
  k_eff, limit = top_k_cut(top_k, nb, diag[..., 0] + 1, jnp.sum(forced, -1))      # limit [b, 1]
  if not (ni + nl or k_eff):
    return jnp.full((b, hk, 1), -1, jnp.int32)
  return _selected_lists_by_sort(scores, cand, fidx, None, k=k_eff, limit=limit,
                                 max_sel=decode_width(nb, top_k, num_init_blocks, num_local_blocks))


def _sparse_decode_xla(q, k, v, kv_lengths, indices, page_table, block_size, scale, m_hat=None):
  """Gather the selected blocks of each kv head (no copy of the whole cache), one softmax.
  With ``m_hat`` [b, hq]: the unified-max partial (acc, l, mx), each [b, 1, hq, ...]."""
  b, hq, d = q.shape
  hk, ms, bs, dv = k.shape[2], indices.shape[-1], block_size, v.shape[-1]
  g = hq // hk
  safe = jnp.maximum(indices, 0)                                           # [b, hk, ms]
  bi, hi = jnp.arange(b)[:, None, None], jnp.arange(hk)[None, :, None]
  if page_table is None:
    n, nb = k.shape[1], cdiv(k.shape[1], bs)
    blocks = lambda x: pad_axis(x, 1, nb * bs).reshape(b, nb, bs, hk, x.shape[-1])[bi, safe, :, hi]
    kg, vg = blocks(k), blocks(v)                                          # [b, hk, ms, bs, d]
  else:
    n = page_table.shape[1] * bs
    page = jnp.clip(jnp.take_along_axis(page_table[:, None, :], safe, axis=2), 0, k.shape[0] - 1)
    kg, vg = k[page, :, hi], v[page, :, hi]                                # [b, hk, ms, bs, d]
  s = jnp.einsum("bhgd,bhmkd->bhgmk", q.reshape(b, hk, g, d), kg,
                 preferred_element_type=jnp.float32) * scale
  k_pos = safe[..., None] * bs + jnp.arange(bs)
  lengths = jnp.minimum(jnp.asarray(kv_lengths, jnp.int32), n)
  mask = (indices[..., None] >= 0) & (k_pos < lengths[:, None, None, None])  # [b, hk, ms, bs]
  s = jnp.where(mask[:, :, None], s, -jnp.inf).reshape(b, hk, g, ms * bs)
  # Masked rows may come from unused slots or garbage table entries (e.g. a length-0 row's
  # pages): zero them, since p = 0 times a NaN there would still poison the output.
  vg = jnp.where(mask[..., None], vg, jnp.zeros((), vg.dtype)).reshape(b, hk, ms * bs, dv)
  mx = jnp.max(s, -1, keepdims=True)
  m = (jax.lax.stop_gradient(jnp.where(jnp.isfinite(mx), mx, 0.0)) if m_hat is None
       else m_hat.reshape(b, hk, g, 1))
  p = jnp.where(jnp.isneginf(s), 0.0, jnp.exp(s - m))
  l = jnp.sum(p, -1, keepdims=True)
  pv = lambda w: jnp.einsum("bhgk,bhkd->bhgd", w.astype(vg.dtype), vg,
                            preferred_element_type=jnp.float32)                 # [b, hk, g, dv]
  if m_hat is not None:
    return pv(p).reshape(b, 1, hq, dv), l.reshape(b, 1, hq), mx.reshape(b, 1, hq)
  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  lse = jnp.where(empty, -jnp.inf, m + jnp.log(l_safe))[..., 0]
  return pv(p / l_safe).reshape(b, hq, dv).astype(q.dtype), lse.reshape(b, hq)


@dataclasses.dataclass(frozen=True)
class SparseDecodeConfig:
  """The resolved Triton sparse decode config (``Plan.config`` of :func:`sparse_decode_plan`).

  Attributes:
    num_splits: splits of each (sequence, kv head)'s kept-block list.
    fused_select, score_splits: block scores and selection in one launch instead of two, with
      that many score programs per (sequence, kv head).
    blocks_per_step: kept blocks per attention loop step (1, or 2 with ``prefetch_ids``).
    prefetch_ids: each attention split loads its block ids once, before its loop.
    merge_kernel: the splits are merged by a second kernel instead of by the last split.

  Example:
    >>> SparseDecodeConfig(num_splits=33).fused_select
    False
  """
  num_splits: int
  fused_select: bool = False
  score_splits: int | None = None
  blocks_per_step: int = 1
  prefetch_ids: bool = False
  merge_kernel: bool = False


def _hnd_triton_num_splits(sequences, width, *, core_count=None, min_blocks_per_split=4):
  """Head-major Triton splits: one program per multiprocessor when that gives >= 8 splits,
  else ``pallas_kernels.sparse.decode.default_num_splits``."""
  cores = compat.gpu_core_count() if core_count is None else int(core_count)
  one_wave = min(cores // max(1, sequences), -(-int(width) // min_blocks_per_split))
  return int(one_wave) if one_wave >= 8 else default_num_splits(
      sequences, 1, width, core_count=cores, min_blocks_per_split=min_blocks_per_split)


def sparse_decode_plan(q, k_cache, v_cache, kv_lengths=None, block_summaries=None, *,
                       block_size=None, top_k, num_init_blocks=1, num_local_blocks=1,
                       page_table=None, kv_layout="nhd", scale=None, return_lse=False,
                       return_indices=False, implementation=None, interpret=False,
                       num_splits=None, softmax="exact", max_estimate=None):
  """What :func:`sparse_decode_attention` (or, with ``page_table``,
  :func:`sparse_paged_decode_attention`) runs: the implementation (a fractional ``top_k`` never
  runs "triton") and, for "triton", a :class:`SparseDecodeConfig` from ``num_splits`` or the
  heuristics ("hnd" fuses scores and selection into one launch).

  Args:
    q, k_cache, v_cache: as in the call (page pools with ``page_table``), or
      ``jax.ShapeDtypeStruct`` of them.
    kv_lengths, block_summaries: optional, as in the call (no effect on the plan).
    block_size: positions per block; with ``page_table``, the page size (the default).
    top_k, num_init_blocks, num_local_blocks, page_table, kv_layout, scale, return_lse,
      return_indices, implementation, interpret, num_splits, max_estimate: as in the call.
    softmax: "exact" or "unified_max" (with "triton": this config's split attention kernel
      and a sum merge in place of the merging last split).

  Returns:
    A ``jattn._plan.Plan`` (op "sparse_decode") with a :class:`SparseDecodeConfig` or None.

  Example:
    >>> q = jnp.zeros((1, 8, 64)); k = jnp.zeros((1, 1024, 2, 64))
    >>> p = sparse_decode_plan(q, k, k, block_size=64, top_k=2, implementation="xla")
    >>> p.op, p.implementation, p.config
    ('sparse_decode', 'xla', None)
  """
  del kv_lengths, block_summaries
  _check_kv_layout(kv_layout)
  check_serving_args(q, softmax, max_estimate, None, None, None, None)
  check_scale_and_cap(scale)
  check_flags(return_lse=return_lse, return_indices=return_indices, interpret=interpret)
  if page_table is not None:
    page_size = k_cache.shape[2 if kv_layout == "hnd" else 1]
    if block_size not in (None, page_size):
      raise ValueError(f"block_size must be the page size {page_size} for a paged cache, got "
                       f"{block_size}")
    block_size = page_size
  top_k = check_selection_args(block_size, 1, top_k, num_init_blocks, num_local_blocks)
  if page_table is not None and kv_layout == "hnd":   # the one-head "nhd" call it runs
    (b, hq, d), (p, hk, ps, _) = q.shape, k_cache.shape
    sds = jax.ShapeDtypeStruct
    return sparse_decode_plan(
        sds((b * hk, hq // hk, d), q.dtype), sds((p * hk, ps, 1, d), k_cache.dtype),
        sds((p * hk, ps, 1, v_cache.shape[-1]), v_cache.dtype), top_k=top_k,
        num_init_blocks=num_init_blocks, num_local_blocks=num_local_blocks,
        page_table=sds((b * hk, page_table.shape[1]), jnp.int32),
        implementation=implementation, num_splits=num_splits)
  impl = resolve_decode_implementation(implementation)
  if isinstance(top_k, float) and impl == "triton":   # the Triton selection takes an int top_k
    if implementation is not None:
      raise ValueError(f"a fractional top_k ({top_k}) selects in XLA: implementation must be "
                       f"None, 'xla' or 'mosaic_tpu', got {implementation!r}")
    impl = "xla"
  if num_splits is not None:
    check_int("num_splits", num_splits)
  if impl == "mosaic_tpu" and num_splits not in (None, 1):
    raise ValueError(f"num_splits applies to the Triton kernel only (the Mosaic TPU kernel "
                     f"walks each kv head's kept blocks in one pass), got {num_splits}")
  config = None
  if impl == "triton":   # a head-major cache here is contiguous (paged "hnd" returned above)
    hnd = kv_layout == "hnd"
    seqs = k_cache.shape[0] * k_cache.shape[1] if hnd else q.shape[0]
    nb = (cdiv(k_cache.shape[2 if hnd else 1], block_size) if page_table is None
          else page_table.shape[1])
    width = decode_width(nb, top_k, num_init_blocks, num_local_blocks)
    if hnd:   # ids prefetched; on sm9x, 2 blocks a step and a merge kernel if 3 stages fit
      cc = compat.gpu_compute_capability()
      row_bytes = sum(x.shape[-1] * jnp.dtype(x.dtype).itemsize for x in (k_cache, v_cache))
      two = cc is not None and cc[0] == 9 and 3 * 2 * block_size * row_bytes <= 200 * 1024
      config = SparseDecodeConfig(
          num_splits=int(num_splits or _hnd_triton_num_splits(seqs, width)), fused_select=True,
          score_splits=default_score_splits(seqs, 1, nb), blocks_per_step=2 if two else 1,
          prefetch_ids=True, merge_kernel=two)
    else:
      config = SparseDecodeConfig(
          num_splits=int(num_splits or default_num_splits(seqs, k_cache.shape[2], width)))
  return Plan(op="sparse_decode", implementation=impl, config=config,
              device_kind=jax.devices()[0].device_kind)


def _attend(q, k, v, kv_lengths, summaries, page_table, *, plan, block_size, sel, scale,
            interpret, lengths_group=1, softmax="exact", max_estimate=None):
  """Selection and attention of an "nhd" (or paged) call by ``plan``: (out, lse, indices);
  ``lengths_group``: one length per that many consecutive sequences ("triton", head-major)."""
  sel = dict(sel)
  if softmax == "unified_max" and max_estimate is None:
    per_seq = jnp.repeat(jnp.asarray(kv_lengths, jnp.int32), lengths_group)
    max_estimate = newest_key_logits(q, k, per_seq, page_table=page_table, scale=scale)
  if plan.implementation in ("xla", "mosaic_tpu"):   # selection in XLA (ascending, -1 padded)
    indices = _decode_select(q, summaries, kv_lengths, **sel)
    if plan.implementation == "mosaic_tpu":   # the kernel DMAs only the kept blocks
      from pallas_kernels.sparse.decode_tpu import sparse_decode as tpu_sparse_decode
      return (*tpu_sparse_decode(q, k, v, jnp.asarray(kv_lengths, jnp.int32), indices,
                                 page_table=page_table, block_size=block_size,
                                 scale=float(scale), interpret=interpret), indices)
    attend = functools.partial(_sparse_decode_xla, q, k, v, kv_lengths, indices, page_table,
                               block_size, scale)
    if softmax == "exact":
      return (*attend(), indices)

    def partials(m_hat=None, active=None):   # one partial: the plain sum is the partial itself
      del active                    # the recompute runs every row (one partial per row)
      if m_hat is not None:
        return attend(m_hat)
      o, l = attend()
      return o[:, None].astype(jnp.float32), l[:, None]
    merge = "xla"
  else:   # "triton", no XLA glue: scores and selection (a threshold search, no sort: ascending
    # lists, counts, zeroed arrival counters) in one launch or two, then the split-KV attention.
    from pallas_kernels.sparse.decode import sparse_decode, sparse_decode_partials
    from pallas_kernels.sparse.decode_select import (decode_block_scores,
                                                     score_select_decode_slots, select_decode_slots)
    cfg = plan.config
    lengths = jnp.asarray(kv_lengths, jnp.int32)
    width = decode_width(summaries.num_blocks, **sel)
    common = dict(block_size=block_size, interpret=interpret, lengths_group=lengths_group)
    if cfg.fused_select:
      indices, counts, arrivals = score_select_decode_slots(
          q, summaries.sums, summaries.lengths, lengths, max_selected=width,
          score_splits=cfg.score_splits, return_arrivals=True, **sel, **common)
    else:
      scores = decode_block_scores(q, summaries.sums, summaries.lengths, **common)
      indices, counts, arrivals = select_decode_slots(scores, lengths, max_selected=width,
                                                      return_arrivals=True, **sel, **common)
    split = dict(num_splits=cfg.num_splits, scale=float(scale),
                 blocks_per_step=cfg.blocks_per_step, prefetch_ids=cfg.prefetch_ids, **common)
    if softmax == "exact":
      return (*sparse_decode(q, k, v, lengths, indices, page_table, counts, arrivals,
                             out_dtype=q.dtype, merge_kernel=cfg.merge_kernel, **split), indices)
    partials = functools.partial(sparse_decode_partials, q, k, v, lengths, indices, page_table,
                                 counts, **split)   # split partials against one estimate
    merge = "pallas"
  # "unified_max": partials merged by a plain sum, flagged rows recomputed exactly
  out, lse = run_decode(partials, q, k.shape[2], max_estimate, None, softmax=softmax, merge=merge,
                        interpret=interpret)
  return out, lse, indices


@functools.partial(jax.jit, static_argnames=("plan", "block_size", "sel", "scale", "interpret",
                                             "softmax"))
def _hnd_attend(q, k, v, kv_lengths, block_summaries, page_table=None, max_estimate=None, *,
                plan, block_size, sel, scale, interpret, softmax="exact"):
  """Head-major cache or pages: the "nhd" path on batch * kv_heads sequences of one kv head
  (jitted, so the reshapes of ``jattn._layout`` are bitcasts), results reshaped back."""
  b, hk, d = q.shape[0], k.shape[1], k.shape[-1]
  if page_table is not None:
    q2, k2, v2, page_table, lengths = hnd_pages_as_sequences(q, k, v, page_table, kv_lengths)
  else:
    q2, k2, v2, lengths = _hnd_as_sequences(q, k, v, jnp.asarray(kv_lengths, jnp.int32))
  triton = plan.implementation == "triton" and page_table is None
  if triton:       # lengths [b], read by sequence b * hk + h at b (no repeat)
    lengths, summary_lengths = jnp.asarray(kv_lengths, jnp.int32), block_summaries.lengths
  else:
    summary_lengths = jnp.repeat(block_summaries.lengths, hk)
  summ = BlockSummaries(sums=block_summaries.sums.reshape(b * hk, block_summaries.num_blocks, 1, d),
                        lengths=summary_lengths, block_size=block_summaries.block_size)
  out, lse, idx = _attend(
      q2, k2, v2, lengths, summ, page_table, plan=plan, block_size=block_size, sel=sel,
      scale=scale, interpret=interpret, lengths_group=hk if triton else 1, softmax=softmax,
      max_estimate=None if max_estimate is None else max_estimate.reshape(q2.shape[:2]))
  return (out.reshape(b, q.shape[1], out.shape[-1]), lse.reshape(b, q.shape[1]),
          idx.reshape(b, hk, idx.shape[-1]))


def _sparse_decode(q, k, v, kv_lengths, block_summaries, page_table, *, block_size, **opts):
  """Body of both public ops; ``opts``: all the other keywords of :func:`sparse_decode_plan`."""
  kv_layout, softmax, max_estimate, interpret, return_lse, return_indices = (opts[n] for n in (
      "kv_layout", "softmax", "max_estimate", "interpret", "return_lse", "return_indices"))
  _check_kv_layout(kv_layout)
  _check_summaries(block_summaries)
  if block_summaries.layout != kv_layout:
    raise ValueError(f"block_summaries.layout={block_summaries.layout!r} != "
                     f"kv_layout={kv_layout!r}: make the summaries with "
                     f"init_block_summaries(..., kv_layout={kv_layout!r})")
  kv_lengths, page_table, b, hk, _ = check_decode_call(q, k, v, kv_lengths, page_table,
                                                       kv_layout, min_page_size=1)
  hnd = kv_layout == "hnd"
  block_size = k.shape[2 if hnd else 1] if block_size is None else block_size
  if block_summaries.block_size != block_size:
    raise ValueError(f"block_summaries.block_size={block_summaries.block_size} != "
                     f"block_size={block_size}")
  plan = sparse_decode_plan(q, k, v, block_size=block_size, page_table=page_table, **opts)
  if softmax != "exact" and plan.implementation == "mosaic_tpu":
    raise NotImplementedError("softmax='unified_max' runs on 'xla' and 'triton'; the Mosaic "
                              "TPU sparse kernel runs the exact softmax")
  nb = cdiv(k.shape[2 if hnd else 1], block_size) if page_table is None else page_table.shape[1]
  want = (b, hk, nb, k.shape[-1]) if hnd else (b, nb, hk, k.shape[-1])
  if block_summaries.sums.shape != want:
    raise ValueError(f"block_summaries.sums must be {want} for this {kv_layout!r} cache "
                     f"{k.shape}, got {block_summaries.sums.shape}")
  scale, _ = check_scale_and_cap(opts["scale"], head_dim=q.shape[-1])
  sel = tuple((n, opts[n]) for n in ("top_k", "num_init_blocks", "num_local_blocks"))
  out, lse, indices = (_hnd_attend if hnd else _attend)(
      q, k, v, kv_lengths, block_summaries, page_table, plan=plan, block_size=block_size,
      sel=sel, scale=scale, interpret=interpret, softmax=softmax, max_estimate=max_estimate)
  res = (out,) + ((lse,) if return_lse else ()) + ((indices,) if return_indices else ())
  return res[0] if len(res) == 1 else res


def sparse_decode_attention(q, k_cache, v_cache, kv_lengths, block_summaries, *, block_size,
                            top_k, num_init_blocks=1, num_local_blocks=1, scale=None,
                            return_lse=False, return_indices=False, implementation=None,
                            interpret=False, num_splits=None, kv_layout="nhd", softmax="exact",
                            max_estimate=None):
  """Decode attention of one new token per sequence over the top-K blocks of a contiguous cache:
  :func:`select_decode_blocks` (per kv head), then attention to the kept blocks' positions
  < kv_lengths. Implementations (docs/sparse.md): "xla" gathers the kept blocks; "triton"
  (block_size a power of two >= 16) and "mosaic_tpu" (block_size a multiple of 8 rows, 16 for
  16-bit caches) run the kernels of ``pallas_kernels.sparse``; None picks "triton" on GPU,
  "mosaic_tpu" on TPU, "xla" elsewhere.

  Args:
    q: [batch, q_heads, head_dim]: the new token's queries (at position kv_lengths - 1).
    k_cache, v_cache: [batch, max_len, kv_heads, head_dim | head_dim_v] ("nhd"), or head-major
      [batch, kv_heads, max_len, ...] ("hnd": run as batch * kv_heads one-head sequences, the
      same result), holding the new token.
    kv_lengths: int [batch]: valid positions per sequence, including the new token.
    block_summaries, block_size: :class:`BlockSummaries` with this block size (positions per
      block) and layout.
    top_k, num_init_blocks, num_local_blocks: selection sizes (as in :func:`select_blocks`).
    scale: logit scale, default 1/sqrt(head_dim).
    return_lse, return_indices: also return lse [batch, q_heads] (fp32, natural log, -inf if
      empty) / the kept block ids [batch, kv_heads, max_selected] (-1 padded).
    implementation, interpret: None, "xla", "triton" or "mosaic_tpu"; Pallas interpret mode.
    num_splits: Triton splits per (batch, kv head); default from :func:`sparse_decode_plan`.
    kv_layout: "nhd" (default) or "hnd".
    softmax: "exact" or "unified_max" ("xla", "triton"): partial softmaxes against one estimate
      per (row, head), merged by a plain sum, overshooting rows recomputed exactly
      (``jattn.decode_serving``).
    max_estimate: None (the newest key's logit) or fp32 [batch, q_heads], for "unified_max".

  Returns:
    out [batch, q_heads, head_dim_v] in q.dtype; then lse and/or indices if requested.

  Example:
    >>> k = jax.random.normal(jax.random.key(0), (1, 512, 2, 16)); lens = jnp.array([300])
    >>> s = init_block_summaries(k, lens, block_size=64)
    >>> q = jax.random.normal(jax.random.key(1), (1, 4, 16))
    >>> out = sparse_decode_attention(q, k, k, lens, s, block_size=64, top_k=1,
    ...                               implementation="xla")
    >>> out.shape
    (1, 4, 16)
  """
  return _sparse_decode(q, k_cache, v_cache, kv_lengths, block_summaries, None,
                        block_size=block_size, top_k=top_k, num_init_blocks=num_init_blocks,
                        num_local_blocks=num_local_blocks, scale=scale, return_lse=return_lse,
                        return_indices=return_indices, implementation=implementation,
                        interpret=interpret, num_splits=num_splits, kv_layout=kv_layout,
                        softmax=softmax, max_estimate=max_estimate)


def sparse_paged_decode_attention(q, k_pages, v_pages, page_table, kv_lengths, block_summaries, *,
                                  top_k, num_init_blocks=1, num_local_blocks=1, scale=None,
                                  return_lse=False, return_indices=False, implementation=None,
                                  interpret=False, num_splits=None, kv_layout="nhd",
                                  softmax="exact", max_estimate=None):
  """:func:`sparse_decode_attention` over a paged cache; blocks are pages (block = page size).

  Args:
    q: [batch, q_heads, head_dim].
    k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim | head_dim_v] ("nhd") or
      [num_pages, kv_heads, page_size, head_dim | head_dim_v] ("hnd").
    page_table: int32 [batch, max_pages]: token t of sequence b is in page
      ``page_table[b, t // page_size]``, slot ``t % page_size``.
    kv_lengths: int [batch], including the new token, in [0, max_pages * page_size].
    block_summaries: :class:`BlockSummaries` with block_size == page_size, layout ``kv_layout``.
    top_k, num_init_blocks, num_local_blocks, scale, return_lse, return_indices, implementation,
      interpret, num_splits, kv_layout, softmax, max_estimate: as :func:`sparse_decode_attention`.

  Returns:
    out [batch, q_heads, head_dim_v] in q.dtype; then lse and/or indices if requested.

  Example:
    >>> pages = jax.random.normal(jax.random.key(0), (6, 16, 1, 8))
    >>> pt = jnp.array([[4, 0, 2]], jnp.int32); lens = jnp.array([40])
    >>> s = init_block_summaries(pages, lens, block_size=16, page_table=pt)
    >>> q = jax.random.normal(jax.random.key(1), (1, 2, 8))
    >>> sparse_paged_decode_attention(q, pages, pages, pt, lens, s, top_k=1,
    ...                               implementation="xla").shape
    (1, 2, 8)
  """
  return _sparse_decode(q, k_pages, v_pages, kv_lengths, block_summaries,
                        as_array("page_table", page_table), block_size=None, top_k=top_k,
                        num_init_blocks=num_init_blocks, num_local_blocks=num_local_blocks,
                        scale=scale, return_lse=return_lse, return_indices=return_indices,
                        implementation=implementation, interpret=interpret,
                        num_splits=num_splits, kv_layout=kv_layout, softmax=softmax,
                        max_estimate=max_estimate)


