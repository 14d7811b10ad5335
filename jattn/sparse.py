"""Training-time block-sparse attention: block scores, top-K selection, gate gradients, decode.

The pieces (see docs/sparse.md for the formulas):

* :func:`block_scores` / :func:`select_blocks` -> :class:`BlockSelection`: for every query block
  and kv head, the key blocks to attend to (InfLLM v2 / MoBA / NSA style: mean-pooled scores,
  always-kept initial and local blocks, GQA-shared top-k).
* :func:`block_sparse_attention`: attention restricted to a selection ("xla" reference, or the
  Pallas flash kernels walking ``make_schedule(..., block_mask=selection.tile_mask())``).
* :func:`sparse_attention`: selection plus attention in one call for training, with the gate
  gradient modes "none", "ste" and "gumbel".
* :func:`captured_mass`: the fraction of full-softmax attention probability inside the kept blocks.
* Sparse decode: :class:`BlockSummaries` (running key sums per cache block, O(1) per appended
  token), :func:`select_decode_blocks`, :func:`sparse_decode_attention` (contiguous cache) and
  :func:`sparse_paged_decode_attention` (paged cache); "xla", the Triton kernels in
  ``pallas_kernels/sparse/decode.py`` (GPU default) or the Mosaic TPU kernel in
  ``pallas_kernels/sparse/decode_tpu.py`` (TPU default). A contiguous cache may also be
  head-major (``kv_layout="hnd"``: [batch, kv_heads, len, head_dim]).
* :func:`bench_cases`: the H200 benchmark rows (``experiments/bench_kernels.py --ops sparse``).

Conventions: layout [batch, seq, heads, head_dim]; GQA query head h reads kv head
h // (q_heads // kv_heads); blocks are counted from position 0 (query block i holds queries
i*q_block_size .. (i+1)*q_block_size-1; key block j holds keys j*block_size ..); causal masks align
bottom-right (query i sits at kv_len - q_len + i). Segment ids: 0 is padding (sees and is seen by
nothing); every other id, negative ones included, is a document.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jattn import _validate
from jattn._layout import KV_LAYOUTS as _KV_LAYOUTS
from jattn._layout import check_kv_layout as _check_kv_layout
from jattn._layout import hnd_as_sequences as _hnd_as_sequences
from jattn.attention import (_MOSAIC_GPU_BWD_HEAD_DIMS, _hopper_default_covers, kernel_module,
                             resolve_implementation)
from pallas_kernels import compat
from pallas_kernels.block_schedule import compact_true, make_schedule
from pallas_kernels.sparse import topk as _topk
from pallas_kernels.flash.reference import attention_reference
from pallas_kernels.masks import element_mask

__all__ = [
    "BlockSelection", "block_scores", "select_blocks", "block_sparse_attention",
    "block_sparse_plan", "sparse_attention", "captured_mass", "block_attention_mass", "block_score_kl",
    "BlockSummaries", "init_block_summaries",
    "update_block_summaries", "select_decode_blocks", "sparse_decode_attention",
    "sparse_paged_decode_attention",
    "causal_top_k_for_density", "bench_cases",
]

_HIGHEST = jax.lax.Precision.HIGHEST
_GATE_MODES = ("none", "ste", "gumbel")
_QUERY_POOLS = ("sum", "max")
_INT_MAX = np.iinfo(np.int32).max
_INT_MIN = np.iinfo(np.int32).min


def _cdiv(a, b):
  return -(-a // b)


# ----------------------------------------------------------------------------- BlockSelection
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockSelection:
  """The key blocks kept for every (batch, kv head, query block): a top-K block-sparse mask.

  Attributes:
    indices: int32 [batch, kv_heads, num_q_blocks, max_selected]: kept key-block ids in increasing
      order, then -1 (the sentinel) for unused slots.
    counts: int32 [batch, kv_heads, num_q_blocks]: number of kept blocks (valid entries).
    num_visible: int32 [batch, kv_heads or 1, num_q_blocks]: number of selectable blocks (causally
      visible and, with segment ids, overlapping the query block's documents).
    scores: None or fp32 [batch, kv_heads, num_q_blocks, num_kv_blocks]: the block scores the
      selection ranked (``block_scores``), for inspection.
    block_size: keys per key block (static).
    q_block_size: queries per query block (static).
    q_len, kv_len: the sequence lengths the selection was made for (static).

  Example:
    >>> q = jax.random.normal(jax.random.key(0), (1, 64, 2, 16))
    >>> sel = select_blocks(q, q, block_size=16, q_block_size=16, top_k=1)
    >>> sel.counts.shape  # [batch, kv_heads, num_q_blocks]
    (1, 2, 4)
  """
  indices: jax.Array
  counts: jax.Array
  num_visible: jax.Array
  scores: jax.Array | None
  block_size: int = dataclasses.field(metadata=dict(static=True))
  q_block_size: int = dataclasses.field(metadata=dict(static=True))
  q_len: int = dataclasses.field(metadata=dict(static=True))
  kv_len: int = dataclasses.field(metadata=dict(static=True))

  @property
  def num_q_blocks(self) -> int:
    return _cdiv(self.q_len, self.q_block_size)

  @property
  def num_kv_blocks(self) -> int:
    return _cdiv(self.kv_len, self.block_size)

  @property
  def max_selected(self) -> int:
    return self.indices.shape[-1]

  def tile_mask(self):
    """Tile-level mask of the selection, the ``block_mask`` of ``make_schedule``.

    Returns:
      bool [batch, kv_heads, num_q_blocks, num_kv_blocks], True for kept (query, key) blocks.

    Example:
      >>> q = jax.random.normal(jax.random.key(0), (1, 256, 2, 16))
      >>> sel = select_blocks(q, q, block_size=64, q_block_size=64, top_k=1)
      >>> sel.tile_mask().shape
      (1, 2, 4, 4)
    """
    b, h, nq, _ = self.indices.shape
    nk = self.num_kv_blocks
    cols = jnp.where(self.indices < 0, nk, self.indices)              # sentinel -> spare column
    mask = jnp.zeros((b, h, nq, nk + 1), bool)
    bi = jnp.arange(b)[:, None, None, None]
    hi = jnp.arange(h)[None, :, None, None]
    qi = jnp.arange(nq)[None, None, :, None]
    return mask.at[bi, hi, qi, cols].set(True)[..., :nk]

  def to_mask(self, q_len=None, kv_len=None):
    """Element-level expansion of the block mask (no causal or segment mask applied).

    Args:
      q_len, kv_len: default to the lengths the selection was made for; if given they must be
        equal to them.

    Returns:
      bool [batch, kv_heads, q_len, kv_len]: True where key j's block is kept for query i's block.
      The attention op applies the element-level causal and segment masks on top.

    Example:
      >>> q = jax.random.normal(jax.random.key(0), (1, 100, 2, 16))
      >>> sel = select_blocks(q, q, block_size=32, q_block_size=16, top_k=1)
      >>> sel.to_mask(100, 100).shape
      (1, 2, 100, 100)
    """
    q_len = self.q_len if q_len is None else int(q_len)
    kv_len = self.kv_len if kv_len is None else int(kv_len)
    if (q_len, kv_len) != (self.q_len, self.kv_len):
      raise ValueError(f"selection was made for (q_len, kv_len) = {(self.q_len, self.kv_len)}, "
                       f"got {(q_len, kv_len)}")
    m = self.tile_mask()
    m = jnp.repeat(m, self.q_block_size, axis=2)[:, :, :q_len]
    return jnp.repeat(m, self.block_size, axis=3)[..., :kv_len]

  def density(self, relative_to="all"):
    """Fraction of blocks kept, averaged over batch, kv heads and query blocks.

    Args:
      relative_to: "all" (kept / num_kv_blocks per query block: the fraction of the full tile
        grid) or "visible" (kept / selectable blocks, e.g. the fraction of causal blocks).

    Returns:
      fp32 scalar.

    Example:
      >>> q = jax.random.normal(jax.random.key(0), (1, 256, 1, 16))
      >>> float(select_blocks(q, q, block_size=64, top_k=0, num_local_blocks=1,
      ...                     num_init_blocks=0).density())
      0.25
    """
    kept = jnp.sum(self.counts.astype(jnp.float32))
    if relative_to == "all":
      return kept / (self.counts.size * self.num_kv_blocks)
    if relative_to == "visible":
      vis = jnp.broadcast_to(self.num_visible, self.counts.shape)
      return kept / jnp.maximum(jnp.sum(vis.astype(jnp.float32)), 1.0)
    raise ValueError(f"relative_to must be 'all' or 'visible', got {relative_to!r}")


# ----------------------------------------------------------------------------- scoring
def _block_mean(x, valid, block):
  """Mean of x [b, n, h, d] over blocks of the sequence axis, over ``valid`` [b, n] positions."""
  b, n, h, d = x.shape
  nb = _cdiv(n, block)
  pad = nb * block - n
  w = jnp.ones((b, n), jnp.float32) if valid is None else valid.astype(jnp.float32)
  xf = x.astype(jnp.float32) * w[:, :, None, None]
  xf = jnp.pad(xf, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, nb, block, h, d)
  cnt = jnp.pad(w, ((0, 0), (0, pad))).reshape(b, nb, block).sum(-1)   # [b, nb]
  return xf.sum(2) / jnp.maximum(cnt, 1.0)[:, :, None, None]            # [b, nb, h, d]


def block_scores(q, k, *, block_size=64, q_block_size=64, segment_ids=None, kv_segment_ids=None):
  """Mean-pooled block scores (InfLLM v2 / MoBA): the ranking ``select_blocks`` uses.

  score[b, g, i, j] = sum over the query heads h of kv group g of
  mean(q[b, block i, h]) . mean(k[b, block j, g]), the means taken over the block's positions
  inside the sequence (and, with segment ids, over non-padding positions only). Unscaled.

  Args:
    q: [batch, q_len, q_heads, head_dim].
    k: [batch, kv_len, kv_heads, head_dim]; q_heads % kv_heads == 0.
    block_size: keys per key block.
    q_block_size: queries per query block (1: per token).
    segment_ids, kv_segment_ids: None or int [batch, q_len] / [batch, kv_len] (0 = padding).

  Returns:
    fp32 [batch, kv_heads, num_q_blocks, num_kv_blocks]; differentiable in q and k.

  Example:
    >>> q = jax.random.normal(jax.random.key(0), (1, 100, 4, 16))
    >>> k = jax.random.normal(jax.random.key(1), (1, 100, 2, 16))
    >>> block_scores(q, k, block_size=32, q_block_size=16).shape
    (1, 2, 7, 4)
  """
  b, _, hq, d = q.shape
  hk = k.shape[2]
  qv = None if segment_ids is None else segment_ids != 0
  kv = None if kv_segment_ids is None else kv_segment_ids != 0
  qbar = _block_mean(q, qv, q_block_size)                        # [b, nq, hq, d]
  kbar = _block_mean(k, kv, block_size)                          # [b, nk, hk, d]
  qsum = qbar.reshape(b, qbar.shape[1], hk, hq // hk, d).sum(3)  # [b, nq, hk, d]
  return jnp.einsum("bihd,bjhd->bhij", qsum, kbar, precision=_HIGHEST)


# ----------------------------------------------------------------------------- selection rules
def _row_geometry(xp, q_len, kv_len, q_block_size, block_size, num_local):
  """Per query block: last query position and the local key-block range [lo, hi] (numpy or jnp)."""
  nq = _cdiv(q_len, q_block_size)
  off = kv_len - q_len
  i = xp.arange(nq)
  q_first = i * q_block_size + off                                  # absolute positions
  q_last = xp.minimum((i + 1) * q_block_size, q_len) - 1 + off
  lo = xp.maximum(q_first, 0) // block_size - (num_local - 1)
  hi = xp.where(q_last >= 0, q_last // block_size, -1)
  return q_last, lo, hi


@functools.lru_cache(maxsize=256)
def _static_counts(q_len, kv_len, q_block_size, block_size, causal, num_init, num_local, top_k,
                   per_doc_init=False):
  """From shapes alone (numpy, O(num_q_blocks)): per-row counts and the static list widths.

  ``per_doc_init=True`` (segment ids: the initial blocks start at each document's first block,
  which the shapes do not tell) makes ``n_forced`` an upper bound: min(num_init, n_visible) plus
  every visible local block, as if none of them were initial blocks. Under ``causal`` the
  resulting ``max_selected`` is the same as without it (a local range that overlaps the initial
  blocks already covers every visible block).

  Returns (n_visible [nq], n_forced [nq], max_selected, local_width).
  """
  nk = _cdiv(kv_len, block_size)
  q_last, lo, hi = _row_geometry(np, q_len, kv_len, q_block_size, block_size, num_local)
  n_vis = np.clip(q_last // block_size + 1, 0, nk) if causal else np.full(q_last.shape, nk)
  n_forced = np.minimum(num_init, n_vis)
  width = 0
  if num_local > 0:
    lo0 = np.maximum(lo, 0)
    width = int(max(0, (hi - lo0 + 1).max()))
    first_local = lo0 if per_doc_init else np.maximum(lo, num_init)
    n_forced = n_forced + np.maximum(np.minimum(hi, n_vis - 1) - first_local + 1, 0)
    n_forced = np.minimum(n_forced, n_vis)
  k_eff = min(top_k, nk)
  max_sel = int(max(1, (n_forced + np.minimum(k_eff, n_vis - n_forced)).max()))
  return n_vis, n_forced, max_sel, width


def _structure(q_len, kv_len, q_block_size, block_size, causal, num_init, num_local):
  """jnp masks from iota (no large constants): visible, candidates [nq, nk] and the forced
  index lists [nq, init + local_width] (-1 where absent)."""
  nk = _cdiv(kv_len, block_size)
  q_last, lo, hi = _row_geometry(jnp, q_len, kv_len, q_block_size, block_size, num_local)
  j = jnp.arange(nk, dtype=jnp.int32)[None, :]
  if causal:
    visible = j * block_size <= q_last[:, None]
  else:
    visible = jnp.ones((q_last.shape[0], nk), bool)
  forced = j < num_init
  if num_local > 0:
    forced = forced | ((j >= lo[:, None]) & (j <= hi[:, None]))
  forced = forced & visible
  cand = visible & ~forced
  parts = []
  n_init = min(num_init, nk)
  if n_init:
    init = jnp.broadcast_to(jnp.arange(n_init, dtype=jnp.int32)[None, :],
                            (q_last.shape[0], n_init))
    ok = (init * block_size <= q_last[:, None]) if causal else jnp.ones_like(init, bool)
    parts.append(jnp.where(ok, init, -1))
  _, _, _, width = _static_counts(q_len, kv_len, q_block_size, block_size, causal, num_init,
                                  num_local, 0)
  if num_local > 0 and width:
    loc = jnp.maximum(lo, 0)[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
    ok = (loc <= hi[:, None]) & (loc >= num_init) & (loc < nk)
    parts.append(jnp.where(ok, loc, -1))
  if not parts:
    parts.append(jnp.full((q_last.shape[0], 1), -1, jnp.int32))
  return visible, cand, jnp.concatenate(parts, axis=1).astype(jnp.int32)


def _segment_ranges(seg, block):
  """Per-block (min nonzero id, max nonzero id) of seg [b, n] (positions past n are padding).

  Every nonzero id, negative ones included, is a document; only 0 is padding (as in
  ``masks.visible`` and ``block_schedule._segment_tile_classes``). A block without a nonzero id
  gets the empty range (INT32_MAX, INT32_MIN), so ``min <= max`` iff the block holds a document.
  """
  b, n = seg.shape
  nb = _cdiv(n, block)
  s = jnp.pad(seg.astype(jnp.int32), ((0, 0), (0, nb * block - n))).reshape(b, nb, block)
  real = s != 0
  return (jnp.min(jnp.where(real, s, _INT_MAX), -1),
          jnp.max(jnp.where(real, s, _INT_MIN), -1))


def _segment_overlap(q_seg, kv_seg, q_block_size, block_size):
  """bool [b, nq, nk]: query block i and key block j both hold a nonzero id and their nonzero id
  ranges intersect.

  Exact for packed sequences (nonzero ids non-decreasing along the sequence); for other layouts
  it may keep a block without a common id (harmless: the element mask still applies).
  """
  qmn, qmx = _segment_ranges(q_seg, q_block_size)
  kmn, kmx = _segment_ranges(kv_seg, block_size)
  qmn, qmx = qmn[:, :, None], qmx[:, :, None]
  kmn, kmx = kmn[:, None, :], kmx[:, None, :]
  return (qmn <= qmx) & (kmn <= kmx) & (qmn <= kmx) & (kmn <= qmx)


def _doc_start_blocks(q_seg, kv_seg, q_block_size, block_size):
  """int32 [b, nq]: the key block holding the first key of query block i's document.

  The document of query block i is its minimum nonzero id d (as in ``_segment_ranges``; any
  nonzero id, negative ones included). Its first key block is the first key block j whose running
  maximum nonzero id, over kv_seg[:(j+1)*bs], reaches d: a cumulative max over the per-block
  maxima (an all-padding block counts as INT32_MIN, so padding never raises it) and one binary
  search per query block, and no earlier than the first key block holding a nonzero id (matters
  only for d = INT32_MIN); nk for an all-padding query block. O(b * (nq + kv_len)) memory. For
  packed rows (nonzero ids non-decreasing, zeros anywhere) that is exactly the block of d's first
  key. For other layouts it is some block holding an id >= d, or nk (no such block); the caller
  keeps it only if it is selectable, so the rule stays safe, only less useful.
  """
  qmn, qmx = _segment_ranges(q_seg, q_block_size)                    # [b, nq]
  kmn, kmx = _segment_ranges(kv_seg, block_size)                     # [b, nk]
  nk = kmx.shape[1]
  reach = jax.lax.cummax(kmx, axis=1)                                # [b, nk], non-decreasing
  start = jax.vmap(functools.partial(jnp.searchsorted, side="left"))(reach, qmn)
  has = kmn <= kmx                                                   # [b, nk] holds a document
  first = jnp.where(jnp.any(has, axis=1), jnp.argmax(has, axis=1), nk)            # [b]
  start = jnp.maximum(start, first[:, None])
  return jnp.where(qmn <= qmx, start, nk).astype(jnp.int32)     # all-padding query block: nk


def _select(rank, *, q_len, kv_len, q_block_size, block_size, causal, num_init, num_local, top_k,
            seg_ok, scores, doc_start=None):
  """Build a BlockSelection from ranking scores rank [b, hk, nq, nk] (higher = kept first).

  seg_ok: None or bool [b, nq, nk] (``_segment_overlap``). doc_start: None (initial blocks
  0 .. num_init-1) or int32 [b, nq] (``_doc_start_blocks``: initial blocks doc_start[b, i] ..
  doc_start[b, i] + num_init - 1). Forced blocks are never candidates and an initial block
  that is also local is listed once, so the sorted lists hold no duplicates.
  """
  per_doc = doc_start is not None
  if per_doc != (seg_ok is not None):
    raise ValueError("segment ids need both seg_ok and doc_start")
  _, _, max_sel, _ = _static_counts(q_len, kv_len, q_block_size, block_size, bool(causal),
                                    num_init, num_local, top_k, per_doc_init=per_doc)
  b, hk, nq, nk = rank.shape
  rank = jax.lax.stop_gradient(rank).astype(jnp.float32)
  cand, vis, fidx = _candidates(b, hk, q_len=q_len, kv_len=kv_len, q_block_size=q_block_size,
                                block_size=block_size, causal=causal, num_init=num_init,
                                num_local=num_local, seg_ok=seg_ok, doc_start=doc_start)
  k_eff = min(top_k, nk)
  cand_b = jnp.broadcast_to(cand, (b, hk, nq, nk))
  by_sort = functools.partial(_selected_lists_by_sort, k=k_eff, max_sel=max_sel)
  if k_eff > 0 and nk <= _topk.MAX_ROW:   # GPU: the top-k as a mask by a Pallas kernel, no sort
    by_mask = functools.partial(_selected_lists_by_mask, k=k_eff, max_sel=max_sel,
                                keep_fn=_topk.top_k_mask)
    indices = jax.lax.platform_dependent(rank, cand_b, fidx, vis, cuda=by_mask,
                                         default=by_sort)
  else:
    indices = by_sort(rank, cand_b, fidx, vis)
  counts = jnp.sum(indices >= 0, axis=-1).astype(jnp.int32)
  num_visible = jnp.sum(vis, axis=-1).astype(jnp.int32)
  return BlockSelection(indices=indices, counts=counts, num_visible=num_visible, scores=scores,
                        block_size=block_size, q_block_size=q_block_size, q_len=q_len,
                        kv_len=kv_len)


def _selected_lists_by_sort(rank, cand, fidx, visible, *, k, max_sel):
  """``_select``'s lists: ``lax.top_k`` of the candidates' ranks, with the forced blocks
  ``fidx`` (-1 = none), sorted ascending, -1 past the count: int32 [b, hk, nq, max_sel].
  (``visible``: unused; ``_selected_lists_by_mask``'s signature.)"""
  del visible
  nk = rank.shape[-1]
  parts = [fidx]
  if k > 0:
    masked = jnp.where(cand, rank, -jnp.inf)
    _, tidx = jax.lax.top_k(masked, k)                                # [b, hk, nq, k]
    tvalid = jnp.take_along_axis(cand, tidx, axis=-1)
    parts.append(jnp.where(tvalid, tidx, -1).astype(jnp.int32))
  allidx = jnp.concatenate(parts, axis=-1)
  key = jnp.where(allidx < 0, nk, allidx)
  srt = jnp.sort(key, axis=-1)[..., :max_sel]
  return jnp.where(srt >= nk, -1, srt).astype(jnp.int32)


def _selected_lists_by_mask(rank, cand, fidx, visible, *, k, max_sel, keep_fn):
  """The same lists as ``_selected_lists_by_sort`` without a sort: ``keep_fn(x, k)`` (the
  mask of each row's k largest entries, ties to the lower index: ``lax.top_k``'s set; on a GPU
  ``pallas_kernels.sparse.topk.top_k_mask``) of the candidates' ranks, or-ed with the forced
  blocks, compacted in ascending order (``block_schedule.compact_true``). The forced blocks
  (``fidx``'s) are the selectable ones that are not candidates, ``visible & ~cand`` (as
  ``_candidates`` builds them), a mask XLA folds like the rest of the static structure."""
  del fidx
  keep = keep_fn(jnp.where(cand, rank, -jnp.inf), k) & cand
  order, count = compact_true(keep | (visible & ~cand), max_sel)
  slot = jnp.arange(max_sel, dtype=jnp.int32)
  return jnp.where(slot < count[..., None], order, -1).astype(jnp.int32)


def _candidates(b, hk, *, q_len, kv_len, q_block_size, block_size, causal, num_init, num_local,
                seg_ok, doc_start):
  """The block sets of ``_select``'s rules (see :func:`select_blocks`).

  Returns:
    cand: bool [b or 1, 1, nq, nk]: the blocks top-k chooses among (selectable, not forced).
    vis: bool [b or 1, 1, nq, nk]: the selectable blocks.
    fidx: int32 [b, hk, nq, width]: the forced (initial, local) blocks, -1 where absent.
  """
  per_doc = doc_start is not None
  visible, cand, forced_idx = _structure(q_len, kv_len, q_block_size, block_size, bool(causal),
                                         0 if per_doc else num_init, num_local)
  nq, nk = visible.shape
  if per_doc:
    # cand / forced_idx above hold the local blocks only; add each row's document-initial blocks.
    n_init = min(num_init, nk)
    ok = visible[None] & seg_ok                                       # [b, nq, nk] selectable
    fidx = jnp.broadcast_to(forced_idx[None], (b,) + forced_idx.shape)  # [b, nq, width]
    cand = cand[None] & seg_ok                                        # [b, nq, nk]
    if n_init:
      start = doc_start[:, :, None]                                   # [b, nq, 1]
      init = start + jnp.arange(n_init, dtype=jnp.int32)[None, None]  # [b, nq, n_init]
      fidx = jnp.where((fidx >= start) & (fidx < start + n_init), -1, fidx)   # listed as init
      fidx = jnp.concatenate([init, fidx], axis=-1)
      j = jnp.arange(nk, dtype=jnp.int32)[None, None]
      cand = cand & ~((j >= start) & (j < start + n_init))
    valid = (fidx >= 0) & (fidx < nk)
    f_ok = jnp.take_along_axis(ok, jnp.clip(fidx, 0, nk - 1), axis=-1)
    fidx = jnp.where(valid & f_ok, fidx, -1).astype(jnp.int32)
    fidx = jnp.broadcast_to(fidx[:, None], (b, hk) + fidx.shape[1:])
    cand = cand[:, None]                                              # [b, 1, nq, nk]
    vis = ok[:, None]
  else:
    cand = cand[None, None]                                           # [1, 1, nq, nk]
    vis = visible[None, None]
    fidx = jnp.broadcast_to(forced_idx[None, None], (b, hk) + forced_idx.shape)
  return cand, vis, fidx


def _check_selection_args(block_size, q_block_size, top_k, num_init_blocks, num_local_blocks):
  for name, val, lo in (("block_size", block_size, 1), ("q_block_size", q_block_size, 1),
                        ("top_k", top_k, 0), ("num_init_blocks", num_init_blocks, 0),
                        ("num_local_blocks", num_local_blocks, 0)):
    if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < lo:
      raise ValueError(f"{name} must be an int >= {lo} (static), got {val!r}")


def select_blocks(q, k, *, block_size=64, top_k, q_block_size=64, causal=True, num_init_blocks=1,
                  num_local_blocks=1, segment_ids=None, kv_segment_ids=None, score="mean_key"):
  """Top-K key-block selection per query block, shared by the query heads of each GQA group.

  Rules, for query block i (queries i*q_block_size ..) and kv head g:
    * selectable blocks: causally visible ones (the block's first key <= the block's last query
      position, bottom-right aligned) or all blocks when ``causal=False``; with segment ids only
      blocks whose documents overlap the query block's documents (``_segment_overlap``).
    * always kept (when selectable): the initial blocks and the local blocks. Initial blocks:
      without segment ids blocks 0 .. num_init_blocks-1; with segment ids the first
      num_init_blocks key blocks of the query block's document (its smallest nonzero id),
      i.e. doc_start // block_size + 0 .. num_init_blocks-1 with doc_start that document's first
      key (each packed document keeps its own attention-sink blocks; ``_doc_start_blocks``).
      Local blocks: every key block holding one of the query block's own positions (its
      diagonal block) and the num_local_blocks-1 blocks before those. A block that is both is
      kept once.
    * plus the ``top_k`` selectable blocks with the highest ``block_scores`` among the others
      (all of them when fewer are left; ties go to the lower block, as ``lax.top_k``).
  On a GPU the top-k runs as a Pallas kernel (``pallas_kernels.sparse.topk.top_k_mask``) and
  the lists are compacted without a sort; on TPU and CPU ``lax.top_k`` and a sort. The lists are
  the same.
  ``q_block_size=1`` selects per token (decode parity: see :func:`select_decode_blocks`).
  Not differentiable (the indices are integers); see :func:`sparse_attention` for gate gradients.

  Args:
    q: [batch, q_len, q_heads, head_dim].
    k: [batch, kv_len, kv_heads, head_dim]; q_heads % kv_heads == 0.
    block_size: keys per key block (static).
    top_k: number of blocks chosen by score besides the initial and local ones (static).
    q_block_size: queries per query block (static).
    causal: bottom-right aligned causal visibility.
    num_init_blocks: leading blocks always kept (of the row, or of each document with
      segment ids).
    num_local_blocks: diagonal block plus this many minus one before it always kept (0: none).
    segment_ids: None or int [batch, q_len] (0 = padding; any other id, negative ones included,
      is a document). The rules are exact for packed rows (nonzero ids non-decreasing, padding
      anywhere); other layouts never select a block outside the rules' selectable set, but may
      force a less useful "initial" block.
    kv_segment_ids: None or int [batch, kv_len]; defaults to segment_ids when q_len == kv_len.
    score: "mean_key" (the only scorer so far).

  Returns:
    A :class:`BlockSelection` with ``scores`` filled in. jit-compatible (all sizes are static).

  Example:
    >>> q = jax.random.normal(jax.random.key(0), (2, 512, 4, 32))
    >>> k = jax.random.normal(jax.random.key(1), (2, 512, 2, 32))
    >>> sel = select_blocks(q, k, block_size=64, q_block_size=64, top_k=2)
    >>> sel.indices.shape   # 1 init + 1 local + 2 chosen
    (2, 2, 8, 4)
  """
  if score != "mean_key":
    raise ValueError(f"unknown score {score!r}; supported: 'mean_key'")
  _check_selection_args(block_size, q_block_size, top_k, num_init_blocks, num_local_blocks)
  batch, q_len, kv_len, _, _ = _validate.check_qkv(q, k, k)
  segment_ids, kv_segment_ids = _validate.check_segments(segment_ids, kv_segment_ids, batch,
                                                         q_len, kv_len)
  scores = block_scores(q, k, block_size=block_size, q_block_size=q_block_size,
                        segment_ids=segment_ids, kv_segment_ids=kv_segment_ids)
  seg_ok = doc_start = None
  if segment_ids is not None:
    seg_ok = _segment_overlap(segment_ids, kv_segment_ids, q_block_size, block_size)
    doc_start = _doc_start_blocks(segment_ids, kv_segment_ids, q_block_size, block_size)
  return _select(scores, q_len=q_len, kv_len=kv_len, q_block_size=int(q_block_size),
                 block_size=int(block_size), causal=causal, num_init=int(num_init_blocks),
                 num_local=int(num_local_blocks), top_k=int(top_k), seg_ok=seg_ok,
                 scores=jax.lax.stop_gradient(scores), doc_start=doc_start)


# ----------------------------------------------------------------------------- attention
def _check_selection(selection, batch, q_len, kv_len, kv_heads):
  if not isinstance(selection, BlockSelection):
    raise TypeError(f"selection must be a BlockSelection, got {type(selection).__name__}")
  if (selection.q_len, selection.kv_len) != (q_len, kv_len):
    raise ValueError(f"selection was made for (q_len, kv_len) = "
                     f"{(selection.q_len, selection.kv_len)}, inputs have {(q_len, kv_len)}")
  want = (batch, kv_heads, selection.num_q_blocks)
  if selection.indices.shape[:3] != want:
    raise ValueError(f"selection.indices must be [batch, kv_heads, num_q_blocks, n] = {want} + "
                     f"(n,), got {selection.indices.shape}")


def _mosaic_gpu_block_sizes(mod, selection, head_dim, dtype, *, causal=True, segments=False):
  """(Mosaic GPU forward BlockSizes, backward BlockSizes or None) for a selection, or a clear
  ValueError naming the allowed block sizes.

  The Hopper forward walks the selection's schedule with its own tiles: 64 query rows per
  warpgroup (two per program) and ``min(block_k, 128, block_size)`` keys of the device table's
  entry for the mask kind (``tuning.mask_kind(causal, None, segments)``; on the H200 at D128 and
  D256 FlashAttention-3's intra-warpgroup overlap, 5% faster on the 64K block-sparse forward,
  run 64), so every kernel tile lies inside one selection block (the walk's tiles have run on a
  GPU at 64 and 128 keys, hence the cap). The backward walks the same schedule: at head_dim 64
  and 128 the Mosaic GPU backward (``backward="mosaic"``, None here: its default tiles cut to
  fit the selection's blocks, ``mosaic_gpu_bwd.fit_block_sizes``), at head_dim 256 the Triton
  one at the selection's tiles, with the launch the "triton" implementation uses for them.
  Hence q_block_size and block_size must be powers of two >= 64.
  """
  from pallas_kernels.flash import triton as ft
  from pallas_kernels.tuning import mask_kind
  base = mod.default_block_sizes(head_dim, dtype,    # NotImplementedError: head dim, dtype
                                 mask=mask_kind(causal, None, segments=segments))
  qbs, bs = selection.q_block_size, selection.block_size
  bad = [f"{n}={x}" for n, x in (("q_block_size", qbs), ("block_size", bs))
         if x < 64 or x & (x - 1)]
  if bad:
    raise ValueError(
        f"implementation='mosaic_gpu' needs q_block_size and block_size powers of two >= 64 "
        f"(allowed: 64, 128, 256, ...: the Hopper forward's tiles are {base.block_q} query rows "
        f"per warpgroup and 64 or {base.block_k} keys, the Triton backward's powers of two), "
        f"got {', '.join(bad)}; select blocks with such sizes (e.g. q_block_size=128, "
        f"block_size=64) or use implementation='triton' or 'xla'")
  fwd = dataclasses.replace(base, block_k=min(base.block_k, 128, bs),
                            tail_kv_splits=0)     # a schedule's walk: no key-chunk tail launch
  if head_dim in _MOSAIC_GPU_BWD_HEAD_DIMS:
    return dataclasses.replace(fwd, backward="mosaic"), None
  return fwd, _kernel_block_sizes("triton", ft, selection, head_dim, dtype)


def _kernel_block_sizes(impl, mod, selection, head_dim, dtype):
  """The kernel's BlockSizes with the selection's tiles, or a clear ValueError."""
  base = mod.default_block_sizes(head_dim, dtype)
  qbs, bs = selection.q_block_size, selection.block_size
  if impl == "triton":
    bad = [f"{n}={x}" for n, x in (("q_block_size", qbs), ("block_size", bs))
           if x < 16 or x & (x - 1)]
    if bad:
      raise ValueError(f"implementation='triton' needs powers of two >= 16 for the tiles, got "
                       f"{', '.join(bad)}; select blocks with such sizes (the kernel's default "
                       f"is q_block_size={base.block_q}, block_size={base.block_k}) or use "
                       f"implementation='xla'")
    # One tiling, the selection's blocks, for the forward and the backward (the default's
    # per-pass tiles are dropped: the backward walks the same schedule). Launch parameters tuned
    # for other tiles do not carry over: let the kernel choose the warps (its tuned values when
    # a pass's tiles match the default's), and shorten the pipeline when the key tile grows
    # (shared memory).
    extra = {}
    if bs > base.block_k:
      extra = dict(num_stages=2)
    return dataclasses.replace(base, block_q=qbs, block_k=bs, num_warps=None,
                               bwd_num_warps=None, bwd_block_q=None, bwd_block_k=None,
                               dkv_block_q=None, **extra)
  if (base.block_q, base.block_k) == (qbs, bs):
    return base
  try:
    return dataclasses.replace(base, block_q=qbs, block_k=bs)
  except (ValueError, TypeError) as e:
    raise ValueError(
        f"implementation={impl!r} cannot run tiles of q_block_size={qbs}, block_size={bs} ({e}); "
        f"select blocks with sizes the kernel supports (its default is "
        f"q_block_size={base.block_q}, block_size={base.block_k}) or use "
        f"implementation='xla'") from None


def block_sparse_plan(q, k, v, *, q_block_size, block_size, implementation=None,
                      interpret=False, platform=None, compute_capability=None):
  """The kernels ``block_sparse_attention`` / ``sparse_attention`` run for a call.

  ``implementation=None`` on a GPU of compute capability 9.0 (H100/H200) picks "mosaic_gpu" (the
  Hopper forward and, at head_dim 64/128, the Mosaic GPU backward, both walking the selection's
  block schedule) when q, k and v are all bf16 or all fp16 with head_dim 64, 128 or 256 (=
  head_dim_v), q_block_size and block_size are powers of two >= 64 and interpret is off; any
  other GPU call picks "triton". Measured (H200, B1 H16 D128 bf16 causal, 19% of the causal
  128 x 64 tiles, fwd+bwd, selection included; run 116): 30.98 ms against 38.62 for "triton" at
  64K, 2.376 against 2.933 at 16K. A named implementation is returned unchanged.

  Args:
    q, k, v: the call's arrays, or ``jax.ShapeDtypeStruct`` of them.
    q_block_size, block_size: the selection's block sizes.
    implementation, interpret: as for ``block_sparse_attention``.
    platform: "cpu", "gpu" or "tpu"; default: jax's default backend.
    compute_capability: (major, minor) of the GPU; default: that of the first GPU.

  Returns:
    A dict: ``implementation`` (the name the call dispatches on) and ``backward`` ("mosaic_gpu",
    "triton", "mosaic_tpu" or "xla": the kernels of the VJP).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> x = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16)
    >>> block_sparse_plan(x, x, x, q_block_size=128, block_size=64, platform="gpu",
    ...                   compute_capability=(9, 0))
    {'implementation': 'mosaic_gpu', 'backward': 'mosaic_gpu'}
    >>> block_sparse_plan(x, x, x, q_block_size=32, block_size=64, platform="gpu",
    ...                   compute_capability=(9, 0))
    {'implementation': 'triton', 'backward': 'triton'}
  """
  impl = resolve_implementation(implementation, platform=platform, interpret=interpret)
  if implementation is None and impl == "triton" and not interpret:
    cc = compute_capability if compute_capability is not None else compat.gpu_compute_capability()
    tiles_ok = all(x >= 64 and not x & (x - 1) for x in (int(q_block_size), int(block_size)))
    if cc is not None and tuple(cc) == (9, 0) and tiles_ok and _hopper_default_covers(q, k, v):
      impl = "mosaic_gpu"
  backward = impl
  if impl == "mosaic_gpu" and q.shape[-1] not in _MOSAIC_GPU_BWD_HEAD_DIMS:
    backward = "triton"
  return {"implementation": impl, "backward": backward}


def block_sparse_attention(q, k, v, selection, *, causal=True, segment_ids=None,
                           kv_segment_ids=None, scale=None, return_lse=False, implementation=None,
                           interpret=False):
  """Attention restricted to a block selection, forward and backward.

  Query i attends to key j iff j's block is kept for i's block in ``selection`` (for i's kv head)
  and the element mask allows it (causal, segment ids). Rows that see no key return 0 and -inf
  log-sum-exp.

  Implementations:
    * "xla": ``attention_reference`` with ``block_mask=selection.to_mask()`` (materialises the
      logits; the semantics every kernel matches).
    * "triton", "mosaic_tpu": ``make_schedule(q_len, kv_len, q_block_size, block_size, causal,
      segment ids, block_mask=selection.tile_mask(), max_kv_blocks=selection.max_selected)``
      walked by the flash kernels with tiles of the selection's block sizes, so only kept tiles
      are visited; the backward walks the schedule's transposed lists. A ValueError is raised if
      the kernel cannot run those tile sizes (e.g. Triton needs powers of two >= 16, Mosaic TPU
      multiples of 128): there is no silent fallback.
    * "mosaic_gpu" (Hopper, sm90): the Mosaic GPU forward (``pallas_kernels.flash.mosaic_gpu``)
      walks the same schedule with its own 64-row x (64 or 128)-key tiles, only the kept tiles
      (per program the union of its two 64-row warpgroups' lists, each tile run unmasked,
      masked or skipped per warpgroup); the backward walks the same schedule: at head_dim 64 and
      128 the Mosaic GPU dK/dV and dQ kernels (``mosaic_gpu_bwd``, since session 27: the dQ
      kernel walks each query tile's kv list, the dK/dV kernel each kv tile's transposed query
      list, with 64-row / 64-key tiles), at head_dim 256 the Triton kernels at the selection's
      tiles (the "triton" implementation's backward). Needs q_block_size and block_size powers
      of two >= 64 (ValueError otherwise), bf16/fp16, head_dim 64/128/256 == head_dim_v
      (NotImplementedError otherwise). GPU tests pass (runs 19-22); fwd+bwd at 64K with 19% of
      causal blocks 4.94x the dense causal kernel with the Triton backward (run 32).

  Args:
    q: [batch, q_len, q_heads, head_dim].
    k: [batch, kv_len, kv_heads, head_dim]; q_heads % kv_heads == 0.
    v: [batch, kv_len, kv_heads, head_dim_v].
    selection: a :class:`BlockSelection` for (q_len, kv_len) with [batch, kv_heads] leading axes.
    causal: bottom-right aligned causal mask.
    segment_ids: None or int [batch, q_len] (0 = padding).
    kv_segment_ids: None or int [batch, kv_len]; defaults to segment_ids when q_len == kv_len.
    scale: logit scale, default 1/sqrt(head_dim).
    return_lse: also return the log-sum-exp [batch, q_heads, q_len] (fp32, natural log).
    implementation: None (``block_sparse_plan``: "mosaic_gpu" on Hopper for the calls it covers,
      else "triton" on GPU, "mosaic_tpu" on TPU, "xla" on CPU), "xla", "triton", "mosaic_gpu" or
      "mosaic_tpu".
    interpret: run a Pallas kernel in interpret mode (CPU tests; "mosaic_gpu" raises
      NotImplementedError: its forward cannot be interpreted).

  Returns:
    out [batch, q_len, q_heads, head_dim_v] in q.dtype, or (out, lse) if return_lse.

  Example:
    >>> q = jax.random.normal(jax.random.key(0), (1, 256, 2, 32))
    >>> sel = select_blocks(q, q, block_size=64, q_block_size=64, top_k=1)
    >>> block_sparse_attention(q, q, q, sel, implementation="xla").shape
    (1, 256, 2, 32)
  """
  batch, q_len, kv_len, _, hk = _validate.check_qkv(q, k, v)
  _validate.check_implementation(implementation)
  segment_ids, kv_segment_ids = _validate.check_segments(segment_ids, kv_segment_ids, batch,
                                                         q_len, kv_len)
  _check_selection(selection, batch, q_len, kv_len, hk)
  if scale is None:
    scale = 1.0 / math.sqrt(q.shape[-1])
  impl = block_sparse_plan(q, k, v, q_block_size=selection.q_block_size,
                           block_size=selection.block_size, implementation=implementation,
                           interpret=interpret)["implementation"]
  if impl == "xla":
    out, lse = attention_reference(q, k, v, causal=causal, q_segment_ids=segment_ids,
                                   kv_segment_ids=kv_segment_ids, scale=scale,
                                   block_mask=selection.to_mask())
  elif impl in ("triton", "mosaic_tpu"):
    mod = kernel_module(impl)
    bs = _kernel_block_sizes(impl, mod, selection, q.shape[-1], q.dtype)
    schedule = make_schedule(q_len, kv_len, bs.block_q, bs.block_k, causal=causal,
                             q_segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                             block_mask=selection.tile_mask(),
                             max_kv_blocks=selection.max_selected)
    kwargs = dict(block_sizes=bs) if impl == "triton" else {}
    out, lse = mod.flash_attention(q, k, v, segment_ids, kv_segment_ids, schedule, causal=causal,
                                   local_window_size=None, scale=scale, logits_soft_cap=None,
                                   interpret=interpret, **kwargs)
  elif impl == "mosaic_gpu":
    # Hopper forward walking the selection's schedule; the backward (Mosaic GPU at D64/D128,
    # Triton at D256) walks the same one.
    mod = kernel_module(impl)
    fwd_bs, bwd_bs = _mosaic_gpu_block_sizes(mod, selection, q.shape[-1], q.dtype,
                                             causal=causal, segments=segment_ids is not None
                                             or kv_segment_ids is not None)
    if v.shape[-1] != q.shape[-1]:
      raise NotImplementedError(f"implementation='mosaic_gpu' needs head_dim_v == head_dim, got "
                                f"{v.shape[-1]} != {q.shape[-1]}; use implementation='triton'")
    schedule = make_schedule(q_len, kv_len, selection.q_block_size, selection.block_size,
                             causal=causal, q_segment_ids=segment_ids,
                             kv_segment_ids=kv_segment_ids, block_mask=selection.tile_mask(),
                             max_kv_blocks=selection.max_selected)
    out, lse = mod.flash_attention(q, k, v, segment_ids, kv_segment_ids, schedule, causal=causal,
                                   scale=scale, block_sizes=fwd_bs, bwd_block_sizes=bwd_bs,
                                   interpret=interpret)
  else:
    raise ValueError(f"block_sparse_attention does not support implementation={impl!r}; use "
                     f"'xla', 'triton', 'mosaic_gpu' or 'mosaic_tpu'")
  return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- gate gradients
def _tile_logit_grads(q, k, v, out, lse, dout, dlse, selection, q_seg, kv_seg, *, causal, scale,
                      max_chunk_elems=1 << 25):
  """Per kept tile, the sum of dLoss/dlogit over its elements, its query heads of the group.

  G[b, g, i, s] = sum_{h in group g, q in block i, k in block indices[b, g, i, s]} dS[b, h, q, k],
  dS = P * (dO.v - delta), delta = dO.out - dlse, P = exp(scale*q.k - lse) on visible elements.
  This is the cotangent of a per-tile logit bias at zero. Computed by gathering the kept key
  blocks, chunked over query blocks (memory ~ max_chunk_elems floats per chunk); the matmuls run
  in the input dtype with fp32 accumulation (fp32 inputs: HIGHEST precision), the softmax algebra
  in fp32.

  Returns:
    fp32 [batch, kv_heads, num_q_blocks, max_selected] (0 in sentinel slots).
  """
  b, sq, hq, d = q.shape
  _, sk, hk, dv = v.shape
  g = hq // hk
  qbs, bs = selection.q_block_size, selection.block_size
  nq, nk, ms = selection.num_q_blocks, selection.num_kv_blocks, selection.max_selected
  c = int(max(1, min(nq, max_chunk_elems // max(1, b * hq * qbs * ms * bs))))
  nc = _cdiv(nq, c)
  sq_pad = nc * c * qbs
  f32 = jnp.float32
  dt = jnp.promote_types(q.dtype, k.dtype)
  prec = _HIGHEST if dt == f32 else None
  pad_q = lambda x, val=0: jnp.pad(x, ((0, 0), (0, sq_pad - sq)) + ((0, 0),) * (x.ndim - 2),
                                  constant_values=val)
  qf = pad_q(q.astype(dt))
  dof = pad_q(dout.astype(dt))
  delta = jnp.sum(dout.astype(f32) * out.astype(f32), -1)                  # [b, sq, hq]
  delta = delta - jnp.swapaxes(dlse.astype(f32), 1, 2)
  delta = pad_q(delta)
  lse_p = pad_q(jnp.swapaxes(lse.astype(f32), 1, 2), -jnp.inf)             # [b, sq_pad, hq]
  pad_k = nk * bs - sk
  kb = jnp.pad(k.astype(dt), ((0, 0), (0, pad_k), (0, 0), (0, 0)))
  vb = jnp.pad(v.astype(dt), ((0, 0), (0, pad_k), (0, 0), (0, 0)))
  kb = jnp.transpose(kb.reshape(b, nk, bs, hk, d), (0, 3, 1, 2, 4))        # [b, hk, nk, bs, d]
  vb = jnp.transpose(vb.reshape(b, nk, bs, hk, dv), (0, 3, 1, 2, 4))
  idx = jnp.pad(selection.indices, ((0, 0), (0, 0), (0, nc * c - nq), (0, 0)),
                constant_values=-1)                                        # [b, hk, nc*c, ms]
  q_off = sk - sq
  if q_seg is not None:
    qsg = pad_q(q_seg.astype(jnp.int32))
    ksg = jnp.pad(kv_seg.astype(jnp.int32), ((0, 0), (0, pad_k))).reshape(b, nk, bs)

  def chunk(ci):
    start = ci * c * qbs
    qc = jax.lax.dynamic_slice_in_dim(qf, start, c * qbs, 1).reshape(b, c, qbs, hk, g, d)
    dc = jax.lax.dynamic_slice_in_dim(dof, start, c * qbs, 1).reshape(b, c, qbs, hk, g, dv)
    lc = jax.lax.dynamic_slice_in_dim(lse_p, start, c * qbs, 1).reshape(b, c, qbs, hk, g)
    tc = jax.lax.dynamic_slice_in_dim(delta, start, c * qbs, 1).reshape(b, c, qbs, hk, g)
    ic = jax.lax.dynamic_slice_in_dim(idx, ci * c, c, 2)                    # [b, hk, c, ms]
    safe = jnp.maximum(ic, 0).reshape(b, hk, c * ms)
    kg = jnp.take_along_axis(kb, safe[:, :, :, None, None], axis=2).reshape(b, hk, c, ms, bs, d)
    vg = jnp.take_along_axis(vb, safe[:, :, :, None, None], axis=2).reshape(b, hk, c, ms, bs, dv)
    s = jnp.einsum("bcqhgd,bhcmkd->bhgcqmk", qc, kg, precision=prec,
                   preferred_element_type=f32) * scale
    dp = jnp.einsum("bcqhgd,bhcmkd->bhgcqmk", dc, vg.astype(dt), precision=prec,
                    preferred_element_type=f32)
    q_pos = start + jnp.arange(c * qbs).reshape(c, qbs) + q_off             # [c, qbs]
    k_pos = ic[..., None] * bs + jnp.arange(bs)                             # [b, hk, c, ms, bs]
    mask = (ic[..., None] >= 0) & (k_pos < sk)
    mask = mask[:, :, None, :, None]                                        # [b,hk,1,c,1,ms,bs]
    if causal:
      mask = mask & (k_pos[:, :, None, :, None] <= q_pos[None, None, None, :, :, None, None])
    if q_seg is not None:
      qs = jax.lax.dynamic_slice_in_dim(qsg, start, c * qbs, 1).reshape(b, c, qbs)
      ks = jnp.take_along_axis(jnp.broadcast_to(ksg[:, None], (b, hk, nk, bs)),
                               safe[..., None], axis=2).reshape(b, hk, c, ms, bs)
      same = (qs[:, None, :, :, None, None] == ks[:, :, :, None]) & (ks[:, :, :, None] != 0)
      mask = mask & same[:, :, None]
    lt = jnp.transpose(lc, (0, 3, 4, 1, 2))[..., None, None]                # [b,hk,g,c,qbs,1,1]
    tt = jnp.transpose(tc, (0, 3, 4, 1, 2))[..., None, None]
    mask = mask & jnp.isfinite(lt)
    p = jnp.where(mask, jnp.exp(jnp.where(mask, s - lt, 0.0)), 0.0)
    ds = p * (dp - tt)
    return jnp.sum(ds, axis=(2, 4, 6))                                      # [b, hk, c, ms]

  res = jax.lax.map(chunk, jnp.arange(nc))                                  # [nc, b, hk, c, ms]
  res = jnp.moveaxis(res, 0, 2).reshape(b, hk, nc * c, ms)
  return res[:, :, :nq]


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _gated_attention(q, k, v, gate_logits, selection, q_seg, kv_seg, causal, scale, impl,
                     interpret):
  """block_sparse_attention whose logits carry a per-kept-tile bias ``gate_logits - itself``.

  gate_logits [b, hk, nq, max_selected] never changes the forward (the bias is exactly 0); its
  cotangent is the tile-summed dLoss/dlogits (``_tile_logit_grads``).
  """
  del gate_logits
  return block_sparse_attention(q, k, v, selection, causal=causal, segment_ids=q_seg,
                                kv_segment_ids=kv_seg, scale=scale, return_lse=True,
                                implementation=impl, interpret=interpret)


def _gated_fwd(q, k, v, gate_logits, selection, q_seg, kv_seg, causal, scale, impl, interpret):
  del gate_logits
  attn = lambda q_, k_, v_: block_sparse_attention(
      q_, k_, v_, selection, causal=causal, segment_ids=q_seg, kv_segment_ids=kv_seg, scale=scale,
      return_lse=True, implementation=impl, interpret=interpret)
  (out, lse), vjp_fn = jax.vjp(attn, q, k, v)
  return (out, lse), (q, k, v, out, lse, vjp_fn, selection, q_seg, kv_seg)


def _gated_bwd(causal, scale, impl, interpret, res, cts):
  q, k, v, out, lse, vjp_fn, selection, q_seg, kv_seg = res
  dout, dlse = cts
  dq, dk, dv = vjp_fn((dout, dlse))
  if impl in ("triton", "mosaic_gpu"):   # the Triton gate-gradient kernel (GPU)
    from pallas_kernels.sparse.gate_grad import tile_logit_grads
    dgate = tile_logit_grads(q, k, v, out, lse, dout, dlse, selection.indices, selection.counts,
                             q_seg, kv_seg, block_q=selection.q_block_size,
                             block_k=selection.block_size, causal=causal, scale=scale,
                             interpret=interpret)
  else:
    dgate = _tile_logit_grads(q, k, v, out, lse, dout, dlse, selection, q_seg, kv_seg,
                              causal=causal, scale=scale)
  return dq, dk, dv, dgate, None, None, None


_gated_attention.defvjp(_gated_fwd, _gated_bwd)


def sparse_attention(q, k, v, *, block_size, top_k, q_block_size=64, gate_grad="none",
                     gate_temperature=1.0, rng=None, causal=True, num_init_blocks=1,
                     num_local_blocks=1, segment_ids=None, kv_segment_ids=None, scale=None,
                     implementation=None, interpret=False, return_selection=False,
                     score_aux_weight=0.0, score_aux_pool="sum", aux_max_chunk_elems=1 << 25):
  """Top-K block selection plus block-sparse attention in one call, for training.

  Let score = ``block_scores(q, k)`` [b, g, i, j], c = scale (the attention logit scale) and
  T = gate_temperature. The kept set S(i) of query block i (kv head g) is chosen by the rules of
  :func:`select_blocks` applied to a ranking r; the output is always the block-sparse attention
  over S, O = block_sparse_attention(q, k, v, S). ``gate_grad`` decides r and the gradient:

    * "none": r = score; no gradient reaches the selection (hard top-k, InfLLM v2 / MoBA).
    * "ste": r = score (same selection, forward bit-for-bit equal to "none"). Gate logits
      z[i, j] = c * score[i, j] / T. Every attention logit of a kept tile (i, j) gets the bias
      z[i, j] - stop_gradient(z[i, j]) (exactly 0 in the forward), i.e. the gradient is the one
      of attention in which each kept block is weighted by exp(z[i, j]) (equivalently by
      softmax_j over S(i) of z: the shared normaliser cancels) and renormalised. So
      dL/dz[i, j] = sum over the tile (its queries, the group's query heads, its keys) of
      dL/dlogits, which flows to q and k through the mean-pooled score.
    * "gumbel": r = y with y[i, j] = (c * score[i, j] + G[i, j]) / T, G iid Gumbel(0, 1) from
      ``rng`` (one draw per batch, kv head, query block, key block): the forward keeps the hard
      top-k of the perturbed scores (Gumbel-top-k: k blocks sampled without replacement from
      softmax_j(c * score), independent of T; it explores blocks "none" would skip); the backward
      is straight-through with the same per-tile bias y - stop_gradient(y), i.e.
      dL/dscore[i, j] = (c / T) * tile sum of dL/dlogits over kept tiles, 0 for the others
      (T only scales the relaxed gradient, as in Gumbel-softmax).

  Initial and local blocks are always kept in every mode and receive the gate gradient like any
  kept block. The gate gradient needs one extra pass over the kept tiles (two matmuls per tile):
  the Pallas kernel ``pallas_kernels/sparse/gate_grad.py`` for "triton" and "mosaic_gpu", a
  chunked XLA pass (gathering the kept key/value blocks) for "xla" and "mosaic_tpu".

  ``score_aux_weight`` = w > 0 adds a score-distillation signal that works with every
  ``gate_grad`` mode and reaches the scores of blocks that were *not* kept: the gradient of
  q and k becomes that of L + w * KL, with KL = :func:`block_score_kl` (the dense attention's
  block mass, stop-gradient, pooled over each block's queries by ``score_aux_pool`` "sum" or
  "max", as the target of softmax(c * score / T) over the candidate blocks).
  The forward output is unchanged (the same selection, bit for bit); the term is injected into
  the backward pass (``_add_aux_loss``, DeepSeek's ``AddAuxiliaryLoss`` pattern), so it needs no
  change to the caller's loss, but it assumes the caller differentiates one scalar loss (its
  weight does not scale with the output cotangent) and it is not part of any reported loss
  value. Cost: the O(q_len * kv_len) dense probabilities of the target, computed chunked
  (``aux_max_chunk_elems`` logits per chunk) and only when differentiated (XLA drops it from
  forward-only calls).

  Args:
    q: [batch, q_len, q_heads, head_dim].
    k: [batch, kv_len, kv_heads, head_dim]; q_heads % kv_heads == 0.
    v: [batch, kv_len, kv_heads, head_dim_v].
    block_size: keys per block.
    top_k: blocks chosen by score besides the initial and local ones.
    q_block_size: queries per query block.
    gate_grad: "none", "ste" or "gumbel" (see above).
    gate_temperature: T > 0 (above).
    rng: a jax PRNG key; required for "gumbel", ignored otherwise.
    causal, num_init_blocks, num_local_blocks: as in :func:`select_blocks`.
    segment_ids, kv_segment_ids: None or int [batch, len] (0 = padding); kv_segment_ids defaults
      to segment_ids when q_len == kv_len.
    scale: logit scale, default 1/sqrt(head_dim).
    implementation, interpret: as in :func:`block_sparse_attention`.
    return_selection: also return the :class:`BlockSelection`.
    score_aux_weight: w >= 0, weight of the score-distillation term (0: off; above).
    score_aux_pool: "sum" or "max": the target's pooling over a block's queries
      (:func:`block_attention_mass` ``query_pool``).
    aux_max_chunk_elems: bound on the logits materialised per chunk of the target.

  Returns:
    out [batch, q_len, q_heads, head_dim_v] in q.dtype, or (out, selection).

  Example:
    >>> q = jax.random.normal(jax.random.key(0), (1, 256, 2, 32))
    >>> loss = lambda q: sparse_attention(q, q, q, block_size=64, top_k=1, gate_grad="ste",
    ...                                   implementation="xla").sum()
    >>> jax.grad(loss)(q).shape
    (1, 256, 2, 32)
  """
  if gate_grad not in _GATE_MODES:
    raise ValueError(f"gate_grad must be one of {_GATE_MODES}, got {gate_grad!r}")
  if not gate_temperature > 0:
    raise ValueError(f"gate_temperature must be > 0, got {gate_temperature}")
  if gate_grad == "gumbel" and rng is None:
    raise ValueError("gate_grad='gumbel' needs rng (a jax PRNG key)")
  if isinstance(score_aux_weight, bool) or not (isinstance(score_aux_weight, (int, float))
                                                and score_aux_weight >= 0):
    raise ValueError(f"score_aux_weight must be a float >= 0, got {score_aux_weight!r}")
  if score_aux_pool not in _QUERY_POOLS:
    raise ValueError(f"score_aux_pool must be one of {_QUERY_POOLS}, got {score_aux_pool!r}")
  _check_selection_args(block_size, q_block_size, top_k, num_init_blocks, num_local_blocks)
  batch, q_len, kv_len, _, _ = _validate.check_qkv(q, k, v)
  _validate.check_implementation(implementation)
  segment_ids, kv_segment_ids = _validate.check_segments(segment_ids, kv_segment_ids, batch,
                                                         q_len, kv_len)
  if scale is None:
    scale = 1.0 / math.sqrt(q.shape[-1])
  impl = block_sparse_plan(q, k, v, q_block_size=q_block_size, block_size=block_size,
                           implementation=implementation, interpret=interpret)["implementation"]
  if gate_grad == "none":
    q_s, k_s = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
  else:
    q_s, k_s = q, k
  scores = block_scores(q_s, k_s, block_size=block_size, q_block_size=q_block_size,
                        segment_ids=segment_ids, kv_segment_ids=kv_segment_ids)
  if gate_grad == "gumbel":
    noise = jax.random.gumbel(rng, scores.shape, jnp.float32)
    gate = (scale * scores + noise) / gate_temperature
    rank = gate
  else:
    gate = scale * scores / gate_temperature
    rank = scores
  seg_ok = doc_start = None
  if segment_ids is not None:
    seg_ok = _segment_overlap(segment_ids, kv_segment_ids, q_block_size, block_size)
    doc_start = _doc_start_blocks(segment_ids, kv_segment_ids, q_block_size, block_size)
  sel = _select(rank, q_len=q_len, kv_len=kv_len, q_block_size=int(q_block_size),
                block_size=int(block_size), causal=causal, num_init=int(num_init_blocks),
                num_local=int(num_local_blocks), top_k=int(top_k), seg_ok=seg_ok,
                scores=jax.lax.stop_gradient(scores), doc_start=doc_start)
  if gate_grad == "none":
    out = block_sparse_attention(q, k, v, sel, causal=causal, segment_ids=segment_ids,
                                 kv_segment_ids=kv_segment_ids, scale=scale,
                                 implementation=impl, interpret=interpret)
  else:
    valid = sel.indices >= 0
    gate_sel = jnp.take_along_axis(gate, jnp.maximum(sel.indices, 0), axis=-1)
    gate_sel = jnp.where(valid, gate_sel, 0.0)                    # [b, hk, nq, max_selected]
    bare = dataclasses.replace(sel, scores=None)
    out, _ = _gated_attention(q, k, v, gate_sel, bare, segment_ids, kv_segment_ids, bool(causal),
                              float(scale), impl, bool(interpret))
  if score_aux_weight > 0:
    scores_g = scores if gate_grad != "none" else block_scores(
        q, k, block_size=block_size, q_block_size=q_block_size, segment_ids=segment_ids,
        kv_segment_ids=kv_segment_ids)
    mass = block_attention_mass(q, k, block_size=block_size, q_block_size=q_block_size,
                                causal=causal, segment_ids=segment_ids,
                                kv_segment_ids=kv_segment_ids, scale=scale,
                                query_pool=score_aux_pool, max_chunk_elems=aux_max_chunk_elems)
    cand, _, _ = _candidates(batch, k.shape[2], q_len=q_len, kv_len=kv_len,
                             q_block_size=int(q_block_size), block_size=int(block_size),
                             causal=causal, num_init=int(num_init_blocks),
                             num_local=int(num_local_blocks), seg_ok=seg_ok, doc_start=doc_start)
    kl = _score_kl(scale * scores_g / gate_temperature, mass, cand)
    out = _add_aux_loss(out, float(score_aux_weight) * kl)
  return (out, sel) if return_selection else out


# ----------------------------------------------------------------------------- captured mass
def _chunk_visibility(t, start, qsg, kv_segment_ids, *, q_len, kv_len, causal):
  """Element visibility [b or 1, 1, 1, len(t), kv_len] of a chunk's query rows ``t``.

  ``t`` = start + arange(chunk) indexes the padded queries; ``qsg`` the padded query segment
  ids (None: no segments). Causal / segment mask as :func:`element_mask` (no window); padding
  rows (t >= q_len) see nothing.
  """
  if qsg is not None:
    qs = jax.lax.dynamic_slice_in_dim(qsg, start, t.shape[0], 1)
    vis = element_mask(t + kv_len - q_len, jnp.arange(kv_len), causal=causal, window=None,
                       q_seg=qs[:, None, None, :], kv_seg=kv_segment_ids[:, None, None, :])
  else:
    vis = element_mask(t + kv_len - q_len, jnp.arange(kv_len), causal=causal,
                       window=None)[None, None, None]
  return vis & (t < q_len)[:, None]


def captured_mass(q, k, selection, *, causal=True, segment_ids=None, kv_segment_ids=None,
                  scale=None, reduce=True, max_chunk_elems=1 << 25):
  """Fraction of the full-softmax attention probability that falls inside the kept blocks.

  For query t of head h: mass = sum over visible keys in kept blocks of softmax(scale * q.k)
  (normalised over all visible keys: causal and segment masks). Computed in fp32 in chunks of
  queries (``lax.map``), so memory stays ~ max_chunk_elems floats even at 16K-64K tokens.

  Args:
    q: [batch, q_len, q_heads, head_dim].
    k: [batch, kv_len, kv_heads, head_dim].
    selection: a :class:`BlockSelection` for (q_len, kv_len).
    causal: bottom-right aligned causal mask for the full softmax.
    segment_ids, kv_segment_ids: None or int [batch, len] (0 = padding).
    scale: logit scale, default 1/sqrt(head_dim).
    reduce: True: one scalar, the mean over all (batch, head, query) with at least one visible
      key. False: fp32 [batch, q_heads], the mean over each head's queries (NaN-free: 0 where a
      head has no valid query).
    max_chunk_elems: bound on the logits materialised per chunk.

  Returns:
    fp32 scalar or [batch, q_heads].

  Example:
    >>> q = jax.random.normal(jax.random.key(0), (1, 256, 2, 32))
    >>> sel = select_blocks(q, q, block_size=64, top_k=4)
    >>> float(captured_mass(q, q, sel))
    1.0
  """
  batch, q_len, kv_len, hq, hk = _validate.check_qkv(q, k, k)
  segment_ids, kv_segment_ids = _validate.check_segments(segment_ids, kv_segment_ids, batch,
                                                         q_len, kv_len)
  _check_selection(selection, batch, q_len, kv_len, hk)
  g = hq // hk
  d = q.shape[-1]
  if scale is None:
    scale = 1.0 / math.sqrt(d)
  qbs, bs = selection.q_block_size, selection.block_size
  cq = int(max(1, min(q_len, max_chunk_elems // max(1, batch * hq * kv_len))))
  nc = _cdiv(q_len, cq)
  pad = nc * cq - q_len
  qf = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0)))
  kf = k.astype(jnp.float32)
  tiles = selection.tile_mask()                                            # [b, hk, nq, nk]
  kblock = jnp.arange(kv_len) // bs                                        # [sk]
  qsg = None if segment_ids is None else jnp.pad(segment_ids, ((0, 0), (0, pad)))

  def chunk(ci):
    start = ci * cq
    qc = jax.lax.dynamic_slice_in_dim(qf, start, cq, 1).reshape(batch, cq, hk, g, d)
    t = start + jnp.arange(cq)                                             # query index
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qc, kf, precision=_HIGHEST) * scale
    vis = _chunk_visibility(t, start, qsg, kv_segment_ids, q_len=q_len, kv_len=kv_len,
                            causal=causal)
    rows = jnp.take(tiles, jnp.minimum(t // qbs, selection.num_q_blocks - 1), axis=2)
    kept = jnp.take(rows, kblock, axis=3)[:, :, None]                      # [b, hk, 1, cq, sk]
    s_all = jnp.where(vis, s, -jnp.inf)
    lse_all = jax.nn.logsumexp(s_all, axis=-1)
    lse_sel = jax.nn.logsumexp(jnp.where(kept, s_all, -jnp.inf), axis=-1)
    ok = jnp.isfinite(lse_all)
    mass = jnp.where(ok, jnp.exp(lse_sel - jnp.where(ok, lse_all, 0.0)), 0.0)  # [b, hk, g, cq]
    return (mass.sum(-1).reshape(batch, hq), ok.sum(-1).reshape(batch, hq).astype(jnp.float32))

  mass, cnt = jax.lax.map(chunk, jnp.arange(nc))
  mass, cnt = mass.sum(0), cnt.sum(0)                                      # [b, hq]
  if reduce:
    return jnp.sum(mass) / jnp.maximum(jnp.sum(cnt), 1.0)
  return jnp.where(cnt > 0, mass / jnp.maximum(cnt, 1.0), 0.0)


# ----------------------------------------------------------------------------- score distillation
def block_attention_mass(q, k, *, block_size=64, q_block_size=64, causal=True, segment_ids=None,
                         kv_segment_ids=None, scale=None, query_pool="sum",
                         max_chunk_elems=1 << 25):
  """Dense attention probability pooled onto (query block, key block) tiles, per GQA group.

  With P = softmax over the visible keys (causal, bottom-right aligned; same nonzero segment id)
  of scale * q[t] . k[s] in fp32 (queries that see no key, e.g. padding, contribute 0) and
  m[b, h, t, j] = sum over the keys s of block j of P[b, h, t, s] (query t's mass on block j):

    * query_pool="sum": M[b, g, i, j] = sum over the query heads h of kv group g and the queries
      t of block i of m[b, h, t, j]. Row sums: sum_j M = (query heads per group) * (valid
      queries of block i).
    * query_pool="max": M[b, g, i, j] = sum over h in group g of max over t in block i of
      m[b, h, t, j]: a block that one query of the block needs counts fully (SeerAttention's
      max-pooled ground truth), where "sum" dilutes it by the query block size.

  The target of :func:`block_score_kl`. Not differentiable (stop-gradient inputs). Computed in chunks of query blocks (``lax.map``; ~max_chunk_elems logits each), the
  matmul in the input dtype with fp32 accumulation (fp32 inputs: HIGHEST precision).

  Args:
    q: [batch, q_len, q_heads, head_dim].
    k: [batch, kv_len, kv_heads, head_dim].
    block_size, q_block_size: key / query block sizes.
    causal: bottom-right aligned causal mask.
    segment_ids, kv_segment_ids: None or int [batch, len] (0 = padding).
    scale: logit scale, default 1/sqrt(head_dim).
    query_pool: "sum" or "max" (above).
    max_chunk_elems: bound on the logits materialised per chunk.

  Returns:
    fp32 [batch, kv_heads, num_q_blocks, num_kv_blocks].

  Example:
    >>> q = jax.random.normal(jax.random.key(0), (1, 96, 4, 16))
    >>> m = block_attention_mass(q, q[:, :, :2], block_size=32, q_block_size=32)
    >>> m.shape, float(m[0, 0, 1].sum())   # 2 query heads per group x 32 queries
    ((1, 2, 3, 3), 64.0)
  """
  if query_pool not in _QUERY_POOLS:
    raise ValueError(f"query_pool must be one of {_QUERY_POOLS}, got {query_pool!r}")
  batch, q_len, kv_len, hq, hk = _validate.check_qkv(q, k, k)
  segment_ids, kv_segment_ids = _validate.check_segments(segment_ids, kv_segment_ids, batch,
                                                         q_len, kv_len)
  q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
  g, d = hq // hk, q.shape[-1]
  if scale is None:
    scale = 1.0 / math.sqrt(d)
  qbs, bs = int(q_block_size), int(block_size)
  nq, nk = _cdiv(q_len, qbs), _cdiv(kv_len, bs)
  c = int(max(1, min(nq, max_chunk_elems // max(1, batch * hq * qbs * kv_len))))
  nc = _cdiv(nq, c)
  pad = nc * c * qbs - q_len
  f32 = jnp.float32
  dt = jnp.promote_types(q.dtype, k.dtype)
  prec = _HIGHEST if dt == f32 else None
  qf = jnp.pad(q.astype(dt), ((0, 0), (0, pad), (0, 0), (0, 0)))
  kf = k.astype(dt)
  qsg = None if segment_ids is None else jnp.pad(segment_ids, ((0, 0), (0, pad)))

  def chunk(ci):
    start = ci * c * qbs
    qc = jax.lax.dynamic_slice_in_dim(qf, start, c * qbs, 1).reshape(batch, c * qbs, hk, g, d)
    t = start + jnp.arange(c * qbs)                                        # query index
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qc, kf, precision=prec, preferred_element_type=f32)
    vis = _chunk_visibility(t, start, qsg, kv_segment_ids, q_len=q_len, kv_len=kv_len,
                            causal=causal)
    s = jnp.where(vis, s * scale, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(vis, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)         # [b, hk, g, cq, sk]
    p = jnp.pad(p, ((0, 0),) * 4 + ((0, nk * bs - kv_len),))
    p = jnp.sum(p.reshape(batch, hk, g, c, qbs, nk, bs), axis=6)          # [b,hk,g,c,qbs,nk]
    p = jnp.max(p, axis=4) if query_pool == "max" else jnp.sum(p, axis=4)
    return jnp.sum(p, axis=2)                                              # [b, hk, c, nk]

  res = jax.lax.map(chunk, jnp.arange(nc))                                 # [nc, b, hk, c, nk]
  return jnp.moveaxis(res, 0, 2).reshape(batch, hk, nc * c, nk)[:, :, :nq]


def _score_kl(z, mass, cand):
  """Mean over rows of KL(p || softmax(z) over the candidate blocks); p = mass renormalised
  over the candidates. Rows with fewer than two candidates or no candidate mass are skipped.

  z, mass: fp32 [b, hk, nq, nk]; cand: bool, broadcastable to it.
  """
  cand = jnp.broadcast_to(cand, z.shape)
  tgt = jnp.where(cand, jax.lax.stop_gradient(mass).astype(jnp.float32), 0.0)
  tot = jnp.sum(tgt, axis=-1, keepdims=True)
  ok = (jnp.sum(cand, axis=-1) >= 2) & (tot[..., 0] > 0)                  # [b, hk, nq]
  p = tgt / jnp.where(tot > 0, tot, 1.0)
  use = cand & ok[..., None]
  logq = jax.nn.log_softmax(jnp.where(use, z.astype(jnp.float32), -jnp.inf), axis=-1)
  logq = jnp.where(use, logq, 0.0)
  pos = use & (p > 0)
  kl = jnp.sum(jnp.where(pos, p * (jnp.log(jnp.where(pos, p, 1.0)) - logq), 0.0), axis=-1)
  return jnp.sum(kl) / jnp.maximum(jnp.sum(ok), 1).astype(jnp.float32)


def block_score_kl(q, k, *, block_size=64, q_block_size=64, causal=True, num_init_blocks=1,
                   num_local_blocks=1, segment_ids=None, kv_segment_ids=None, scale=None,
                   temperature=1.0, query_pool="sum", max_chunk_elems=1 << 25):
  """Score-distillation loss: how far the block scorer's distribution is from the dense
  attention's block mass (``sparse_attention(score_aux_weight=...)`` trains on it).

  For batch b, kv head g and query block i, let C(i) be the candidate blocks of
  :func:`select_blocks`' rules (selectable and not always kept: top-k chooses among exactly
  these), z[i, j] = c * score[i, j] / T (``block_scores``, c = scale, T = temperature: the
  "ste" gate logits) and M = :func:`block_attention_mass` (stop-gradient; ``query_pool`` "sum"
  or "max" over the block's queries). Then

      p[i, j] = M[i, j] / sum_{j' in C(i)} M[i, j']        (j in C(i))
      KL(i)   = sum_{j in C(i)} p[i, j] * (log p[i, j] - log_softmax_{j' in C(i)} z[i, j'])

  and the loss is the mean of KL(i) over (b, g, i) with |C(i)| >= 2 and some target mass (0 if
  there is none). dKL(i)/dz[i, j] = softmax(z)[i, j] - p[i, j] for every candidate j, kept or
  not, so the scores of dropped blocks that the dense attention wants rise (SeerAttention's
  pooled-attention KL; DeepSeek Sparse Attention's indexer KL, here at block level and on the
  attention's own q/k). The always-kept blocks are left out: their score decides nothing and
  their (mostly local) mass would dwarf the candidates'.

  Args:
    q, k: as in :func:`select_blocks` (differentiable through the scores only).
    block_size, q_block_size, causal, num_init_blocks, num_local_blocks, segment_ids,
      kv_segment_ids: the selection rules (:func:`select_blocks`).
    scale: logit scale c, default 1/sqrt(head_dim).
    temperature: T > 0.
    query_pool: "sum" or "max": pooling of the target over the queries of a block
      (:func:`block_attention_mass`).
    max_chunk_elems: chunking of the target (:func:`block_attention_mass`).

  Returns:
    fp32 scalar (nats).

  Example:
    >>> q = jax.random.normal(jax.random.key(0), (1, 256, 2, 16))
    >>> kl = block_score_kl(q, q, block_size=32, q_block_size=32)
    >>> bool(kl >= 0), jax.grad(lambda q: block_score_kl(q, q, block_size=32,
    ...                                                   q_block_size=32))(q).shape
    (True, (1, 256, 2, 16))
  """
  _check_selection_args(block_size, q_block_size, 0, num_init_blocks, num_local_blocks)
  if not temperature > 0:
    raise ValueError(f"temperature must be > 0, got {temperature}")
  batch, q_len, kv_len, _, hk = _validate.check_qkv(q, k, k)
  segment_ids, kv_segment_ids = _validate.check_segments(segment_ids, kv_segment_ids, batch,
                                                         q_len, kv_len)
  if scale is None:
    scale = 1.0 / math.sqrt(q.shape[-1])
  scores = block_scores(q, k, block_size=block_size, q_block_size=q_block_size,
                        segment_ids=segment_ids, kv_segment_ids=kv_segment_ids)
  mass = block_attention_mass(q, k, block_size=block_size, q_block_size=q_block_size,
                              causal=causal, segment_ids=segment_ids,
                              kv_segment_ids=kv_segment_ids, scale=scale, query_pool=query_pool,
                              max_chunk_elems=max_chunk_elems)
  seg_ok = doc_start = None
  if segment_ids is not None:
    seg_ok = _segment_overlap(segment_ids, kv_segment_ids, q_block_size, block_size)
    doc_start = _doc_start_blocks(segment_ids, kv_segment_ids, q_block_size, block_size)
  cand, _, _ = _candidates(batch, hk, q_len=q_len, kv_len=kv_len, q_block_size=int(q_block_size),
                           block_size=int(block_size), causal=causal,
                           num_init=int(num_init_blocks), num_local=int(num_local_blocks),
                           seg_ok=seg_ok, doc_start=doc_start)
  return _score_kl(scale * scores / temperature, mass, cand)


@jax.custom_vjp
def _add_aux_loss(x, loss):
  """Identity on ``x``; in the backward pass ``loss`` (a scalar) receives cotangent 1, so the
  gradient of the caller's scalar loss L becomes that of L + loss (DeepSeek-V2/V3's
  ``AddAuxiliaryLoss``)."""
  del loss
  return x


def _add_aux_loss_fwd(x, loss):
  return x, jnp.zeros_like(loss)


def _add_aux_loss_bwd(zero, g):
  return g, jnp.ones_like(zero)


_add_aux_loss.defvjp(_add_aux_loss_fwd, _add_aux_loss_bwd)


# ----------------------------------------------------------------------------- sparse decode
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockSummaries:
  """Running per-block key sums of a contiguous KV cache, for decode-time block scoring.

  Attributes:
    sums: fp32 [batch, num_blocks, kv_heads, head_dim] (layout "nhd"), or [batch, kv_heads,
      num_blocks, head_dim] (layout "hnd"): sum of the keys of each cache block over the
      positions < lengths.
    lengths: int32 [batch]: number of cache positions summarised.
    block_size: positions per block (static).
    layout: "nhd" or "hnd" (static): the layout of the cache these sums summarise (see
      ``kv_layout`` of :func:`sparse_decode_attention`); the sums follow it (the kv head axis
      before the block axis for "hnd").

  Example:
    >>> k = jax.random.normal(jax.random.key(0), (1, 128, 2, 16))
    >>> s = init_block_summaries(k, jnp.array([100]), block_size=32)
    >>> s.sums.shape, s.num_blocks, s.layout
    ((1, 4, 2, 16), 4, 'nhd')
    >>> kh = jnp.swapaxes(k, 1, 2)                      # head-major [1, 2, 128, 16]
    >>> sh = init_block_summaries(kh, jnp.array([100]), block_size=32, kv_layout="hnd")
    >>> sh.sums.shape, sh.num_blocks, sh.layout
    ((1, 2, 4, 16), 4, 'hnd')
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
    """Summarised positions per block.

    Returns:
      int32 [batch, num_blocks]: clip(lengths - j * block_size, 0, block_size).

    Example:
      >>> k = jnp.ones((1, 100, 1, 4))
      >>> init_block_summaries(k, jnp.array([70]), block_size=32).counts().tolist()
      [[32, 32, 6, 0]]
    """
    starts = jnp.arange(self.num_blocks, dtype=jnp.int32) * self.block_size
    return jnp.clip(self.lengths[:, None] - starts, 0, self.block_size).astype(jnp.int32)

  def means(self):
    """Mean key per block (the decode-time block summary).

    Returns:
      fp32, the shape of ``sums`` ([batch, num_blocks, kv_heads, head_dim] for "nhd",
      [batch, kv_heads, num_blocks, head_dim] for "hnd"); 0 for empty blocks.

    Example:
      >>> k = jnp.ones((1, 100, 1, 4))
      >>> float(init_block_summaries(k, jnp.array([70]), block_size=32).means()[0, 2, 0, 0])
      1.0
    """
    cnt = jnp.maximum(self.counts(), 1).astype(jnp.float32)                # [b, nb]
    if self.layout == "hnd":
      return self.sums / cnt[:, None, :, None]
    return self.sums / cnt[:, :, None, None]


def _gather_positions(k, page_table, pos):
  """Rows k[b, pos[b, t]] of a contiguous cache, or via the page table of a page pool."""
  if page_table is None:
    return jnp.take_along_axis(k, pos[:, :, None, None], axis=1)             # [b, t, hk, d]
  ps = k.shape[1]
  page = jnp.take_along_axis(page_table, pos // ps, axis=1)                  # [b, t]
  return k[jnp.clip(page, 0, k.shape[0] - 1), pos % ps]                      # [b, t, hk, d]


def init_block_summaries(k_cache, kv_lengths, *, block_size, page_table=None, kv_layout="nhd"):
  """Block key sums of a cache from scratch (after prefill; O(cache) once).

  Args:
    k_cache: [batch, max_len, kv_heads, head_dim] ("nhd"), [batch, kv_heads, max_len,
      head_dim] ("hnd"), or with ``page_table`` a page pool
      [num_pages, block_size, kv_heads, head_dim].
    kv_lengths: int [batch]: valid positions per sequence.
    block_size: positions per block (the page size for a paged cache).
    page_table: None or int32 [batch, max_pages] (token t of sequence b lives in page
      ``page_table[b, t // block_size]``).
    kv_layout: "nhd" (default) or "hnd" (head-major contiguous cache, see
      :func:`sparse_decode_attention`; not with ``page_table``).

  Returns:
    A :class:`BlockSummaries` with ceil(max_len / block_size) (or max_pages) blocks and
    ``layout=kv_layout``: sums [batch, num_blocks, kv_heads, head_dim] ("nhd") or
    [batch, kv_heads, num_blocks, head_dim] ("hnd").

  Example:
    >>> k = jax.random.normal(jax.random.key(0), (2, 256, 2, 16))
    >>> s = init_block_summaries(k, jnp.array([10, 200]), block_size=64)
    >>> s.sums.shape
    (2, 4, 2, 16)
    >>> init_block_summaries(jnp.swapaxes(k, 1, 2), jnp.array([10, 200]), block_size=64,
    ...                      kv_layout="hnd").sums.shape
    (2, 2, 4, 16)
  """
  _check_kv_layout(kv_layout)
  if k_cache.ndim != 4:
    raise ValueError(f"k_cache must be 4-d, got {k_cache.shape}")
  if page_table is not None:
    if kv_layout != "nhd":
      raise ValueError("kv_layout='hnd' is for contiguous caches; paged caches are "
                       "[num_pages, page_size, kv_heads, head_dim] (kv_layout='nhd')")
    if k_cache.shape[1] != block_size:
      raise ValueError(f"page size {k_cache.shape[1]} must equal block_size {block_size}")
    n = page_table.shape[1] * block_size
    pos = jnp.broadcast_to(jnp.arange(n)[None], (page_table.shape[0], n))
    k_cache = _gather_positions(k_cache, page_table, pos)
  if kv_layout == "hnd":
    b, hk, n, d = k_cache.shape
  else:
    b, n, hk, d = k_cache.shape
  nb = _cdiv(n, block_size)
  lengths = jnp.minimum(jnp.asarray(kv_lengths, jnp.int32), n)
  valid = jnp.arange(n)[None, :] < lengths[:, None]                          # [b, n]
  if kv_layout == "hnd":
    kf = jnp.where(valid[:, None, :, None], k_cache.astype(jnp.float32), 0.0)
    kf = jnp.pad(kf, ((0, 0), (0, 0), (0, nb * block_size - n), (0, 0)))
    sums = kf.reshape(b, hk, nb, block_size, d).sum(3)                       # [b, hk, nb, d]
  else:
    kf = jnp.where(valid[:, :, None, None], k_cache.astype(jnp.float32), 0.0)
    kf = jnp.pad(kf, ((0, 0), (0, nb * block_size - n), (0, 0), (0, 0)))
    sums = kf.reshape(b, nb, block_size, hk, d).sum(2)                       # [b, nb, hk, d]
  return BlockSummaries(sums=sums, lengths=lengths, block_size=int(block_size),
                        layout=kv_layout)


def update_block_summaries(summaries, k_cache, kv_lengths, *, page_table=None, kv_layout=None):
  """Add the newest cache entry of each sequence to its block sum (O(1) per appended token).

  Call once after each decode step has written its key at position ``kv_lengths - 1``. A
  sequence whose ``kv_lengths`` did not grow (``kv_lengths <= summaries.lengths``) is left
  unchanged; a sequence that grew by more than one token must be re-summarised with
  :func:`init_block_summaries` (only the last position is added).

  Args:
    summaries: a :class:`BlockSummaries`.
    k_cache: [batch, max_len, kv_heads, head_dim] ("nhd") or [batch, kv_heads, max_len,
      head_dim] ("hnd") already holding the new keys, or with ``page_table`` the page pool
      [num_pages, block_size, kv_heads, head_dim].
    kv_lengths: int [batch], lengths including the new token.
    page_table: None or int32 [batch, max_pages].
    kv_layout: None (default: ``summaries.layout``), "nhd" or "hnd"; a value other than
      ``summaries.layout`` raises ValueError.

  Returns:
    The updated :class:`BlockSummaries` (same layout).

  Example:
    >>> k = jax.random.normal(jax.random.key(0), (1, 128, 1, 8))
    >>> s = init_block_summaries(k, jnp.array([5]), block_size=64)
    >>> s = update_block_summaries(s, k, jnp.array([6]))
    >>> int(s.lengths[0])
    6
    >>> kh = jnp.swapaxes(k, 1, 2)                      # head-major [1, 1, 128, 8]
    >>> sh = init_block_summaries(kh, jnp.array([5]), block_size=64, kv_layout="hnd")
    >>> sh = update_block_summaries(sh, kh, jnp.array([6]))
    >>> bool(jnp.allclose(sh.sums, jnp.swapaxes(s.sums, 1, 2)))
    True
  """
  if not isinstance(summaries, BlockSummaries):
    raise TypeError("summaries must be a BlockSummaries")
  if kv_layout is not None:
    _check_kv_layout(kv_layout)
    if kv_layout != summaries.layout:
      raise ValueError(f"kv_layout={kv_layout!r} but the summaries were made for a "
                       f"{summaries.layout!r} cache (init_block_summaries(kv_layout=...))")
  hnd = summaries.layout == "hnd"
  if hnd and page_table is not None:
    raise ValueError("kv_layout='hnd' summaries are for contiguous caches, got a page_table")
  bsz = summaries.sums.shape[0]
  cap = summaries.num_blocks * summaries.block_size
  if page_table is None:
    cap = min(cap, k_cache.shape[2 if hnd else 1])
  lengths = jnp.minimum(jnp.asarray(kv_lengths, jnp.int32), cap)
  pos = jnp.maximum(lengths - 1, 0)
  new = lengths > summaries.lengths
  bi = jnp.arange(bsz)
  if hnd:
    k_new = k_cache[bi, :, pos]                                              # [b, hk, d]
  else:
    k_new = _gather_positions(k_cache, page_table, pos[:, None])[:, 0]        # [b, hk, d]
  k_new = jnp.where(new[:, None, None], k_new.astype(jnp.float32), 0.0)
  blk = pos // summaries.block_size
  if hnd:
    sums = summaries.sums.at[bi, :, blk].add(k_new)                          # [b, hk, nb, d]
  else:
    sums = summaries.sums.at[bi, blk].add(k_new)                             # [b, nb, hk, d]
  return BlockSummaries(sums=sums, lengths=jnp.where(new, lengths, summaries.lengths),
                        block_size=summaries.block_size, layout=summaries.layout)


def select_decode_blocks(q, block_summaries, kv_lengths, *, top_k, num_init_blocks=1,
                         num_local_blocks=1):
  """Per-token block selection for one new query per sequence (the decode side of select_blocks).

  The query of sequence b sits at position p = kv_lengths[b] - 1 in block d = p // block_size.
  Kept: blocks 0 .. num_init_blocks-1 and d-num_local_blocks+1 .. d (when <= d), plus the top_k
  highest-scoring other blocks j < d, score = sum over the group's query heads of q . mean key of
  block j. Same rules as ``select_blocks(q_block_size=1)`` on the last query of the prefix.
  There are no segment ids: a cache row holds one document (decode packed documents one per
  row), so block 0 is the document's first block, as ``select_blocks`` with segment ids
  selects for a document that starts at a block boundary.

  Args:
    q: [batch, q_heads, head_dim].
    block_summaries: :class:`BlockSummaries` of the cache (holding the new token), either
      layout.
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
  return _decode_select(q, block_summaries, kv_lengths, top_k=top_k,
                        num_init_blocks=num_init_blocks, num_local_blocks=num_local_blocks)


def _decode_width(num_blocks, top_k, num_init_blocks, num_local_blocks):
  """Static width of the decode selection lists (``decode_fused_select.decode_width``)."""
  from pallas_kernels.sparse.decode_fused_select import decode_width
  return decode_width(num_blocks, top_k, num_init_blocks, num_local_blocks)


def _decode_select(q, block_summaries, kv_lengths, *, top_k, num_init_blocks, num_local_blocks):
  """select_decode_blocks in XLA (the reference; the Triton path runs
  ``pallas_kernels.sparse.decode_select`` instead)."""
  _check_selection_args(block_summaries.block_size, 1, top_k, num_init_blocks, num_local_blocks)
  return _decode_select_from_scores(_decode_scores(q, block_summaries), kv_lengths,
                                    block_size=block_summaries.block_size, top_k=top_k,
                                    num_init_blocks=num_init_blocks,
                                    num_local_blocks=num_local_blocks)


def _decode_scores(q, block_summaries):
  """fp32 [b, kv_heads, num_blocks]: sum over the group's query heads of q . mean key."""
  b, hq, d = q.shape
  sums = block_summaries.sums              # [b, nb, hk, d] ("nhd") or [b, hk, nb, d] ("hnd")
  hnd = block_summaries.layout == "hnd"
  hk = sums.shape[1 if hnd else 2]
  qsum = q.astype(jnp.float32).reshape(b, hk, hq // hk, d).sum(2)          # [b, hk, d]
  # q . mean_key = (q . key_sum) / count: divide the [b, hk, nb] scores, not the sums.
  scores = jnp.einsum("bhd,bhjd->bhj" if hnd else "bhd,bjhd->bhj", qsum, sums,
                      precision=_HIGHEST)                                  # [b, hk, nb]
  return scores / jnp.maximum(block_summaries.counts(), 1)[:, None, :].astype(jnp.float32)


def _decode_select_from_scores(scores, kv_lengths, *, block_size, top_k, num_init_blocks,
                               num_local_blocks):
  """The decode selection rules applied to given scores [b, hk, nb] (XLA, lax.top_k)."""
  b, hk, nb = scores.shape
  bs = block_size
  lengths = jnp.minimum(jnp.asarray(kv_lengths, jnp.int32), nb * bs)
  diag = jnp.where(lengths > 0, (lengths - 1) // bs, -1)[:, None, None]    # [b, 1, 1]
  j = jnp.arange(nb)[None, None, :]
  visible = j <= diag
  local = (j > diag - num_local_blocks) if num_local_blocks > 0 else jnp.zeros_like(visible)
  forced = visible & ((j < num_init_blocks) | local)
  cand = jnp.broadcast_to(visible & ~forced, (b, hk, nb))
  parts = []
  n_forced = min(num_init_blocks, nb) + min(num_local_blocks, nb)
  fi = jnp.concatenate([jnp.arange(min(num_init_blocks, nb)),
                        jnp.arange(min(num_local_blocks, nb)) - min(num_local_blocks, nb) + 1])
  if n_forced:
    fidx = jnp.broadcast_to(fi[None, None, :], (b, 1, n_forced))
    fidx = jnp.where(jnp.arange(n_forced) < min(num_init_blocks, nb), fidx, fidx + diag)
    dup = (jnp.arange(n_forced) >= min(num_init_blocks, nb)) & (fidx < num_init_blocks)
    ok = (fidx >= 0) & (fidx <= diag) & ~dup
    parts.append(jnp.broadcast_to(jnp.where(ok, fidx, -1), (b, hk, n_forced)))
  k_eff = min(top_k, nb)
  if k_eff:
    _, tidx = jax.lax.top_k(jnp.where(cand, scores, -jnp.inf), k_eff)
    tvalid = jnp.take_along_axis(cand, tidx, axis=-1)
    parts.append(jnp.where(tvalid, tidx, -1))
  if not parts:
    return jnp.full((b, hk, 1), -1, jnp.int32)
  allidx = jnp.concatenate(parts, axis=-1).astype(jnp.int32)
  ms = _decode_width(nb, top_k, num_init_blocks, num_local_blocks)
  key = jnp.sort(jnp.where(allidx < 0, nb, allidx), axis=-1)[..., :ms]
  return jnp.where(key >= nb, -1, key).astype(jnp.int32)


def _sparse_decode_xla(q, k, v, kv_lengths, indices, page_table, block_size, scale):
  """Gather the selected blocks of each kv head (no copy of the whole cache), one softmax."""
  b, hq, d = q.shape
  hk = k.shape[2]
  g = hq // hk
  ms = indices.shape[-1]
  safe = jnp.maximum(indices, 0)                                           # [b, hk, ms]
  bi = jnp.arange(b)[:, None, None]
  hi = jnp.arange(hk)[None, :, None]
  if page_table is None:
    n = k.shape[1]
    nb = _cdiv(n, block_size)
    pad = nb * block_size - n
    if pad:
      k = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))
      v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
    kb = k.reshape(b, nb, block_size, hk, d)
    vb = v.reshape(b, nb, block_size, hk, v.shape[-1])
    kg = kb[bi, safe, :, hi]                                               # [b, hk, ms, bs, d]
    vg = vb[bi, safe, :, hi]
  else:
    n = page_table.shape[1] * block_size
    page = jnp.clip(jnp.take_along_axis(page_table[:, None, :], safe, axis=2), 0,
                    k.shape[0] - 1)                                        # [b, hk, ms]
    kg = k[page, :, hi]                                                    # [b, hk, ms, bs, d]
    vg = v[page, :, hi]
  qf = q.reshape(b, hk, g, d)
  s = jnp.einsum("bhgd,bhmkd->bhgmk", qf, kg, preferred_element_type=jnp.float32) * scale
  k_pos = safe[..., None] * block_size + jnp.arange(block_size)
  lengths = jnp.minimum(jnp.asarray(kv_lengths, jnp.int32), n)
  mask = (indices[..., None] >= 0) & (k_pos < lengths[:, None, None, None])  # [b, hk, ms, bs]
  s = jnp.where(mask[:, :, None], s, -jnp.inf).reshape(b, hk, g, ms * block_size)
  # Masked rows may come from unused slots or garbage table entries (e.g. a length-0 row's
  # pages): zero them, since p = 0 times a NaN there would still poison the output.
  vg = jnp.where(mask[..., None], vg, jnp.zeros((), vg.dtype))             # [b, hk, ms, bs, dv]
  m = jnp.max(s, -1, keepdims=True)
  m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  p = jnp.exp(s - m)
  l = jnp.sum(p, -1, keepdims=True)
  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  o = jnp.einsum("bhgk,bhkd->bhgd", (p / l_safe).astype(vg.dtype),
                 vg.reshape(b, hk, ms * block_size, vg.shape[-1]),
                 preferred_element_type=jnp.float32)
  lse = jnp.where(empty, -jnp.inf, m + jnp.log(l_safe))[..., 0]
  return o.reshape(b, hq, vg.shape[-1]).astype(q.dtype), lse.reshape(b, hq)


_DECODE_IMPLEMENTATIONS = (None, "xla", "triton", "mosaic_tpu", "mosaic_gpu")


def _resolve_decode_implementation(implementation, platform=None):
  """None -> "triton" on GPU, "mosaic_tpu" on TPU, "xla" elsewhere (never "mosaic_gpu": not
  timed yet); other values unchanged."""
  if implementation is not None:
    return implementation
  platform = compat.default_backend() if platform is None else platform
  return {"gpu": "triton", "tpu": "mosaic_tpu"}.get(platform, "xla")


# The head-major path's Triton attention launch: 2 stages of 2 blocks (128 keys) per step. Run
# 79 (probe_sparse_decode.py --hnd, B1 S128K GQA 32:8 D128, top 19%): the attention alone 35.9
# / 40.1 us device (two timings) against 43.5 for the default 3 stages of 1 block; the whole
# call 43.5 / 51.8 against 55.3 / 62.7 us. On the head-major cache a kept block is one 16 KB
# run, so two per step are one 32 KB copy each for K and V; run 23 swept the strided ("nhd")
# cache, where 3 stages of 1 block stayed best. Each split loads its block ids once, before its
# loop (``prefetch_ids``): the attention by device kernel time 34.06 -> 33.03 us in run 90
# (the same output to the bit, tested on the GPU). Session 24: 3 stages of 1 block with the
# ids prefetched and one program per SM (``_hnd_triton_num_splits``: 16 splits at B1 with 8
# kv heads on an H200) took 32.74 / 32.94 / 32.94 / 33.38 us against 33.03 / 33.38 / 33.31 /
# 33.69 for 33 splits of 2 x 2 blocks in the same runs (runs 90-93, device kernel trace).
# On Hopper (227 KB of shared memory per SM) two blocks per step at 3 stages, one program per
# SM, took 32.0-32.1 us against 33.0-33.2 for one block (runs 96-97, three probe processes:
# the whole call 42.0-42.2 us, 3.00-3.02x dense decode by kernel sums). Its 3 x 2 x 2 tiles
# of 64 x 128 bf16 need 192 KB, so it is used where they fit in 200 KB on sm90 only;
# elsewhere 3 stages of one block (96 KB at that shape).
_HND_TRITON_LAUNCH = (("num_stages", 3), ("blocks_per_step", 1), ("prefetch_ids", True))
_HND_TRITON_LAUNCH_SM90 = (("num_stages", 3), ("blocks_per_step", 2), ("prefetch_ids", True),
                           ("merge_kernel", True))
# Session 25: on sm90 the splits are merged by a second kernel (``sparse_decode(...,
# merge_kernel=True)``): the last split's in-kernel merge added ~4.3 us to the attention
# kernel, the merge kernel takes 1.9 (run 105, experiments/probe_sparse_attention_parts.py).
# Through the API: 40.29-40.49 us per call against 42.34-42.42 with the in-kernel merge, dense
# decode 125.90-126.05: 3.11-3.13x by kernel sums (runs 106-108).


def _hnd_triton_launch(k, v, block_size):
  """The head-major path's Triton attention launch for this cache and device:
  ``_HND_TRITON_LAUNCH_SM90`` on compute capability 9.x when its K/V stages fit in 200 KB of
  shared memory, else ``_HND_TRITON_LAUNCH``."""
  cc = compat.gpu_compute_capability()
  opts = dict(_HND_TRITON_LAUNCH_SM90)
  need = (opts["num_stages"] * opts["blocks_per_step"] * block_size
          * (k.shape[-1] * k.dtype.itemsize + v.shape[-1] * v.dtype.itemsize))
  if cc is not None and cc[0] == 9 and need <= 200 * 1024:
    return _HND_TRITON_LAUNCH_SM90
  return _HND_TRITON_LAUNCH


def _hnd_triton_num_splits(sequences, width, *, core_count=None, min_blocks_per_split=4):
  """Default splits of the head-major path's Triton attention: one program per multiprocessor
  (floor(cores / sequences), at most one per ``min_blocks_per_split`` kept blocks) when that
  gives at least 8 splits (the measured regime: B1 with 8 kv heads), else
  ``pallas_kernels.sparse.decode.default_num_splits`` (about two programs per multiprocessor).

  Args:
    sequences: batch x kv_heads (the head-major cache's sequences of one kv head).
    width: kept-block list width.
    core_count: multiprocessors; default ``compat.gpu_core_count()`` (1 without a GPU).
    min_blocks_per_split: lower bound on the work of one split.

  Returns:
    An int >= 1.

  Example:
    >>> _hnd_triton_num_splits(8, 389, core_count=132)
    16
    >>> _hnd_triton_num_splits(64, 389, core_count=132)   # default_num_splits' choice
    5
  """
  from pallas_kernels.sparse.decode import default_num_splits
  cores = compat.gpu_core_count() if core_count is None else int(core_count)
  one_wave = min(cores // max(1, sequences), -(-int(width) // min_blocks_per_split))
  if one_wave >= 8:
    return int(one_wave)
  return default_num_splits(sequences, 1, width, core_count=cores,
                            min_blocks_per_split=min_blocks_per_split)


@functools.partial(jax.jit, static_argnames=(
    "block_size", "return_lse", "return_indices", "top_k", "num_init_blocks", "num_local_blocks",
    "scale", "implementation", "interpret", "num_splits", "fused_select", "score_splits",
    "_launch", "_select"))
def _hnd_decode(q, k, v, kv_lengths, block_summaries, *, block_size, return_lse,
                return_indices, _launch=(), _select=(), **kw):
  """Head-major contiguous cache: a free reshape to batch * kv_heads sequences of one kv head.

  Jitted, so that the reshapes are bitcasts even when the caller is not (outside a jit each
  reshape of the cache would be its own computation and copy it).

  k [b, hk, n, d] -> [b * hk, n, 1, d] (v likewise), q [b, hq, d] -> [b * hk, g, d] (query
  head h * g + i is query head i of sequence b * hk + h), lengths and summaries repeated per
  kv head; then the "nhd" path, and the results reshaped back. The batch x kv_heads programs of
  every kernel (and the default split counts, which depend on batch * kv_heads) are unchanged.
  The Triton kernels read the lengths of sequence b * kv_heads + h at b (``lengths_group``), so
  that path repeats nothing (two small XLA broadcasts fewer per call, ~1.8 us on the H200 in
  run 67); the other implementations get the repeated lengths.

  ``_launch``: the Triton attention's launch options as ((name, value), ...)
  (``_sparse_decode`` passes ``_HND_TRITON_LAUNCH``: the blocks are contiguous here).
  ``_select``: the Triton selection kernel's options as ((name, value), ...) (probes).
  """
  q2, k2, v2, lengths = _hnd_as_sequences(q, k, v, jnp.asarray(kv_lengths, jnp.int32))
  b, hk, n, d = k.shape
  hq = q.shape[1]
  nb = _cdiv(n, block_size)
  if block_summaries.block_size != block_size:
    raise ValueError(f"block_summaries.block_size={block_summaries.block_size} != "
                     f"block_size={block_size}")
  if block_summaries.sums.shape != (b, hk, nb, d):
    raise ValueError(f"block_summaries.sums {block_summaries.sums.shape} does not match the "
                     f"head-major cache {k.shape}: expected {(b, hk, nb, d)}")
  triton = _resolve_decode_implementation(kw["implementation"]) == "triton"
  if triton:       # lengths [b], read by sequence b * hk + h at b (no repeat)
    lengths, summary_lengths = jnp.asarray(kv_lengths, jnp.int32), block_summaries.lengths
  else:
    summary_lengths = jnp.repeat(block_summaries.lengths, hk)
  summ = BlockSummaries(sums=block_summaries.sums.reshape(b * hk, nb, 1, d),
                        lengths=summary_lengths, block_size=block_summaries.block_size)
  launch = tuple(_launch) if triton else ()
  if triton and kw["num_splits"] is None:
    kw["num_splits"] = _hnd_triton_num_splits(
        b * hk, _decode_width(nb, kw["top_k"], kw["num_init_blocks"], kw["num_local_blocks"]))
  out, lse, idx = _sparse_decode(q2, k2, v2, lengths, summ, None, block_size=block_size,
                                 return_lse=True, return_indices=True,
                                 _lengths_group=hk if triton else 1, _launch=launch,
                                 _select=tuple(_select) if triton else (), **kw)
  res = (out.reshape(b, hq, out.shape[-1]),)                               # [b, hq, dv]
  if return_lse:
    res += (lse.reshape(b, hq),)
  if return_indices:
    res += (idx.reshape(b, hk, idx.shape[-1]),)                            # [b, hk, ms]
  return res[0] if len(res) == 1 else res


def _sparse_decode(q, k, v, kv_lengths, block_summaries, page_table, *, block_size, top_k,
                   num_init_blocks, num_local_blocks, scale, return_lse, return_indices,
                   implementation, interpret, num_splits, fused_select=None, score_splits=None,
                   kv_layout="nhd", _lengths_group=1, _launch=(), _select=()):
  # _lengths_group (the head-major path on the Triton kernels only): kv_lengths and the
  # summaries' lengths hold one entry per that many consecutive sequences; _launch: the Triton
  # attention kernel's launch options ((name, value), ...), from the head-major path; _select:
  # the Triton selection's options (e.g. (("search_loop", "early"),)), from probes
  _check_kv_layout(kv_layout)
  if not isinstance(block_summaries, BlockSummaries):
    raise TypeError("block_summaries must be a BlockSummaries")
  if block_summaries.layout != kv_layout:
    raise ValueError(f"block_summaries.layout={block_summaries.layout!r} != "
                     f"kv_layout={kv_layout!r}: make the summaries with "
                     f"init_block_summaries(..., kv_layout={kv_layout!r})")
  if fused_select is None:   # one launch for scores + selection on the head-major Triton path
    fused_select = kv_layout == "hnd" and implementation in (None, "triton") and (
        _resolve_decode_implementation(implementation) == "triton")
  if kv_layout == "hnd":
    if page_table is not None:
      raise NotImplementedError("kv_layout='hnd' is for contiguous caches, not paged ones")
    return _hnd_decode(q, k, v, kv_lengths, block_summaries, block_size=block_size,
                       return_lse=return_lse, return_indices=return_indices, top_k=top_k,
                       num_init_blocks=num_init_blocks, num_local_blocks=num_local_blocks,
                       scale=scale, implementation=implementation, interpret=interpret,
                       num_splits=num_splits, fused_select=fused_select,
                       score_splits=score_splits,
                       _launch=_hnd_triton_launch(k, v, block_size))
  if q.ndim != 3:
    raise ValueError(f"q must be [batch, q_heads, head_dim], got {q.shape}")
  if k.ndim != 4 or v.ndim != 4 or v.shape[:3] != k.shape[:3]:
    raise ValueError(f"k/v must be [batch or pages, len, kv_heads, d] and agree in all but the "
                     f"last dim (v's head_dim may differ), got {k.shape} / {v.shape}")
  if q.shape[-1] != k.shape[-1] or q.shape[1] % k.shape[2]:
    raise ValueError(f"q {q.shape} does not match the cache {k.shape}")
  if page_table is None and q.shape[0] != k.shape[0]:
    raise ValueError(f"q batch {q.shape[0]} != cache batch {k.shape[0]}")
  if block_summaries.block_size != block_size:
    raise ValueError(f"block_summaries.block_size={block_summaries.block_size} != "
                     f"block_size={block_size}")
  nb = _cdiv(k.shape[1], block_size) if page_table is None else page_table.shape[1]
  if block_summaries.num_blocks != nb:
    raise ValueError(f"block_summaries has {block_summaries.num_blocks} blocks, the cache {nb}")
  if implementation not in _DECODE_IMPLEMENTATIONS:
    raise ValueError(f"sparse decode supports implementation None, 'xla', 'triton', "
                     f"'mosaic_tpu' or 'mosaic_gpu', got {implementation!r}")
  impl = _resolve_decode_implementation(implementation)
  if _select and impl != "triton":
    raise ValueError("_select is for the Triton selection kernels only")
  if fused_select not in (None, True, False, "all", "attend"):
    raise ValueError(f"fused_select must be None, True, False, 'all' or 'attend', got "
                     f"{fused_select!r}")
  if fused_select == "all" and (impl != "triton" or page_table is not None):
    raise ValueError("fused_select='all' (scores, selection and attention in one launch) is "
                     "for the 'triton' implementation on contiguous caches")
  if fused_select == "attend" and impl != "triton":
    raise ValueError("fused_select='attend' (the selection inside the attention kernel) is "
                     "for the 'triton' implementation")
  if score_splits is not None and not fused_select:
    raise ValueError("score_splits applies to fused_select=True only")
  if impl == "mosaic_tpu" and num_splits not in (None, 1):
    raise ValueError(f"num_splits applies to the Triton kernel only (the Mosaic TPU kernel "
                     f"walks each kv head's kept blocks in one pass), got {num_splits}")
  if impl == "mosaic_gpu":    # unsupported options raise now, naming them (not inside jit)
    from pallas_kernels.sparse import decode_mosaic_gpu as mg
    mg.check_options(block_size=block_size, head_dim=q.shape[-1], head_dim_v=v.shape[-1],
                     dtype=k.dtype, group=q.shape[1] // k.shape[2], interpret=interpret)
  if scale is None:
    scale = 1.0 / math.sqrt(q.shape[-1])
  sel_kw = dict(top_k=top_k, num_init_blocks=num_init_blocks, num_local_blocks=num_local_blocks)
  if impl == "xla":
    indices = _decode_select(q, block_summaries, kv_lengths, **sel_kw)
    out, lse = _sparse_decode_xla(q, k, v, kv_lengths, indices, page_table, block_size, scale)
  elif impl == "mosaic_tpu":
    # Selection in XLA (ascending lists, -1 padded); the kernel DMAs only the kept blocks.
    from pallas_kernels.sparse.decode_tpu import sparse_decode as tpu_sparse_decode
    indices = _decode_select(q, block_summaries, kv_lengths, **sel_kw)
    out, lse = tpu_sparse_decode(q, k, v, jnp.asarray(kv_lengths, jnp.int32), indices,
                                 page_table=page_table, block_size=block_size,
                                 scale=float(scale), interpret=interpret)
  else:
    # Three launches, no XLA glue: block scores (many programs over the fp32 key sums), the
    # selection (a threshold search, no sort; compact ascending lists, counts and zeroed
    # arrival counters), and the split-KV attention over the kept blocks whose last split to
    # finish per (batch, kv head) merges the splits (an atomic arrival counter). With
    # fused_select, the first two are one launch (scores, then the last score program of each
    # (batch, kv head) selects; a memset of its counters first when it has several).
    # "mosaic_gpu": the same selection, then the Mosaic GPU kernel (TMA reads of the kept
    # blocks) and the Triton merge kernel (four launches).
    _check_selection_args(block_size, 1, top_k, num_init_blocks, num_local_blocks)
    from pallas_kernels.sparse.decode_select import (decode_block_scores,
                                                     score_select_decode_slots,
                                                     select_decode_slots)
    lengths = jnp.asarray(kv_lengths, jnp.int32)
    width = _decode_width(nb, top_k, num_init_blocks, num_local_blocks)
    lg = {} if _lengths_group == 1 else dict(lengths_group=int(_lengths_group))
    if _lengths_group != 1 and impl != "triton":
      raise ValueError("_lengths_group is for the Triton kernels only")
    if fused_select == "attend":
      # scores (and zeroed arrival counters) in one launch, then every attention program
      # selects from its (batch, kv head)'s scores row itself before attending
      from pallas_kernels.sparse.decode_fused_select import sparse_decode_fused
      launch = dict(_launch)
      launch.pop("prefetch_ids", None)      # the ids come from the in-kernel selection
      launch.pop("merge_kernel", None)      # the merge stays in the attention kernel
      opts = dict(digit_bits=1, search_loop="early", lookup="scratch", **launch)
      opts.update(dict(_select))
      if score_splits is not None:
        raise ValueError("score_splits applies to fused_select=True only")
      out, lse, indices = sparse_decode_fused(
          q, k, v, lengths, block_summaries.sums, block_summaries.lengths, page_table,
          block_size=block_size, num_splits=num_splits, scale=float(scale), return_lse=True,
          return_indices=True, interpret=interpret, **sel_kw, **lg, **opts)
    elif fused_select == "all":
      from pallas_kernels.sparse.decode_one_launch import sparse_decode_one_launch
      out, lse, indices, _ = sparse_decode_one_launch(
          q, k, v, lengths, block_summaries.sums, block_summaries.lengths,
          block_size=block_size, max_selected=width, num_splits=num_splits,
          score_splits=score_splits, scale=float(scale), out_dtype=q.dtype,
          interpret=interpret, **sel_kw, **lg,
          **{k_: v_ for k_, v_ in _launch if k_ != "merge_kernel"}, **dict(_select))
    elif fused_select:
      indices, counts, arrivals = score_select_decode_slots(
          q, block_summaries.sums, block_summaries.lengths, lengths, block_size=block_size,
          max_selected=width, score_splits=score_splits, interpret=interpret,
          return_arrivals=True, **sel_kw, **lg, **dict(_select))
    else:
      scores = decode_block_scores(q, block_summaries.sums, block_summaries.lengths,
                                   block_size=block_size, interpret=interpret, **lg)
      indices, counts, arrivals = select_decode_slots(
          scores, lengths, block_size=block_size, max_selected=width, interpret=interpret,
          return_arrivals=True, **sel_kw, **lg, **dict(_select))
    if fused_select in ("all", "attend"):
      pass
    elif impl == "mosaic_gpu":
      from pallas_kernels.sparse import decode_mosaic_gpu as mg
      if num_splits is None:
        num_splits = mg.default_num_splits(q.shape[0], k.shape[2], width)
      out, lse = mg.sparse_decode(q, k, v, lengths, indices, page_table, counts,
                                  block_size=block_size, num_splits=int(num_splits),
                                  scale=float(scale), out_dtype=q.dtype)
    else:
      from pallas_kernels.sparse.decode import default_num_splits, sparse_decode
      if num_splits is None:
        num_splits = default_num_splits(q.shape[0], k.shape[2], width)
      out, lse = sparse_decode(q, k, v, lengths, indices, page_table, counts, arrivals,
                               block_size=block_size, num_splits=int(num_splits),
                               scale=float(scale), out_dtype=q.dtype, interpret=interpret, **lg,
                               **dict(_launch))
  res = (out,)
  if return_lse:
    res += (lse,)
  if return_indices:
    res += (indices,)
  return res[0] if len(res) == 1 else res


def sparse_decode_attention(q, k_cache, v_cache, kv_lengths, block_summaries, *, block_size,
                            top_k, num_init_blocks=1, num_local_blocks=1, scale=None,
                            return_lse=False, return_indices=False, implementation=None,
                            interpret=False, num_splits=None, fused_select=None,
                            score_splits=None, kv_layout="nhd"):
  """Decode attention of one new token per sequence over the top-K blocks of a contiguous cache.

  Selection (:func:`select_decode_blocks`, per kv head, shared by its query heads) from the
  block summaries, then attention over the kept blocks only (positions < kv_lengths); the result
  equals dense decode attention restricted to the kept blocks.

  Implementations:
    * "xla": gathers the kept blocks of each kv head (advanced indexing, never a copy of the whole
      cache), then one softmax.
    * "triton": three Pallas kernels: block scores and the top-k selection
      (``pallas_kernels.sparse.decode_select``, a threshold search instead of a sort), then the
      split-KV kernel whose per-kv-head block lists act as page tables and whose last split to
      finish per (batch, kv head) merges the splits by log-sum-exp
      (``pallas_kernels.sparse.decode.sparse_decode``). block_size must be a power of two >= 16.
      ``fused_select=True``: scores and selection in one kernel (two launches in all).
    * "mosaic_tpu": the selection in XLA, then one Pallas Mosaic TPU kernel
      (``pallas_kernels.sparse.decode_tpu``) with grid (batch, kv head, kept slot): the kept
      block ids, counts and page table are scalar-prefetched and the K/V index maps DMA only the
      kept blocks; one online softmax per GQA group. block_size must give DMAs of a multiple
      of 8 rows (16 for 16-bit caches); head dims that are not multiples of 128 with several
      kv heads read every head's rows of a kept block (see ``head_lanes_layout``).
    * "mosaic_gpu" (Hopper, sm90; GPU tests pass, not faster than "triton" in run 30, so
      never picked by None): the Triton
      selection kernels, then a Pallas Mosaic GPU kernel that reads only the kept blocks by TMA
      (``pallas_kernels.sparse.decode_mosaic_gpu``: the split-KV program of the Mosaic GPU
      decode kernel walking each kv head's list, default splits one CTA per SM) and the
      Triton merge kernel. bf16/fp16, head_dim 64/128/256 == head_dim_v, block_size a
      multiple of 64; other options raise NotImplementedError.
    * None: "triton" on GPU, "mosaic_tpu" on TPU, "xla" elsewhere.

  Cache layouts (``kv_layout``):
    * "nhd" (default): [batch, max_len, kv_heads, head_dim], as everywhere else in jattn. A kept
      block of one kv head is block_size rows of head_dim elements, kv_heads * head_dim apart.
    * "hnd": head-major [batch, kv_heads, max_len, head_dim]: a kept block of one kv head is one
      contiguous run. Every implementation runs it as a free reshape to a cache of batch *
      kv_heads sequences with one kv head each (the G query heads of kv head h, query heads
      h * G .. h * G + G - 1, become that sequence's query heads), then reshapes the results
      back: the same programs (and default split counts), the same selection and the same
      output as "nhd" on the transposed cache. The summaries must be made with the same
      layout (``init_block_summaries(..., kv_layout="hnd")``; a mismatch raises ValueError).
      On an H200 at B1 S128K GQA 32:8 D128, 64-token blocks, top 19% the Triton path ran
      1.13x faster on a head-major cache through this option (run 36: 49.0 vs 55.3 us, 2.96x
      dense decode on the default cache; run 40: 3.07x; docs/sparse.md). For "mosaic_tpu" with several
      kv heads and head dims that are not multiples of 128, "hnd" reads only the kept head's
      rows (one kv head per sequence, see ``head_lanes_layout``).

  Args:
    q: [batch, q_heads, head_dim]: the new token's queries (at position kv_lengths - 1).
    k_cache: [batch, max_len, kv_heads, head_dim] ("nhd") or [batch, kv_heads, max_len,
      head_dim] ("hnd"), holding the new token.
    v_cache: [batch, max_len, kv_heads, head_dim_v] ("nhd") or [batch, kv_heads, max_len,
      head_dim_v] ("hnd"); head_dim_v may differ from head_dim (MLA: values narrower than the
      rope-extended keys), on every implementation.
    kv_lengths: int [batch]: valid positions per sequence, including the new token.
    block_summaries: :class:`BlockSummaries` (``init_block_summaries`` /
      ``update_block_summaries``) with the same block_size and ``layout == kv_layout``.
    block_size: positions per block.
    top_k, num_init_blocks, num_local_blocks: selection sizes (as in :func:`select_blocks`).
    scale: logit scale, default 1/sqrt(head_dim).
    return_lse: also return lse [batch, q_heads] (fp32, natural log, -inf if empty).
    return_indices: also return the kept block ids [batch, kv_heads, max_selected] (-1 padded).
    implementation: None, "xla", "triton", "mosaic_tpu" or "mosaic_gpu".
    interpret: run the Pallas kernel in interpret mode (CPU tests; the TPU interpreter for
      "mosaic_tpu"; "mosaic_gpu" raises NotImplementedError).
    num_splits: Triton splits per (batch, kv head); default
      ``pallas_kernels.sparse.decode.default_num_splits`` (about two programs per SM;
      "mosaic_gpu": ``pallas_kernels.sparse.decode_mosaic_gpu.default_num_splits``, one). The
      Mosaic TPU kernel has no splits (None or 1).
    fused_select: "triton" and "mosaic_gpu" (the others select in XLA and ignore it): the
      block scores and the selection in one launch
      (``pallas_kernels.sparse.decode_select.score_select_decode_slots``) instead of two; the
      same selection and output to the bit. Default None: True on the head-major cache
      (``kv_layout="hnd"``) with "triton" (run 87, H200, B1 S128K GQA 32:8, 19% of 64-token
      blocks, device kernel trace: 46.8 us per call against 48.3 for two launches), False
      otherwise (two launches). "all" ("triton", contiguous caches): the scores, the
      selection and the attention in one launch
      (``pallas_kernels.sparse.decode_one_launch``: the attention's programs load their
      queries while the selection runs and start on their kv head's list once it is
      ready); the same selection, and the same output up to the attention's rounding.
      Slower on the H200 (run 93: 46.6-57.8 us per call against 43.7 for the default, B1
      S128K GQA 32:8, head-major), so never the default. "attend" ("triton"): the scores
      (and the zeroed arrival counters) in one launch, then the attention kernel whose every
      program runs the selection of its (batch, kv head) itself before attending
      (``pallas_kernels.sparse.decode_fused_select``: no single-program selection between the
      launches, the search repeated by each split); the same selection and output. On the
      H200 (run 102, head-major, B1 S128K GQA 32:8): 41.98 us per call against 42.27 for the
      default, within 1%; not the default, as at large batch every program repeats the
      search.
    score_splits: with ``fused_select``: score programs per (batch, kv head); default
      ``pallas_kernels.sparse.decode_select.default_score_splits`` (32 at B1, 8 kv heads,
      2048 blocks on an H200; 1, i.e. no counters and no memset, once batch x kv_heads fills
      the GPU).
    kv_layout: "nhd" (default) or "hnd": the cache layout, see above.

  Returns:
    out [batch, q_heads, head_dim_v] in q.dtype; then lse [batch, q_heads] and/or indices
    [batch, kv_heads, max_selected] if requested (the same shapes for both layouts).

  Example:
    >>> k = jax.random.normal(jax.random.key(0), (1, 512, 2, 16))
    >>> lens = jnp.array([300])
    >>> s = init_block_summaries(k, lens, block_size=64)
    >>> q = jax.random.normal(jax.random.key(1), (1, 4, 16))
    >>> out = sparse_decode_attention(q, k, k, lens, s, block_size=64, top_k=1,
    ...                               implementation="xla")
    >>> out.shape
    (1, 4, 16)
    >>> kh = jnp.swapaxes(k, 1, 2)                      # head-major [1, 2, 512, 16]
    >>> sh = init_block_summaries(kh, lens, block_size=64, kv_layout="hnd")
    >>> out_h = sparse_decode_attention(q, kh, kh, lens, sh, block_size=64, top_k=1,
    ...                                 implementation="xla", kv_layout="hnd")
    >>> bool(jnp.allclose(out_h, out, atol=1e-5))
    True
  """
  return _sparse_decode(q, k_cache, v_cache, kv_lengths, block_summaries, None,
                        block_size=block_size, top_k=top_k, num_init_blocks=num_init_blocks,
                        num_local_blocks=num_local_blocks, scale=scale, return_lse=return_lse,
                        return_indices=return_indices, implementation=implementation,
                        interpret=interpret, num_splits=num_splits, fused_select=fused_select,
                        score_splits=score_splits, kv_layout=kv_layout)


def sparse_paged_decode_attention(q, k_pages, v_pages, page_table, kv_lengths, block_summaries, *,
                                  top_k, num_init_blocks=1, num_local_blocks=1, scale=None,
                                  return_lse=False, return_indices=False, implementation=None,
                                  interpret=False, num_splits=None, fused_select=None,
                                  score_splits=None):
  """:func:`sparse_decode_attention` over a paged cache; blocks are pages (block = page size).

  Args:
    q: [batch, q_heads, head_dim].
    k_pages: [num_pages, page_size, kv_heads, head_dim].
    v_pages: [num_pages, page_size, kv_heads, head_dim_v] (head_dim_v may differ, as in
      :func:`sparse_decode_attention`).
    page_table: int32 [batch, max_pages]: token t of sequence b lives in page
      ``page_table[b, t // page_size]``, slot ``t % page_size``.
    kv_lengths: int [batch], including the new token.
    block_summaries: :class:`BlockSummaries` with block_size == page_size and max_pages blocks
      (``init_block_summaries(k_pages, lens, block_size=page_size, page_table=page_table)``;
      layout "nhd": paged caches have no head-major option).
    top_k, num_init_blocks, num_local_blocks, scale, return_lse, return_indices, implementation,
      interpret, num_splits, fused_select, score_splits: as in :func:`sparse_decode_attention`.

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
  return _sparse_decode(q, k_pages, v_pages, kv_lengths, block_summaries, page_table,
                        block_size=k_pages.shape[1], top_k=top_k,
                        num_init_blocks=num_init_blocks, num_local_blocks=num_local_blocks,
                        scale=scale, return_lse=return_lse, return_indices=return_indices,
                        implementation=implementation, interpret=interpret,
                        num_splits=num_splits, fused_select=fused_select,
                        score_splits=score_splits)


# ----------------------------------------------------------------------------- benchmarks
def causal_top_k_for_density(seq_len, fraction, *, block_size, q_block_size, num_init_blocks=1,
                             num_local_blocks=1):
  """The top_k whose causal selection keeps about ``fraction`` of the causal (visible) tiles.

  Query block i keeps its forced (initial + local) blocks plus min(top_k, remaining visible);
  the returned top_k makes the kept total closest to fraction * visible total.

  Args:
    seq_len: query and key length (self-attention).
    fraction: target fraction of causally visible tiles, e.g. 0.19.
    block_size, q_block_size: selection block sizes.
    num_init_blocks, num_local_blocks: always-kept blocks.

  Returns:
    (top_k, achieved_fraction).

  Example:
    >>> causal_top_k_for_density(65536, 0.19, block_size=128, q_block_size=128)[0]
    49
  """
  n_vis, n_forced, _, _ = _static_counts(seq_len, seq_len, q_block_size, block_size, True,
                                         num_init_blocks, num_local_blocks, 0)
  n_cand = n_vis - n_forced
  ks = np.arange(_cdiv(seq_len, block_size) + 1)
  kept = (n_forced[None, :] + np.minimum(ks[:, None], n_cand[None, :])).sum(1) / n_vis.sum()
  k = int(np.argmin(np.abs(kept - fraction)))
  return k, float(kept[k])


def bench_cases(time_fn, rel_err, *, seqs=(16384, 65536), heads=16, head_dim=128,
                configs=((128, 64), (128, 128)), fraction=0.19, implementation="triton",
                decode_len=131072, decode_heads=(32, 8), decode_block_size=64,
                ste_seqs=(16384,), extra_impls=()):
  """H200 benchmark rows for ``experiments/bench_kernels.py --ops sparse``.

  Training (B1, H16, D128, bf16, causal): dense ``flash_attention(causal=True)`` versus
  ``sparse_attention(gate_grad="none")``, forward+backward, the sparse time including scoring,
  top-k and schedule building, keeping ~19% of the causal tiles (top_k from
  :func:`causal_top_k_for_density`). Block configs (q_block_size, block_size): (128, 64) first,
  the Triton kernel's default 128x64 tile and InfLLM's 64-token key blocks (the recommended
  setting), then (128, 128) (FlexAttention's block size in the anchors).
  Rows: op "sparse_fwdbwd" (dense and sparse ms), "sparse_select" (scoring + top-k + schedule ms
  and its fraction of the sparse time), "sparse_speedup" (dense / sparse); at ``ste_seqs`` also
  the gate_grad="ste" fwd+bwd time (its extra XLA gate-gradient pass).
  Each of ``extra_impls`` (e.g. "mosaic_gpu": the Hopper forward and, at D64/D128, the Mosaic
  GPU backward walking the same selection's schedule) is timed on the same inputs right after
  ``implementation``'s sparse row: op "sparse_fwdbwd", impl ``jattn_<name>_sparse`` (its forward
  checked like the first; its gradients compared with ``implementation``'s, ``grad_rel_err``;
  ``vs_sparse``: ``implementation``'s sparse ms / its ms) and op "sparse_speedup" against the
  same dense row (``speedup``) and against its own dense causal kernel (a
  ``jattn_<name>_dense`` row timed after the first dense one: ``speedup_vs_own_dense``).
  A failure is recorded as a row with ok False.
  Decode (B1, GQA 32:8, D128, bf16, 128K, 64-token blocks, ~19% of blocks): dense
  ``jattn.decode.decode_attention`` vs :func:`sparse_decode_attention` ("triton" and "xla"),
  selection included; op "sparse_decode" and "sparse_decode_speedup".

  Args:
    time_fn: ``time_fn(fn, arg_sets) -> (median_ms, spread_ms)`` (bench_kernels.time_fn).
    rel_err: ``rel_err(x, ref) -> float``.
    seqs, heads, head_dim, configs, fraction, implementation: training cases.
    ste_seqs: sequence lengths at which the STE variant is timed too (first config only).
    extra_impls: further implementations timed on the sparse training cases (not decode).
    decode_len, decode_heads, decode_block_size: the decode case.

  Returns:
    A list of row dicts (op, case, impl, ms, speedup, rel_err, ok, ...).

  Example:
    >>> rows = bench_cases(time_fn, rel_err)   # doctest: +SKIP
  """
  rows = []
  for s in seqs:
    keys = jax.random.split(jax.random.key(s), 12)
    sets = [tuple(jax.random.normal(keys[4 * i + j], (1, s, heads, head_dim), jnp.bfloat16)
                  for j in range(4)) for i in range(3)]

    def fwdbwd(attn):
      def f(q, k, v, do):
        out, vjp = jax.vjp(attn, q, k, v)
        return out, vjp(do)
      return jax.jit(f)

    base = f"B1 S{s // 1024}K H{heads} D{head_dim} causal"
    try:
      dense = fwdbwd(lambda q, k, v: _dense_flash(q, k, v, implementation))
      ms_dense, sp_dense = time_fn(dense, sets)
      rows.append(dict(op="sparse_fwdbwd", case=base, impl=f"jattn_{implementation}_dense",
                       ms=ms_dense, spread_ms=sp_dense))
    except Exception as e:
      rows.append(dict(op="sparse_fwdbwd", case=base, impl=f"jattn_{implementation}_dense",
                       ok=False, error=f"{type(e).__name__}: {e}"[:500]))
      continue
    dense_extra = {}   # each extra implementation's own dense causal kernel (e.g. Hopper's)
    for extra in extra_impls:
      try:
        ms_x, sp_x = time_fn(fwdbwd(lambda q, k, v, extra=extra: _dense_flash(q, k, v, extra)),
                             sets)
        dense_extra[extra] = ms_x
        rows.append(dict(op="sparse_fwdbwd", case=base, impl=f"jattn_{extra}_dense", ms=ms_x,
                         spread_ms=sp_x))
      except Exception as e:
        rows.append(dict(op="sparse_fwdbwd", case=base, impl=f"jattn_{extra}_dense", ok=False,
                         error=f"{type(e).__name__}: {e}"[:500]))
    for qbs, bs in configs:
      top_k, frac = causal_top_k_for_density(s, fraction, block_size=bs, q_block_size=qbs)
      case = f"{base} top{fraction:.0%} q{qbs} k{bs}"
      kw = dict(block_size=bs, q_block_size=qbs, top_k=top_k, implementation=implementation)
      try:
        sparse = fwdbwd(lambda q, k, v: sparse_attention(q, k, v, **kw))

        def select_only(q, k, v, do):
          sel = select_blocks(q, k, block_size=bs, q_block_size=qbs, top_k=top_k)
          sched = make_schedule(s, s, qbs, bs, causal=True, block_mask=sel.tile_mask(),
                                max_kv_blocks=sel.max_selected)
          return sched.kv_indices, sched.q_indices

        # Correctness: last 512 queries of two heads against the fp32 reference.
        q, k, v, _ = sets[0]
        out, sel = jax.jit(lambda q, k, v: sparse_attention(q, k, v, return_selection=True,
                                                            **kw))(q, k, v)
        tail = 512
        nqt = tail // qbs
        sub = BlockSelection(indices=sel.indices[:, :2, -nqt:], counts=sel.counts[:, :2, -nqt:],
                             num_visible=sel.num_visible[:, :2, -nqt:], scores=None,
                             block_size=bs, q_block_size=qbs, q_len=tail, kv_len=s)
        ref = block_sparse_attention(q[:, -tail:, :2], k[:, :, :2], v[:, :, :2], sub,
                                     implementation="xla")
        err = rel_err(out[:, -tail:, :2], ref)
        ok = bool(err < 2e-2)
        ms_sparse, sp_sparse = time_fn(sparse, sets)
        ms_sel, _ = time_fn(jax.jit(select_only), sets)
        dens = float(sel.density("visible"))
        rows.append(dict(op="sparse_fwdbwd", case=case, impl=f"jattn_{implementation}_sparse",
                         ms=ms_sparse, spread_ms=sp_sparse, top_k=top_k, causal_fraction=dens,
                         rel_err=err, ok=ok))
        rows.append(dict(op="sparse_select", case=case, impl="jattn_xla", ms=ms_sel,
                         select_frac=ms_sel / ms_sparse))
        rows.append(dict(op="sparse_speedup", case=case, impl=f"jattn_{implementation}",
                         speedup=ms_dense / ms_sparse, dense_ms=ms_dense, sparse_ms=ms_sparse,
                         select_ms=ms_sel, causal_fraction=dens, ok=ok))
        for extra in extra_impls:
          rows += _bench_extra_sparse(extra, kw, fwdbwd, sparse, sets, time_fn, rel_err, case,
                                      ref, tail, ms_dense, ms_sparse, top_k, dens,
                                      ms_own_dense=dense_extra.get(extra))
        if s in ste_seqs and (qbs, bs) == tuple(configs[0]):
          ste = fwdbwd(lambda q, k, v: sparse_attention(q, k, v, gate_grad="ste", **kw))
          ms_ste, sp_ste = time_fn(ste, sets)
          rows.append(dict(op="sparse_fwdbwd", case=case,
                           impl=f"jattn_{implementation}_sparse_ste", ms=ms_ste,
                           spread_ms=sp_ste, ste_overhead=ms_ste / ms_sparse))
      except Exception as e:  # record the failure, keep benchmarking
        rows.append(dict(op="sparse_speedup", case=case, impl=f"jattn_{implementation}",
                         ok=False, error=f"{type(e).__name__}: {e}"[:500]))

  # Decode at 128K.
  hq, hk = decode_heads
  n = decode_len
  nb = n // decode_block_size
  top_k = max(0, int(round(fraction * nb)) - 2)
  case = f"B1 S{n // 1024}K GQA{hq}:{hk} D{head_dim} top{fraction:.0%} blk{decode_block_size}"
  try:
    keys = jax.random.split(jax.random.key(7), 9)
    lens = jnp.array([n], jnp.int32)
    sets = []
    for i in range(3):
      q = jax.random.normal(keys[3 * i], (1, hq, head_dim), jnp.bfloat16)
      kc = jax.random.normal(keys[3 * i + 1], (1, n, hk, head_dim), jnp.bfloat16)
      vc = jax.random.normal(keys[3 * i + 2], (1, n, hk, head_dim), jnp.bfloat16)
      sets.append((q, kc, vc, init_block_summaries(kc, lens, block_size=decode_block_size)))
    q, kc, vc, summ = sets[0]
    _, idx = sparse_decode_attention(q, kc, vc, lens, summ, block_size=decode_block_size,
                                     top_k=top_k, implementation="xla", return_indices=True)
    sel = jnp.zeros((1, hk, nb + 1), bool).at[0, jnp.arange(hk)[:, None],
                                               jnp.where(idx[0] < 0, nb, idx[0])].set(True)
    mask = jnp.repeat(sel[..., :nb], decode_block_size, axis=-1)[:, :, None, :]
    ref, _ = attention_reference(q[:, None], kc, vc, block_mask=mask)
    ref = ref[:, 0]
    ms_dense = None
    try:
      from jattn import decode as dec
      dense = jax.jit(lambda q, kc, vc, summ: dec.decode_attention(q, kc, vc, lens,
                                                                   implementation=implementation))
      ms_dense, sp_dense = time_fn(dense, sets)
      rows.append(dict(op="sparse_decode", case=case, impl=f"jattn_{implementation}_dense",
                       ms=ms_dense, spread_ms=sp_dense))
    except Exception as e:
      rows.append(dict(op="sparse_decode", case=case, impl=f"jattn_{implementation}_dense",
                       ok=False, error=f"{type(e).__name__}: {e}"[:500]))
    for impl in dict.fromkeys((implementation, "xla")):
      try:
        sparse = jax.jit(functools.partial(sparse_decode_attention, kv_lengths=lens,
                                           block_size=decode_block_size, top_k=top_k,
                                           implementation=impl))
        err = rel_err(sparse(q, kc, vc, block_summaries=summ), ref)
        ms_sparse, sp_sparse = time_fn(
            lambda q, kc, vc, summ: sparse(q, kc, vc, block_summaries=summ), sets)
        rows.append(dict(op="sparse_decode", case=case, impl=f"jattn_sparse_{impl}",
                         ms=ms_sparse, spread_ms=sp_sparse, top_k=top_k, rel_err=err,
                         ok=bool(err < 2e-2)))
        if ms_dense is not None:
          rows.append(dict(op="sparse_decode_speedup", case=case, impl=f"jattn_sparse_{impl}",
                           speedup=ms_dense / ms_sparse, dense_ms=ms_dense, sparse_ms=ms_sparse,
                           ok=bool(err < 2e-2)))
      except Exception as e:
        rows.append(dict(op="sparse_decode_speedup", case=case, impl=f"jattn_sparse_{impl}",
                         ok=False, error=f"{type(e).__name__}: {e}"[:500]))
  except Exception as e:
    rows.append(dict(op="sparse_decode_speedup", case=case, impl="jattn_sparse", ok=False,
                     error=f"{type(e).__name__}: {e}"[:500]))
  return rows


def _bench_extra_sparse(impl, kw, fwdbwd, base_fn, sets, time_fn, rel_err, case, ref, tail,
                        ms_dense, ms_base, top_k, dens, ms_own_dense=None):
  """``bench_cases``'s rows for one more implementation of the same sparse training case: its
  fwd+bwd time, forward error against ``ref`` (last ``tail`` queries of two heads), gradient
  error against the first implementation's (``base_fn``) and the speedups (against the first
  implementation's dense kernel, ``speedup``, and against its own, ``speedup_vs_own_dense``,
  when ``ms_own_dense`` was timed)."""
  name = f"jattn_{impl}_sparse"
  kw = dict(kw, implementation=impl)
  try:
    fn = fwdbwd(lambda q, k, v: sparse_attention(q, k, v, **kw))
    out, grads = fn(*sets[0])
    _, base_grads = base_fn(*sets[0])
    err = rel_err(out[:, -tail:, :2], ref)
    grad_err = max(rel_err(g, b) for g, b in zip(grads, base_grads))
    ok = bool(err < 2e-2 and grad_err < 2e-2)
    ms, spread = time_fn(fn, sets)
    return [dict(op="sparse_fwdbwd", case=case, impl=name, ms=ms, spread_ms=spread, top_k=top_k,
                 causal_fraction=dens, rel_err=err, grad_rel_err=grad_err, vs_sparse=ms_base / ms,
                 ok=ok),
            dict(op="sparse_speedup", case=case, impl=f"jattn_{impl}", speedup=ms_dense / ms,
                 dense_ms=ms_dense, sparse_ms=ms, causal_fraction=dens, ok=ok,
                 **({} if ms_own_dense is None else dict(
                     own_dense_ms=ms_own_dense, speedup_vs_own_dense=ms_own_dense / ms)))]
  except Exception as e:  # record the failure, keep benchmarking
    return [dict(op="sparse_fwdbwd", case=case, impl=name, ok=False,
                 error=f"{type(e).__name__}: {e}"[:500])]


def _dense_flash(q, k, v, implementation):
  """Dense causal flash attention (the bench baseline); see ``jattn.flash_attention``."""
  from jattn.attention import flash_attention
  return flash_attention(q, k, v, causal=True, implementation=implementation)
