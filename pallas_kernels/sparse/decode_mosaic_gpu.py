"""Top-K block-sparse decode attention for Hopper (sm90) in Pallas Mosaic GPU: TMA reads of the
kept blocks only. Contiguous and paged caches.

STATUS (2026-11-30): written and verified on the CPU only (lowering for "cuda", a jnp replay of
the kernel's walk vs the fp32 reference restricted to the kept blocks:
``tests/test_sparse_decode_mosaic_gpu.py``); it has NOT run on a GPU. ``jattn.sparse``'s
``sparse_decode_attention`` / ``sparse_paged_decode_attention(implementation="mosaic_gpu")``
run it after the Triton selection kernels; ``implementation=None`` never picks it.

The kernel is the split-KV decode program of ``pallas_kernels.decode.mosaic_gpu``
(``split_program``: memory warpgroup streaming K/V tiles by TMA through a ring, compute
warpgroup with the GQA group padded to wgmma's 64 rows, base-2 online softmax, fp32 partial o
and lse) walking another list of tiles: each (batch, kv head) has its own list of kept blocks
(``indices[b, h, :counts[b, h]]``, e.g. ``select_decode_slots``'s compact ascending lists),
used as a page table over the cache seen as blocks of ``block_size`` tokens:

  * split s of (b, h) walks slots [s * per, min((s + 1) * per, n)) of the list, n =
    counts[b, h], per = cdiv(n, num_splits) -- the Triton kernel's split of the list
    (``pallas_kernels.sparse.decode``), so both give the same partials up to rounding; a split
    without slots writes o 0, lse -inf;
  * a block of ``block_size`` tokens (a multiple of ``block_k``, 64 by default) is
    block_size / block_k kv tiles; tile t of the split reads slot t // tiles_per_block: a TMA
    box of [block_k tokens, 1 head, D] from the contiguous cache [B, S, Hk, D] (a strided box:
    rows D * 2 bytes apart by Hk * D * 2) or from page ``page_table[b, block]`` of a paged
    cache (page_size == block_size);
  * every tile is masked (``key0 + column < length``; a block id < 0 gets a far-away key0, so
    all of its keys are masked): the only partial block of a selection is the one holding the
    query, but a list may come in any order, and the mask costs a compare and a select per
    logit, far under the tile's TMA time;
  * copies of a block that is < 0 or starts at or past the length read the sequence's block 0
    instead (finite values; a page-table entry past the length may point anywhere); a
    sequence of length 0 walks nothing. As in the dense kernel, the masked keys' V rows still
    enter the P V wgmma (0 * NaN = NaN), so rows past the length inside the query's own block
    must hold finite values (zeros, stale K/V).

Splits are merged by ``pallas_kernels.sparse.decode.merge_decode_partials`` (the Triton merge
kernel: the arithmetic of the Triton path's in-kernel merge, ``_merge_head``), or by
``jattn.merge.merge_partials`` (``merge="xla"``).

Unsupported (NotImplementedError naming the option): block sizes that are not a multiple of
``block_k`` (64), and the dense kernel's list (window, soft cap, head dims other than
64/128/256, head_dim_v != head_dim, caches other than bf16/fp16, GQA groups over 64, interpret).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import compat
from pallas_kernels.decode import mosaic_gpu as dm
from pallas_kernels.decode.checks import check_page_table, check_partials_args

__all__ = ["sparse_decode_partials", "sparse_decode", "default_num_splits", "check_options"]

_FAR = 1 << 30      # key0 of a tile of a block id < 0: every key masked (lengths < 2**30)


@dataclasses.dataclass(frozen=True)
class _Static(dm._Static):
  block_size: int = 64     # tokens per kept block (a multiple of block_k)
  num_slots: int = 1       # width of the block lists

  @property
  def tiles_per_block(self) -> int:
    return self.block_size // self.block_k


def check_options(*, block_size, head_dim, head_dim_v, dtype, group, interpret=False,
                  block_k=None):
  """NotImplementedError naming the first option the sparse Mosaic GPU kernel does not support.

  Args:
    block_size: tokens per block (must be a multiple of block_k).
    head_dim, head_dim_v, dtype, group, interpret: as in
      ``pallas_kernels.decode.mosaic_gpu.check_options``.
    block_k: the kernel's kv tile (None: the default for head_dim).

  Returns:
    None.

  Example:
    >>> check_options(block_size=64, head_dim=128, head_dim_v=128, dtype=jnp.bfloat16, group=4)
  """
  dm.check_options(head_dim=head_dim, head_dim_v=head_dim_v, dtype=dtype, group=group,
                   interpret=interpret)
  bk = block_k or dm.default_block_sizes(head_dim).block_k
  if block_size % bk:
    raise NotImplementedError(f"implementation='mosaic_gpu' sparse decode needs a block_size "
                              f"that is a multiple of block_k ({bk}), got block_size "
                              f"{block_size}")


def default_num_splits(batch, kv_heads, max_selected, *, core_count=None,
                       min_blocks_per_split=4):
  """Splits per (batch, kv head): one wave of one CTA per multiprocessor (the default tiles
  take ~180 KiB of shared memory at D128: one CTA per SM), i.e. floor(cores / (batch *
  kv_heads)), at least 1, with at least ``min_blocks_per_split`` kept blocks per split.

  Args:
    batch, kv_heads: CTAs per split.
    max_selected: width of the block lists.
    core_count: multiprocessors; default ``compat.gpu_core_count()``.
    min_blocks_per_split: lower bound on a split's work.

  Returns:
    An int >= 1.

  Example:
    >>> default_num_splits(1, 8, 389, core_count=132)
    16
  """
  cores = compat.gpu_core_count() if core_count is None else int(core_count)
  most = -(-int(max_selected) // min_blocks_per_split)
  return int(max(1, min(cores // max(1, batch * kv_heads), most)))


# -------------------------------------------------------------------------------------------
# The walk (jnp on values: the kernel uses these, the CPU replay too)
# -------------------------------------------------------------------------------------------


def _split_slots(count, length, split, st: _Static):
  """Slots [begin, end) of the block list that split ``split`` walks (``count`` kept blocks;
  none when the length is 0)."""
  n = jnp.where(length > 0, jnp.clip(count, 0, st.num_slots), 0)
  per = lax.div(n + (st.num_splits - 1), jnp.int32(st.num_splits))
  begin = jnp.minimum(split * per, n)
  return begin, jnp.minimum(begin + per, n)


def _tile_block(t, st: _Static):
  """(slot, tile within the block) of the split's kv tile t."""
  if st.tiles_per_block == 1:
    return t, 0
  return lax.div(t, jnp.int32(st.tiles_per_block)), lax.rem(t, jnp.int32(st.tiles_per_block))


def _tile_key0(blk, sub, st: _Static):
  """Position of the first key of tile ``sub`` of block ``blk`` (far away for blk < 0)."""
  return jnp.where(blk >= 0, blk * st.block_size + sub * st.block_k, jnp.int32(_FAR))


def _tile_copy(blk, sub, length, st: _Static):
  """(block the TMA reads, first row in it) for tile ``sub`` of block ``blk``: a block that is
  < 0 or starts at or past the length reads the sequence's block 0 instead (its keys are masked;
  its values must be finite)."""
  live = (blk >= 0) & (blk < lax.div(length + (st.block_size - 1), jnp.int32(st.block_size)))
  return jnp.where(live, blk, 0), sub * st.block_k


# -------------------------------------------------------------------------------------------
# Kernel
# -------------------------------------------------------------------------------------------


def _sparse_kernel(*refs, st: _Static):
  """Refs (GMEM): lens [B], idx [B, Hk, M], counts [B, Hk] (int32), q [B, Hk, 64, D], k/v
  [B, N', Hk, D] (paged: [P, block_size, Hk, D] and the page table [B, max_pages] after them)
  -> o [B, S, Hk, group, D], lse [B, S, Hk, 64] fp32; then ``dm.launch``'s scratch."""
  paged = st.page_size is not None
  ins, pt_ref, o_ref, lse_ref, bufs, (split, h, b) = dm.unpack_refs(refs, 6, st)
  lens_ref, idx_ref, cnt_ref, q_ref, k_ref, v_ref = ins
  bk = st.block_k
  length = dm._clamp_length(lens_ref[b], st)
  begin, end = _split_slots(cnt_ref[b, h], length, split, st)
  lo, hi = begin * st.tiles_per_block, end * st.tiles_per_block

  def block_of(t):
    slot, sub = _tile_block(t, st)
    return idx_ref[b, h, slot], sub

  def copies(t):
    col, row = _tile_copy(*block_of(t), length, st)
    if paged:
      rows = (pt_ref[b, col], pl.ds(row, bk), h)
    else:
      rows = (b, pl.ds(col * st.block_size + row, bk), h)
    return [(k_ref.at[rows], v_ref.at[rows], None)]

  dm.split_program(st, bufs, q_src=q_ref.at[b, h], o_dst=o_ref.at[b, split, h],
                   lse_dst=lse_ref.at[b, split, h], length=length, lo=lo, hi=hi,
                   runs=((lo, hi, True),), key0=lambda t: _tile_key0(*block_of(t), st),
                   copies=copies)


def _call(q_p, k, v, lens, indices, counts, st: _Static, page_table=None):
  """The Mosaic GPU call (the CPU tests substitute a jnp replay with the same signature)."""
  b, hk = q_p.shape[:2]
  args = (lens, indices, counts, q_p, k, v) + (() if page_table is None else (page_table,))
  return dm.launch(functools.partial(_sparse_kernel, st=st), args, st, b, hk)


def _static(q, k, v, *, block_size, num_splits, num_slots, scale, block_sizes, capacity,
            page_size=None) -> _Static:
  bsz, hq, d = q.shape
  hk = k.shape[2]
  bs = block_sizes or (dm.default_block_sizes(d) if d in dm._HEAD_DIMS else
                       dm.DecodeBlockSizes())
  if not isinstance(bs, dm.DecodeBlockSizes):
    raise TypeError(f"block_sizes for implementation='mosaic_gpu' must be a "
                    f"pallas_kernels.decode.mosaic_gpu.DecodeBlockSizes, got {type(bs).__name__}")
  check_options(block_size=block_size, head_dim=d, head_dim_v=v.shape[-1], dtype=k.dtype,
                group=hq // hk, block_k=bs.block_k)
  return _Static(block_k=bs.block_k, num_stages=bs.num_stages, num_splits=int(num_splits),
                 capacity=capacity, num_tiles=-(-capacity // bs.block_k), head_dim=d,
                 group=hq // hk, scale=float(d ** -0.5 if scale is None else scale),
                 dtype=jnp.dtype(k.dtype), page_size=page_size, block_size=int(block_size),
                 num_slots=int(num_slots))


@functools.partial(jax.jit, static_argnames=("block_size", "num_splits", "scale", "block_sizes",
                                             "interpret"))
def sparse_decode_partials(q, k, v, kv_lengths, indices, page_table=None, counts=None, *,
                           block_size, num_splits, scale=None, block_sizes=None,
                           interpret=False):
  """Per-split partial decode attention over each kv head's kept cache blocks (Mosaic GPU, sm90).

  Args:
    q: [batch, q_heads, head_dim] (cast to the cache dtype).
    k, v: contiguous cache [batch, max_len, kv_heads, head_dim], or with ``page_table`` a page
      pool [num_pages, block_size, kv_heads, head_dim]; bf16 or fp16, head_dim 64/128/256.
    kv_lengths: int32 [batch] (clamped to the capacity); keys at or past it are masked.
    indices: int32 [batch, kv_heads, max_selected]: kept block ids in any order, -1 unused.
    page_table: None or int32 [batch, max_pages] (block j of sequence b is page
      ``page_table[b, j]``; entries past the length are never read).
    counts: None (walk all max_selected slots) or int32 [batch, kv_heads]: walk the first
      ``counts[b, h]`` slots (``select_decode_slots``' compact lists), split evenly.
    block_size: tokens per block, a multiple of ``block_sizes.block_k`` (64).
    num_splits: splits of each list.
    scale: logit scale, default 1/sqrt(head_dim).
    block_sizes: ``pallas_kernels.decode.mosaic_gpu.DecodeBlockSizes`` or None (its default).
    interpret: must be False (NotImplementedError).

  Returns:
    (out [batch, num_splits, q_heads, head_dim] fp32, lse [batch, num_splits, q_heads] fp32);
    splits without a kept key: 0 and -inf.

  Example (on an H100/H200):
    >>> o, lse = sparse_decode_partials(q, k, v, lens, idx, None, cnt, block_size=64,
    ...                                 num_splits=16)  # doctest: +SKIP
  """
  check_partials_args(q, k, v, kv_lengths, num_splits)
  if interpret:
    dm.check_options(head_dim=q.shape[-1], head_dim_v=v.shape[-1], dtype=k.dtype,
                     interpret=True)
  bsz, hq, d = q.shape
  hk = k.shape[2]
  if indices.ndim != 3 or indices.shape[:2] != (bsz, hk):
    raise ValueError(f"indices must be [batch, kv_heads, m] = [{bsz}, {hk}, m], got "
                     f"{indices.shape}")
  if counts is None:
    counts = jnp.full((bsz, hk), indices.shape[-1], jnp.int32)
  elif counts.shape != (bsz, hk):
    raise ValueError(f"counts must be [batch, kv_heads] = [{bsz}, {hk}], got {counts.shape}")
  if page_table is not None:
    check_page_table(q, page_table)
    if k.shape[1] != block_size:
      raise ValueError(f"page size {k.shape[1]} must equal block_size {block_size}")
    capacity = page_table.shape[1] * block_size
  else:
    capacity = k.shape[1]
  st = _static(q, k, v, block_size=block_size, num_splits=num_splits,
               num_slots=indices.shape[-1], scale=scale, block_sizes=block_sizes,
               capacity=capacity, page_size=None if page_table is None else block_size)
  if page_table is None:   # whole blocks (a copy only when the capacity is not a multiple)
    n_pad = -(-capacity // block_size) * block_size
    k, v = dm._pad_keys(k, n_pad), dm._pad_keys(v, n_pad)
  else:
    page_table = page_table.astype(jnp.int32)
  o, lse = _call(dm.pad_query(q, st, hk), k, v, kv_lengths.astype(jnp.int32),
                 indices.astype(jnp.int32), counts.astype(jnp.int32), st, page_table)
  return o.reshape(bsz, num_splits, hq, d), lse[..., :st.group].reshape(bsz, num_splits, hq)


@functools.partial(jax.jit, static_argnames=("block_size", "num_splits", "scale", "out_dtype",
                                             "block_sizes", "merge", "interpret"))
def sparse_decode(q, k, v, kv_lengths, indices, page_table=None, counts=None, *, block_size,
                  num_splits, scale=None, out_dtype=None, block_sizes=None, merge="kernel",
                  interpret=False):
  """Decode attention over each kv head's kept blocks: the Mosaic GPU partials, then a merge.

  Args:
    q, k, v, kv_lengths, indices, page_table, counts, block_size, num_splits, scale,
      block_sizes, interpret: as in :func:`sparse_decode_partials`.
    out_dtype: dtype of the output (default q.dtype).
    merge: "kernel" (``merge_decode_partials``: one small Triton launch, the arithmetic of the
      Triton sparse path's in-kernel merge) or "xla" (``jattn.merge.merge_partials``).

  Returns:
    (out [batch, q_heads, head_dim] in out_dtype, lse [batch, q_heads] fp32; rows without a
    kept key: 0 and -inf).

  Example (on an H100/H200):
    >>> out, lse = sparse_decode(q, k, v, lens, idx, None, cnt, block_size=64,
    ...                          num_splits=16)  # doctest: +SKIP
  """
  o, lse = sparse_decode_partials(q, k, v, kv_lengths, indices, page_table, counts,
                                  block_size=block_size, num_splits=num_splits, scale=scale,
                                  block_sizes=block_sizes, interpret=interpret)
  out_dtype = q.dtype if out_dtype is None else jnp.dtype(out_dtype)
  if merge == "kernel":
    from pallas_kernels.sparse.decode import merge_decode_partials
    return merge_decode_partials(o, lse, out_dtype=out_dtype)
  if merge == "xla":
    from pallas_kernels.common.merge import merge_partials
    out, lse = merge_partials(o, lse, axis=1)
    return out.astype(out_dtype), lse
  raise ValueError(f"merge must be 'kernel' or 'xla', got {merge!r}")
