"""Top-K block-sparse decode for TPU (Pallas Mosaic), contiguous and paged caches.

Grid (batch, kv head, slot). The kept-block lists, counts, lengths and (paged) the page table are
scalar-prefetched and read by the K/V index maps, so step ``j`` DMAs only block
``indices[b, h, j]``; slots past the count repeat the last kept block's index (Pallas skips the
DMA) and skip the compute, and an empty list maps to block 0. An fp32 online softmax over the GQA
group's query rows runs in VMEM scratch; V rows past the length are zeroed (spare pages may hold
NaN). One DMA per kept block of K and of V, of one head's lanes of a ``[.., tokens, kv_heads * D]``
view or of every head's rows (then a strided sublane load): see :func:`head_lanes_layout`.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import compat
from pallas_kernels.decode.checks import check_page_table, check_partials_args
from pallas_kernels.decode.mosaic_tpu import (LANES, group_queries, init_softmax, load_head,
                                               write_softmax)

__all__ = ["sparse_decode", "head_lanes_layout"]


def head_lanes_layout(kv_heads, head_dim, head_dim_v):
  """Whether one kv head's block can be DMA'd alone (a lane slice of ``kv_heads * D``).

  Args:
    kv_heads, head_dim, head_dim_v: the cache's kv heads and key / value head dims.

  Returns:
    True for ``kv_heads == 1`` or both head dims multiples of 128 (each DMA reads exactly the
    kept bytes of one head); False when blocks are read with every head's rows.

  Example:
    >>> head_lanes_layout(8, 128, 128), head_lanes_layout(2, 72, 72), head_lanes_layout(1, 72, 40)
    (True, False, True)
  """
  return kv_heads == 1 or (head_dim % LANES == 0 and head_dim_v % LANES == 0)


def _kernel(lens_ref, idx_ref, cnt_ref, *refs, scale, block, kv_heads, num_slots, capacity,
            head_rows, paged):
  """refs: [page_table (SMEM, for the index maps),] q [g_pad, D], k [block (* Hk), D], v [block
  (* Hk), Dv]; outputs o [g_pad, Dv], lse [g_pad, LANES]; scratch m, l [g_pad, LANES], acc
  [g_pad, Dv]. ``head_rows``: the K/V blocks hold every kv head's rows (row t * Hk + h)."""
  q_ref, k_ref, v_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref = refs[1:] if paged else refs
  b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  count = jnp.clip(cnt_ref[b * kv_heads + h], 0, num_slots)
  blk = idx_ref[(b * kv_heads + h) * num_slots + jnp.minimum(j, num_slots - 1)]

  pl.when(j == 0)(lambda: init_softmax(m_ref, l_ref, acc_ref))

  def attend(k, v):                                   # k [block, D], v [block, Dv]
    length = jnp.clip(lens_ref[b], 0, capacity)
    first = blk * block
    valid = first + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1) < length   # [1, block]
    valid_rows = first + jax.lax.broadcasted_iota(jnp.int32, (block, 1), 0) < length
    s = jax.lax.dot_general(q_ref[...], k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * scale         # [g_pad, block]
    s = jnp.where(valid, s, -jnp.inf)
    m_prev = m_ref[...]                                                          # [g_pad, L]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a block with no visible key: no NaN
    alpha = jnp.exp(m_prev - m_use)
    p = jnp.exp(s - m_use[:, :1])                                                # [g_pad, block]
    l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
    m_ref[...] = m_new
    v = jnp.where(valid_rows, v, jnp.zeros_like(v))   # rows past the length may hold garbage
    pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)                # [g_pad, Dv]
    acc_ref[...] = acc_ref[...] * alpha[:, :1] + pv

  run = (j < count) & (blk >= 0)
  if head_rows:
    for hh in range(kv_heads):                        # static strided loads of head hh's rows
      @pl.when(run & (h == hh))
      def _compute_head():
        attend(load_head(k_ref, hh, kv_heads=kv_heads, rows=block),
               load_head(v_ref, hh, kv_heads=kv_heads, rows=block))
  else:
    @pl.when(run)
    def _compute():
      attend(k_ref[...], v_ref[...])

  pl.when(j == num_slots - 1)(lambda: write_softmax(m_ref, l_ref, acc_ref, o_ref, lse_ref))


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "interpret"))
def sparse_decode(q, k, v, kv_lengths, indices, counts=None, page_table=None, *, block_size,
                  scale=None, interpret=False):
  """Decode attention over each kv head's kept cache blocks (Mosaic TPU kernel).

  Args:
    q: [batch, q_heads, head_dim].
    k, v: caches [batch, max_len, kv_heads, head_dim | head_dim_v] (with ``page_table``, page
      pools [num_pages, block_size, kv_heads, ...]) of one dtype: fp32, bf16 or fp16.
    kv_lengths: int [batch]; keys at positions >= kv_lengths are masked.
    indices: int32 [batch, kv_heads, max_selected]: kept block ids (any order) in the first
      ``counts`` slots, -1 after them (``jattn.sparse.select_decode_blocks``'s lists).
    counts: None (the number of non-negative entries) or int32 [batch, kv_heads].
    page_table: None or int32 [batch, max_pages]: block j of sequence b is page
      ``page_table[b, j]`` (clamped into range; entries of unkept blocks are never read).
    block_size: tokens per block (the page size when paged); the rows per DMA, ``block_size``
      or ``block_size * kv_heads`` (:func:`head_lanes_layout`), a multiple of 8 (16-bit: 16).
    scale: logit scale, default 1/sqrt(head_dim).
    interpret: run in the TPU interpreter (``pltpu.InterpretParams()``) on CPU.

  Returns:
    (out [batch, q_heads, head_dim_v] in q.dtype, lse [batch, q_heads] fp32, natural log; 0 and
    -inf for a row that sees no key).

  Example:
    >>> q = jnp.ones((1, 4, 128)); k = jnp.ones((1, 64, 2, 128))
    >>> idx = jnp.array([[[2, 0], [1, -1]]], jnp.int32)
    >>> o, lse = sparse_decode(q, k, k[..., :64], jnp.array([40], jnp.int32), idx,
    ...                        block_size=16, interpret=True)
    >>> o.shape, lse.shape
    ((1, 4, 64), (1, 4))
  """
  check_partials_args(q, k, v, jnp.asarray(kv_lengths), 1)
  bsz, hq, d = q.shape
  dv = v.shape[-1]
  rows0, hk = k.shape[1:3]
  if hq % hk:
    raise ValueError(f"q_heads ({hq}) must be a multiple of kv_heads ({hk})")
  if jnp.dtype(k.dtype).itemsize not in (2, 4) or v.dtype != k.dtype:
    raise NotImplementedError(f"mosaic_tpu sparse decode supports 16- and 32-bit caches of one "
                              f"dtype, got {k.dtype} / {v.dtype}")
  if indices.ndim != 3 or indices.shape[:2] != (bsz, hk):
    raise ValueError(f"indices must be [batch, kv_heads, m] = [{bsz}, {hk}, m], got "
                     f"{indices.shape}")
  if counts is not None and counts.shape != (bsz, hk):
    raise ValueError(f"counts must be [batch, kv_heads] = [{bsz}, {hk}], got {counts.shape}")
  paged = page_table is not None
  lanes = head_lanes_layout(hk, d, dv)
  sub = 8 if jnp.dtype(k.dtype).itemsize == 4 else 16
  dma_rows = block_size if lanes else block_size * hk
  if block_size < 1 or dma_rows % sub:
    raise ValueError(f"mosaic_tpu sparse decode DMAs {dma_rows} rows per block (block_size "
                     f"{block_size}{'' if lanes else f' x {hk} kv heads'}), which must be a "
                     f"multiple of {sub} for {k.dtype} caches")
  if paged:
    check_page_table(q, page_table)
    if rows0 != block_size:
      raise ValueError(f"page size {rows0} must equal block_size {block_size}")
    num_blocks = page_table.shape[1]
    capacity = num_blocks * block_size
  else:
    if q.shape[0] != k.shape[0]:
      raise ValueError(f"q batch {q.shape[0]} != cache batch {k.shape[0]}")
    if rows0 < block_size:
      raise ValueError(f"cache length {rows0} is shorter than one block ({block_size})")
    num_blocks = -(-rows0 // block_size)
    capacity = rows0
  q4, group, g_pad = group_queries(q, hk, k.dtype)                  # dots in the cache dtype
  scale = 1.0 / math.sqrt(d) if scale is None else scale
  num_slots = indices.shape[-1]
  indices = indices.astype(jnp.int32)
  if counts is None:
    counts = jnp.sum(indices >= 0, axis=-1)
  # Free reshapes: [.., tokens, Hk * D] (head h = lane block h) or [.., tokens * Hk, D].
  rows, heads = (rows0, hk) if lanes else (rows0 * hk, 1)
  k3, v3 = (x.reshape(x.shape[0], rows, heads * x.shape[-1]) for x in (k, v))
  prefetch = [jnp.clip(jnp.asarray(kv_lengths, jnp.int32), 0, capacity),
              indices.reshape(-1), counts.astype(jnp.int32).reshape(-1)]
  if paged:
    prefetch.append(jnp.clip(page_table.astype(jnp.int32), 0, k.shape[0] - 1))
  fixed = lambda b, h, j, *_: (b, h, 0, 0)

  def kv_index(b, h, j, lens_ref, idx_ref, cnt_ref, *table_ref):
    count = jnp.clip(cnt_ref[b * hk + h], 0, num_slots)
    s = jnp.maximum(jnp.minimum(j, count - 1), 0)      # past the count: the last kept slot
    blk = jnp.clip(idx_ref[(b * hk + h) * num_slots + s], 0, num_blocks - 1)
    return (table_ref[0][b, blk], 0, h if lanes else 0) if paged else (b, blk, h if lanes else 0)

  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=len(prefetch),
      grid=(bsz, hk, num_slots),
      in_specs=[pl.BlockSpec((None, None, g_pad, d), fixed),                   # q
                pl.BlockSpec((None, dma_rows, d), kv_index),                   # K block
                pl.BlockSpec((None, dma_rows, dv), kv_index)],                 # V block
      out_specs=[pl.BlockSpec((None, None, g_pad, dv), fixed),
                 pl.BlockSpec((None, None, g_pad, LANES), fixed)],
      scratch_shapes=[pltpu.VMEM((g_pad, LANES), jnp.float32),
                      pltpu.VMEM((g_pad, LANES), jnp.float32),
                      pltpu.VMEM((g_pad, dv), jnp.float32)],
  )
  kernel = functools.partial(_kernel, scale=float(scale), block=block_size, kv_heads=hk,
                             num_slots=num_slots, capacity=capacity, head_rows=not lanes,
                             paged=paged)
  o, lse = pl.pallas_call(
      kernel, grid_spec=grid_spec,
      out_shape=[jax.ShapeDtypeStruct((bsz, hk, g_pad, dv), q.dtype),
                 jax.ShapeDtypeStruct((bsz, hk, g_pad, LANES), jnp.float32)],
      compiler_params=compat.tpu_compiler_params(("parallel", "parallel", "arbitrary")),
      interpret=compat.tpu_interpret_params() if interpret else False,
      name="jattn_sparse_paged_decode_tpu" if paged else "jattn_sparse_decode_tpu",
  )(*prefetch, q4, k3, v3)
  return (o[:, :, :group].reshape(bsz, hq, dv), lse[:, :, :group, 0].reshape(bsz, hq))
