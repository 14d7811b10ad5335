"""Sparse decode: running block summaries of a KV cache, per-token block selection, attention.

:class:`BlockSummaries` keeps running key sums per cache block (O(1) per appended token);
:func:`sparse_decode_attention` (contiguous cache) and :func:`sparse_paged_decode_attention`
(paged cache) score the blocks, keep initial + local + top-K and attend to the kept blocks.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jattn._layout import check_kv_layout as _check_kv_layout
from jattn._layout import hnd_as_sequences as _hnd_as_sequences
from pallas_kernels import compat
from jattn.sparse.selection import cdiv, check_selection_args


_HIGHEST = jax.lax.Precision.HIGHEST
_GATE_MODES = ("none", "ste", "gumbel")
_QUERY_POOLS = ("sum", "max")
_INT_MAX = np.iinfo(np.int32).max
_INT_MIN = np.iinfo(np.int32).min


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
  nb = cdiv(n, block_size)
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
  check_selection_args(block_summaries.block_size, 1, top_k, num_init_blocks, num_local_blocks)
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
    nb = cdiv(n, block_size)
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
    "_launch", "select_lists"))
def _hnd_decode(q, k, v, kv_lengths, block_summaries, *, block_size, return_lse,
                return_indices, _launch=(), select_lists=(), **kw):
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
  ``select_lists``: the Triton selection kernel's options as ((name, value), ...) (probes).
  """
  q2, k2, v2, lengths = _hnd_as_sequences(q, k, v, jnp.asarray(kv_lengths, jnp.int32))
  b, hk, n, d = k.shape
  hq = q.shape[1]
  nb = cdiv(n, block_size)
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
                                 select_lists=tuple(select_lists) if triton else (), **kw)
  res = (out.reshape(b, hq, out.shape[-1]),)                               # [b, hq, dv]
  if return_lse:
    res += (lse.reshape(b, hq),)
  if return_indices:
    res += (idx.reshape(b, hk, idx.shape[-1]),)                            # [b, hk, ms]
  return res[0] if len(res) == 1 else res


def _sparse_decode(q, k, v, kv_lengths, block_summaries, page_table, *, block_size, top_k,
                   num_init_blocks, num_local_blocks, scale, return_lse, return_indices,
                   implementation, interpret, num_splits, fused_select=None, score_splits=None,
                   kv_layout="nhd", _lengths_group=1, _launch=(), select_lists=()):
  # _lengths_group (the head-major path on the Triton kernels only): kv_lengths and the
  # summaries' lengths hold one entry per that many consecutive sequences; _launch: the Triton
  # attention kernel's launch options ((name, value), ...), from the head-major path; select_lists:
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
  nb = cdiv(k.shape[1], block_size) if page_table is None else page_table.shape[1]
  if block_summaries.num_blocks != nb:
    raise ValueError(f"block_summaries has {block_summaries.num_blocks} blocks, the cache {nb}")
  if implementation not in _DECODE_IMPLEMENTATIONS:
    raise ValueError(f"sparse decode supports implementation None, 'xla', 'triton', "
                     f"'mosaic_tpu' or 'mosaic_gpu', got {implementation!r}")
  impl = _resolve_decode_implementation(implementation)
  if select_lists and impl != "triton":
    raise ValueError("select_lists is for the Triton selection kernels only")
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
    check_selection_args(block_size, 1, top_k, num_init_blocks, num_local_blocks)
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
      opts.update(dict(select_lists))
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
          **{k_: v_ for k_, v_ in _launch if k_ != "merge_kernel"}, **dict(select_lists))
    elif fused_select:
      indices, counts, arrivals = score_select_decode_slots(
          q, block_summaries.sums, block_summaries.lengths, lengths, block_size=block_size,
          max_selected=width, score_splits=score_splits, interpret=interpret,
          return_arrivals=True, **sel_kw, **lg, **dict(select_lists))
    else:
      scores = decode_block_scores(q, block_summaries.sums, block_summaries.lengths,
                                   block_size=block_size, interpret=interpret, **lg)
      indices, counts, arrivals = select_decode_slots(
          scores, lengths, block_size=block_size, max_selected=width, interpret=interpret,
          return_arrivals=True, **sel_kw, **lg, **dict(select_lists))
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


