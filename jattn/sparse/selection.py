"""Block scores and top-K block selection (InfLLM v2 / MoBA / NSA style): :func:`block_scores`,
:func:`select_blocks` -> :class:`BlockSelection`."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jattn._validate import check_flags, check_int, check_qkv, check_range, check_segments
from pallas_kernels.block_schedule import compact_true, segment_tile_classes
from pallas_kernels.common.util import cdiv, one_program, pad_axis
from pallas_kernels.sparse import topk as topk_kernel

__all__ = ["BlockSelection", "block_scores", "select_blocks"]

_HIGHEST = jax.lax.Precision.HIGHEST


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockSelection:
  """The key blocks kept for every (batch, kv head, query block): a top-K block-sparse mask.

  Attributes:
    indices: int32 [batch, kv_heads, num_q_blocks, max_selected]: kept ids ascending, then -1.
    counts: int32 [batch, kv_heads, num_q_blocks]: number of kept blocks.
    num_visible: int32 [batch, kv_heads or 1, num_q_blocks]: number of selectable blocks.
    scores: None or fp32 [batch, kv_heads, num_q_blocks, num_kv_blocks]: the ranked scores.
    block_size, q_block_size: keys per key block, queries per query block (static).
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
    return cdiv(self.q_len, self.q_block_size)

  @property
  def num_kv_blocks(self) -> int:
    return cdiv(self.kv_len, self.block_size)

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
    (b, h, nq, _), nk = self.indices.shape, self.num_kv_blocks
    cols = jnp.where(self.indices < 0, nk, self.indices)              # sentinel -> spare column
    bi, hi, qi, _ = jnp.indices((b, h, nq, 1), sparse=True)
    return jnp.zeros((b, h, nq, nk + 1), bool).at[bi, hi, qi, cols].set(True)[..., :nk]

  def to_mask(self, q_len=None, kv_len=None):
    """Element-level expansion of the block mask (no causal or segment mask applied).

    Args:
      q_len, kv_len: must equal the selection's lengths (the default).

    Returns:
      bool [batch, kv_heads, q_len, kv_len]: True where key j's block is kept for query i's block.

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
    m = jnp.repeat(self.tile_mask(), self.q_block_size, axis=2)[:, :, :q_len]
    return jnp.repeat(m, self.block_size, axis=3)[..., :kv_len]

  def density(self, relative_to="all"):
    """Fraction of blocks kept, averaged over batch, kv heads and query blocks.

    Args:
      relative_to: "all" (kept / num_kv_blocks) or "visible" (kept / selectable blocks).

    Returns:
      fp32 scalar.

    Example:
      >>> q = jax.random.normal(jax.random.key(0), (1, 256, 1, 16))
      >>> float(select_blocks(q, q, block_size=64, top_k=1, num_local_blocks=0,
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


def block_mean(x, valid, block):
  """Mean of x [b, n, h, d] over blocks of the sequence axis, over ``valid`` [b, n] positions; a
  non-finite mean counts as 0 (a NaN / inf key never makes a score, or its gradient, NaN)."""
  b, n, h, d = x.shape
  nb = cdiv(n, block)
  w = jnp.ones((b, n), jnp.float32) if valid is None else valid.astype(jnp.float32)
  xf = jnp.where(w[:, :, None, None] > 0, x.astype(jnp.float32), 0.0)   # padding: never read
  xf = pad_axis(xf, 1, nb * block).reshape(b, nb, block, h, d)
  cnt = pad_axis(w, 1, nb * block).reshape(b, nb, block).sum(-1)      # [b, nb]
  mean = xf.sum(2) / jnp.maximum(cnt, 1.0)[:, :, None, None]            # [b, nb, h, d]
  return jnp.where(jnp.isfinite(mean), mean, 0.0)


def block_scores(q, k, *, block_size=64, q_block_size=64, segment_ids=None, kv_segment_ids=None):
  """Mean-pooled block scores (InfLLM v2 / MoBA): the ranking ``select_blocks`` uses.

  score[b, g, i, j] = sum over the group's query heads of mean(q block i) . mean(k block j)
  (means over non-padding positions). Unscaled.

  Args:
    q: [batch, q_len, q_heads, head_dim].
    k: [batch, kv_len, kv_heads, head_dim]; q_heads % kv_heads == 0.
    block_size, q_block_size: keys per key block, queries per query block (1: per token).
    segment_ids, kv_segment_ids: None or int [batch, q_len] / [batch, kv_len] (0 = padding).

  Returns:
    fp32 [batch, kv_heads, num_q_blocks, num_kv_blocks]; differentiable in q and k.

  Example:
    >>> q = jax.random.normal(jax.random.key(0), (1, 100, 4, 16))
    >>> k = jax.random.normal(jax.random.key(1), (1, 100, 2, 16))
    >>> block_scores(q, k, block_size=32, q_block_size=16).shape
    (1, 2, 7, 4)
  """
  check_selection_args(block_size, q_block_size, 1, 0, 0)
  b, q_len, kv_len, _, _ = check_qkv(q, k, k)
  segment_ids, kv_segment_ids = check_segments(segment_ids, kv_segment_ids, b, q_len, kv_len)
  qv = None if segment_ids is None else segment_ids != 0
  kv = None if kv_segment_ids is None else kv_segment_ids != 0
  return pooled_scores(block_mean(q, qv, q_block_size), block_mean(k, kv, block_size))


def pooled_scores(qbar, kbar):
  """``block_scores`` of pooled queries [b, nq, hq, d] and keys [b, nk, hk, d] (fp32)."""
  b, nq, _, d = qbar.shape
  qsum = qbar.reshape(b, nq, kbar.shape[2], -1, d).sum(3)        # [b, nq, hk, d]
  return jnp.einsum("bihd,bjhd->bhij", qsum, kbar, precision=_HIGHEST)


def _row_geometry(xp, q_len, kv_len, q_block_size, block_size, num_local):
  """Per query block: last query position and the local key-block range [lo, hi] (numpy or jnp)."""
  i, off = xp.arange(cdiv(q_len, q_block_size)), kv_len - q_len
  q_first = i * q_block_size + off                                  # absolute positions
  q_last = xp.minimum((i + 1) * q_block_size, q_len) - 1 + off
  lo = xp.maximum(q_first, 0) // block_size - (num_local - 1)
  hi = xp.where(q_last >= 0, q_last // block_size, -1)
  return q_last, lo, hi


@functools.lru_cache(maxsize=256)
def _static_counts(q_len, kv_len, q_block_size, block_size, causal, num_init, num_local, top_k,
                   per_doc_init=False):
  """From shapes alone (numpy): (max_selected, local_width). ``per_doc_init`` (initial blocks at
  each document's start, unknown from shapes) counts every visible local block as non-initial;
  under ``causal`` max_selected stays exact (a local range overlapping the initial blocks covers
  all visible ones)."""
  nk = cdiv(kv_len, block_size)
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
  budget = row_budget(top_k, nk)
  kept = (n_forced + np.minimum(min(top_k, nk), n_vis - n_forced) if budget is None
          else np.maximum(n_forced, budget[n_vis]))
  return int(max(1, kept.max())), width


def segment_ranges(seg, block):
  """Per-block (min, max) nonzero id of seg [b, n]; only 0 is padding (negative ids are
  documents); a block with no document gets (INT32_MAX, INT32_MIN): min <= max iff it has one."""
  return segment_tile_classes(seg, seg.shape[1], block)[:2]


def segment_overlap(q_seg, kv_seg, q_block_size, block_size, ranges=None):
  """bool [b, nq, nk]: blocks i and j both hold documents and their nonzero id ranges meet.
  ``ranges``: None, or the ``segment_ranges`` ((q min, q max), (k min, k max)) to use instead.
  Exact for packed rows; else it may keep a block with no common id (the element mask applies)."""
  (qmn, qmx), (kmn, kmx) = ranges or (segment_ranges(q_seg, q_block_size),
                                      segment_ranges(kv_seg, block_size))
  qmn, qmx = qmn[:, :, None], qmx[:, :, None]
  kmn, kmx = kmn[:, None, :], kmx[:, None, :]
  return (qmn <= qmx) & (kmn <= kmx) & (qmn <= kmx) & (kmn <= qmx)


def doc_start_blocks(q_seg, kv_seg, q_block_size, block_size, ranges=None):
  """int32 [b, nq]: the key block of the first key of query block i's document (its minimum
  nonzero id d), nk for an all-padding query block (``ranges``: as for ``segment_overlap``):
  the first document block whose running maximum id reaches d. Exact for packed rows; otherwise
  some block holding an id >= d, or nk (kept only if selectable, so safe)."""
  (qmn, qmx), (kmn, kmx) = ranges or (segment_ranges(q_seg, q_block_size),   # [b, nq]
                                      segment_ranges(kv_seg, block_size))     # [b, nk]
  nk = kmx.shape[1]
  reach = jax.lax.cummax(kmx, axis=1)                                # [b, nk]
  start = jax.vmap(functools.partial(jnp.searchsorted, side="left"))(reach, qmn)
  has = kmn <= kmx                                                   # [b, nk]
  first = jnp.where(jnp.any(has, axis=1), jnp.argmax(has, axis=1), nk)            # [b]
  start = jnp.maximum(start, first[:, None])
  return jnp.where(qmn <= qmx, start, nk).astype(jnp.int32)


def segment_rules(q_seg, kv_seg, q_block_size, block_size):
  """(``segment_overlap``, ``doc_start_blocks``) of the ids, or (None, None) without ids."""
  if q_seg is None:
    return None, None
  return (segment_overlap(q_seg, kv_seg, q_block_size, block_size),
          doc_start_blocks(q_seg, kv_seg, q_block_size, block_size))


def select_lists(rank, *, q_len, kv_len, q_block_size, block_size, causal, num_init, num_local,
                 top_k, seg_ok, scores, doc_start=None, rows=None):
  """A BlockSelection from ranking scores rank [b, hk, nq, nk] (higher = kept first); its lists
  hold no duplicates. rows: None, or int [n], the query blocks of rank's n rows (>= nq: padding,
  nothing kept). seg_ok, doc_start: both None, or ``segment_overlap`` and ``doc_start_blocks``
  (the initial blocks then start at doc_start[b, i])."""
  max_sel, _ = _static_counts(q_len, kv_len, q_block_size, block_size, bool(causal), num_init,
                              num_local, top_k, per_doc_init=doc_start is not None)
  (b, hk, nq, nk), rank = rank.shape, jax.lax.stop_gradient(rank).astype(jnp.float32)
  cand, vis, fidx = candidates(b, hk, q_len=q_len, kv_len=kv_len, q_block_size=q_block_size,
                                block_size=block_size, causal=causal, num_init=num_init,
                                num_local=num_local, seg_ok=seg_ok, doc_start=doc_start)
  if rows is not None:
    nq_all = cdiv(q_len, q_block_size)
    ok = (rows < nq_all)[:, None]
    take = lambda x: jnp.take(x, jnp.minimum(rows, nq_all - 1), axis=2)
    cand, vis, fidx = take(cand) & ok, take(vis) & ok, jnp.where(ok, take(fidx), -1)
  k_eff, limit = top_k_cut(top_k, nk, jnp.sum(vis, -1), jnp.sum(vis & ~cand, -1))
  cand_b = jnp.broadcast_to(cand, (b, hk, nq, nk))
  by_sort = functools.partial(_selected_lists_by_sort, k=k_eff, max_sel=max_sel,
                              **({} if limit is None else {"limit": limit}))
  if k_eff > 0 and nk <= topk_kernel.MAX_ROW and limit is None:   # GPU: top-k mask kernel
    by_mask = functools.partial(_selected_lists_by_mask, k=k_eff, max_sel=max_sel,
                                keep_fn=topk_kernel.top_k_mask)
    indices = jax.lax.platform_dependent(rank, cand_b, fidx, vis, cuda=by_mask, default=by_sort)
  else:
    indices = by_sort(rank, cand_b, fidx, vis)
  return BlockSelection(indices=indices, counts=jnp.sum(indices >= 0, axis=-1).astype(jnp.int32),
                        num_visible=jnp.sum(vis, axis=-1).astype(jnp.int32), block_size=block_size,
                        q_block_size=q_block_size, q_len=q_len, kv_len=kv_len, scores=scores)


def _selected_lists_by_sort(rank, cand, fidx, visible, *, k, max_sel, limit=None):
  """``select_lists``'s lists int32 [b, hk, nq, max_sel]: ``lax.top_k`` of the candidates (the
  first ``limit`` [..., nq] of each row's k, if given) and ``fidx``, ascending, then -1."""
  del visible
  nk, parts = rank.shape[-1], [fidx]
  if k > 0:
    _, tidx = jax.lax.top_k(jnp.where(cand, rank, -jnp.inf), k)      # [b, hk, nq, k]
    tvalid = jnp.take_along_axis(cand, tidx, axis=-1)
    tvalid = tvalid if limit is None else tvalid & (jnp.arange(k) < limit[..., None])
    parts.append(jnp.where(tvalid, tidx, -1).astype(jnp.int32))
  allidx = jnp.concatenate(parts, axis=-1)
  srt = jnp.sort(jnp.where(allidx < 0, nk, allidx), axis=-1)[..., :max_sel]
  return jnp.where(srt >= nk, -1, srt).astype(jnp.int32)


def _selected_lists_by_mask(rank, cand, fidx, visible, *, k, max_sel, keep_fn):
  """``_selected_lists_by_sort`` without a sort: ``keep_fn(x, k)`` (each row's k largest, ties
  to the lower index) of the candidates, or-ed with the forced ``visible & ~cand``, compacted."""
  del fidx
  keep = keep_fn(jnp.where(cand, rank, -jnp.inf), k) & cand
  order, count = compact_true(keep | (visible & ~cand), max_sel)
  slot = jnp.arange(max_sel, dtype=jnp.int32)
  return jnp.where(slot < count[..., None], order, -1).astype(jnp.int32)


def candidates(b, hk, *, q_len, kv_len, q_block_size, block_size, causal, num_init, num_local,
                seg_ok, doc_start):
  """The block sets of ``select_lists``'s rules, from iota (no large constants): cand (top-k's
  choices: selectable, not forced) and vis (selectable), bool [b or 1, 1, nq, nk]; fidx int32
  [b, hk, nq, width], the forced (initial, local) blocks, -1 where absent."""
  per_doc = doc_start is not None
  row_init = 0 if per_doc else num_init          # per document: added below
  nk = cdiv(kv_len, block_size)
  q_last, lo, hi = _row_geometry(jnp, q_len, kv_len, q_block_size, block_size, num_local)
  nq, j = q_last.shape[0], jnp.arange(nk, dtype=jnp.int32)[None, :]
  visible = j * block_size <= q_last[:, None] if causal else jnp.ones((nq, nk), bool)
  forced = j < row_init
  if num_local > 0:
    forced = forced | ((j >= lo[:, None]) & (j <= hi[:, None]))
  cand = visible & ~forced
  parts = [jnp.where(visible[:, :row_init], j[:, :row_init], -1)] if row_init else []
  _, width = _static_counts(q_len, kv_len, q_block_size, block_size, bool(causal), row_init,
                            num_local, 0)
  if width:
    loc = jnp.maximum(lo, 0)[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
    ok = (loc <= hi[:, None]) & (loc >= row_init) & (loc < nk)
    parts.append(jnp.where(ok, loc, -1))
  fidx = jnp.concatenate(parts or [jnp.full((nq, 1), -1, jnp.int32)], axis=1).astype(jnp.int32)
  if not per_doc:
    return cand[None, None], visible[None, None], jnp.broadcast_to(fidx, (b, hk) + fidx.shape)
  # add each row's document-initial blocks to the local ones
  n_init = min(num_init, nk)
  ok = visible[None] & seg_ok                                         # [b, nq, nk] selectable
  fidx = jnp.broadcast_to(fidx[None], (b,) + fidx.shape)              # [b, nq, width]
  cand = cand[None] & seg_ok                                          # [b, nq, nk]
  if n_init:
    start = doc_start[:, :, None]                                     # [b, nq, 1]
    init = start + jnp.arange(n_init, dtype=jnp.int32)[None, None]    # [b, nq, n_init]
    fidx = jnp.where((fidx >= start) & (fidx < start + n_init), -1, fidx)   # listed as init
    fidx = jnp.concatenate([init, fidx], axis=-1)
    cand = cand & ~((j >= start) & (j < start + n_init))
  f_ok = jnp.take_along_axis(ok, jnp.clip(fidx, 0, nk - 1), axis=-1)
  fidx = jnp.where((fidx >= 0) & (fidx < nk) & f_ok, fidx, -1).astype(jnp.int32)
  return cand[:, None], ok[:, None], jnp.broadcast_to(fidx[:, None], (b, hk) + fidx.shape[1:])


def check_selection(selection, batch, q_len, kv_len, kv_heads):
  if not isinstance(selection, BlockSelection):
    raise TypeError(f"selection must be a BlockSelection, got {type(selection).__name__}")
  if (selection.q_len, selection.kv_len) != (q_len, kv_len):
    raise ValueError(f"selection was made for (q_len, kv_len) = "
                     f"{(selection.q_len, selection.kv_len)}, inputs have {(q_len, kv_len)}")
  want = (batch, kv_heads, selection.num_q_blocks)
  if selection.indices.shape[:3] != want or selection.counts.shape != want:
    raise ValueError(f"selection.indices must be [batch, kv_heads, num_q_blocks, n] = {want} + "
                     f"(n,) and selection.counts {want}, got {selection.indices.shape} and "
                     f"{selection.counts.shape}")
  for name in ("indices", "counts"):
    if not jnp.issubdtype(getattr(selection, name).dtype, jnp.integer):
      raise TypeError(f"selection.{name} must be integer, got {getattr(selection, name).dtype}")
  check_range("selection.indices", selection.indices, -1, selection.num_kv_blocks - 1)
  check_range("selection.counts", selection.counts, 0, selection.max_selected)


def check_top_k(top_k):
  """``top_k`` checked: an int >= 1 or a float share in (0, 1] (``row_budget``)."""
  if not isinstance(top_k, (float, np.floating)):
    check_int("top_k", top_k, 1)
    return int(top_k)
  if not 0.0 < top_k <= 1.0:
    raise ValueError(f"top_k must be an int >= 1 or a float in (0, 1], got {top_k!r}")
  return float(top_k)


def row_budget(top_k, n):
  """None for an int top_k; for a share f, int32 [n + 1]: the blocks kept by a row with v = 0..n
  selectable ones, round(f * v) half up (float64, so every path agrees)."""
  floats = isinstance(top_k, float)
  return np.floor(top_k * np.arange(n + 1) + 0.5).astype(np.int32) if floats else None


def top_k_cut(top_k, n, n_visible, n_forced):
  """(k, limit): the ``lax.top_k`` width over n blocks and, for a share, each row's picks
  (budget less forced; None for a count)."""
  budget = row_budget(top_k, n)
  if budget is None:
    return min(top_k, n), None
  return min(int(budget[-1]), n), jnp.asarray(budget)[n_visible] - n_forced


def check_selection_args(block_size, q_block_size, top_k, num_init_blocks, num_local_blocks):
  """Check the selection sizes; returns top_k (``check_top_k``)."""
  for name, val, lo in (("block_size", block_size, 1), ("q_block_size", q_block_size, 1),
                        ("num_init_blocks", num_init_blocks, 0),
                        ("num_local_blocks", num_local_blocks, 0)):
    check_int(name, val, lo)
  return check_top_k(top_k)


def select_blocks(q, k, *, block_size=64, top_k, q_block_size=64, causal=True, num_init_blocks=1,
                  num_local_blocks=1, segment_ids=None, kv_segment_ids=None, score="mean_key"):
  """Top-K key-block selection per query block, shared by the query heads of each GQA group.

  For query block i and kv head g, among the selectable blocks (causally visible, segment ids
  overlapping the query block's documents) keep the initial and local blocks plus the ``top_k``
  others with the highest ``block_scores`` (ties to the lower block). Not differentiable; see
  :func:`sparse_attention`.

  Args:
    q, k: as in :func:`block_scores`.
    block_size, q_block_size: keys per key block, queries per query block (static).
    top_k: blocks chosen by score besides the initial and local ones (static int), or a
      float in (0, 1]: each query block keeps that share of its selectable blocks in total,
      round(top_k * selectable) half up, at least its initial and local ones.
    causal: bottom-right aligned causal visibility.
    num_init_blocks: leading blocks always kept (of the row, or of each document).
    num_local_blocks: diagonal block plus this many minus one before it always kept (0: none).
    segment_ids, kv_segment_ids: as in :func:`~jattn.sparse.block_sparse_attention` (exact for
      packed rows).
    score: "mean_key" (the only scorer so far).

  Returns:
    A :class:`BlockSelection` with ``scores`` filled in (jit-compatible: sizes are static).

  Example:
    >>> q = jax.random.normal(jax.random.key(0), (2, 512, 4, 32))
    >>> k = jax.random.normal(jax.random.key(1), (2, 512, 2, 32))
    >>> sel = select_blocks(q, k, block_size=64, q_block_size=64, top_k=2)
    >>> sel.indices.shape   # 1 init + 1 local + 2 chosen
    (2, 2, 8, 4)
  """
  if score != "mean_key":
    raise ValueError(f"unknown score {score!r}; supported: 'mean_key'")
  top_k = check_selection_args(block_size, q_block_size, top_k, num_init_blocks, num_local_blocks)
  check_flags(causal=causal)
  batch, q_len, kv_len, _, _ = check_qkv(q, k, k)
  segment_ids, kv_segment_ids = check_segments(segment_ids, kv_segment_ids, batch, q_len, kv_len)
  return _select(q, k, segment_ids, kv_segment_ids, block_size=int(block_size), top_k=top_k,
                 q_block_size=int(q_block_size), causal=bool(causal), num_init=int(num_init_blocks),
                 num_local=int(num_local_blocks))


@one_program("block_size", "q_block_size", "top_k", "causal", "num_init", "num_local")
def _select(q, k, segment_ids, kv_segment_ids, *, block_size, q_block_size, top_k, causal,
            num_init, num_local):
  scores = block_scores(q, k, block_size=block_size, q_block_size=q_block_size,
                        segment_ids=segment_ids, kv_segment_ids=kv_segment_ids)
  seg_ok, doc_start = segment_rules(segment_ids, kv_segment_ids, q_block_size, block_size)
  return select_lists(scores, q_len=q.shape[1], kv_len=k.shape[1], q_block_size=q_block_size,
                      block_size=block_size, causal=causal, num_init=num_init,
                      num_local=num_local, top_k=top_k, seg_ok=seg_ok,
                      scores=jax.lax.stop_gradient(scores), doc_start=doc_start)
