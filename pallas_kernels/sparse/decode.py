"""Top-K block-sparse decode in portable Pallas GPU (Triton lowering), contiguous and paged.

One program per (batch, kv head, split). Each (batch, kv head) carries its own list of selected
cache blocks (``indices[b, h, :]``, any order, -1 for unused slots), so the selection of a kv head is
shared by its query heads but differs between kv heads: the list acts as a per-head page table
over the cache viewed as blocks of ``block_size`` tokens (paged caches: ``page_size ==
block_size`` and the block id goes through the page table). A split walks a contiguous share of
the list; each step loads one block's K and V rows of head h (masked past the sequence length
and for -1 slots, which read no memory),
runs the online softmax in fp32 and accumulates; the splits' partial (out, lse) are merged by
log-sum-exp (``jattn.merge.merge_partials``). All query heads of the group form one [g_pad, d_pad]
tile, so each selected K/V byte is read from HBM once.

File layout: kernel body, pallas_call wrapper, public entry points.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import compat
from pallas_kernels.decode.triton import load_group_query

__all__ = ["sparse_decode_partials"]


def _kernel(lens_ref, idx_ref, q_ref, k_ref, v_ref, *rest, scale, block, group, g_pad,
            head_dim, d_pad, num_splits, num_slots, capacity, paged):
  """One (batch, kv head, split) program.

  Refs: lens [B]; idx [B, Hk, M] (-1 = unused); q [B, Hq, D]; k, v [B, N, Hk, D] (contiguous) or
  [P * block, Hk, D] (paged, page table [B, max_pages] first in ``rest``); outputs o
  [B, S, Hq, D] fp32 and lse [B, S, Hq] fp32.
  """
  if paged:
    pt_ref, o_ref, lse_ref = rest
  else:
    pt_ref = None
    o_ref, lse_ref = rest
  b = pl.program_id(0)
  h = pl.program_id(1)
  split = pl.program_id(2)
  length = jnp.maximum(jnp.minimum(plgpu.load(lens_ref.at[b]), capacity), 0)   # scalar
  per_split = pl.cdiv(num_slots, num_splits)
  begin = jnp.minimum(split * per_split, num_slots)
  end = jnp.minimum(begin + per_split, num_slots)

  q, (q_rows, cols, row_ok, col_ok, q_mask) = load_group_query(
      q_ref, b, h, group=group, g_pad=g_pad, head_dim=head_dim, d_pad=d_pad)  # [g_pad, d_pad]
  precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  offs = jnp.arange(block, dtype=jnp.int32)                          # [block]

  def body(s, carry):
    acc, m_prev, l_prev = carry
    blk = plgpu.load(idx_ref.at[b, h, s])                            # selected block id or -1
    ok = blk >= 0
    blk = jnp.maximum(blk, 0)
    pos = blk * block + offs                                         # [block] token index
    valid = (pos < length) & ok
    kv_mask = valid[:, None] if col_ok is None else valid[:, None] & col_ok[None, :]
    if paged:
      page = plgpu.load(pt_ref.at[b, blk])
      krow = page * block + offs
      k = plgpu.load(k_ref.at[krow[:, None], h, cols[None, :]], mask=kv_mask, other=0)
    else:
      k = plgpu.load(k_ref.at[b, pos[:, None], h, cols[None, :]], mask=kv_mask, other=0)
    sc = plgpu.dot(q, k, trans_b=True, precision=precision) * scale  # [g_pad, block] fp32
    sc = jnp.where(valid[None, :], sc, -jnp.inf)
    # m_new stays -inf while only unused (-1) slots have been visited: shift by 0 then.
    m_new = jnp.maximum(m_prev, jnp.max(sc, axis=1))                  # [g_pad]
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m_prev - m_use)
    p = jnp.exp(sc - m_use[:, None])                                 # [g_pad, block]
    l_new = l_prev * alpha + jnp.sum(p, axis=1)
    if paged:
      v = plgpu.load(v_ref.at[krow[:, None], h, cols[None, :]], mask=kv_mask, other=0)
    else:
      v = plgpu.load(v_ref.at[b, pos[:, None], h, cols[None, :]], mask=kv_mask, other=0)
    pv = plgpu.dot(p.astype(v.dtype), v, precision=precision)        # [g_pad, d_pad]
    return acc * alpha[:, None] + pv, m_new, l_new

  acc0 = jnp.zeros((g_pad, d_pad), jnp.float32)
  m0 = jnp.full((g_pad,), -jnp.inf, jnp.float32)
  l0 = jnp.zeros((g_pad,), jnp.float32)
  acc, m, l = jax.lax.fori_loop(begin, end, body, (acc0, m0, l0))
  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  out = acc * (1.0 / l_safe)[:, None]                                # zeros when empty
  lse = jnp.where(empty, -jnp.inf, m + jnp.log(l_safe))
  plgpu.store(o_ref.at[b, split, q_rows[:, None], cols[None, :]], out, mask=q_mask)
  plgpu.store(lse_ref.at[b, split, q_rows], lse, mask=row_ok)


@functools.partial(jax.jit, static_argnames=("block_size", "num_splits", "scale", "num_warps",
                                             "num_stages", "interpret"))
def sparse_decode_partials(q, k, v, kv_lengths, indices, page_table=None, *, block_size,
                           num_splits, scale=None, num_warps=4, num_stages=2, interpret=False):
  """Per-split partial decode attention over each kv head's selected cache blocks (Triton).

  Args:
    q: [batch, q_heads, head_dim].
    k, v: contiguous caches [batch, max_len, kv_heads, head_dim], or with ``page_table`` page
      pools [num_pages, block_size, kv_heads, head_dim] (page size = block size).
    kv_lengths: int32 [batch]; keys at positions >= kv_lengths are masked.
    indices: int32 [batch, kv_heads, max_selected]: selected block ids in any order, -1 for
      unused slots (positions >= kv_lengths[b] are masked).
    page_table: None or int32 [batch, max_pages]: block j of sequence b is page
      ``page_table[b, j]``.
    block_size: tokens per block, a power of two >= 16.
    num_splits: splits of each selected list (merge the partials by log-sum-exp).
    scale: logit scale, default 1/sqrt(head_dim).
    num_warps, num_stages: launch parameters.
    interpret: run in the Pallas interpreter (CPU tests).

  Returns:
    (out [batch, num_splits, q_heads, head_dim] fp32, lse [batch, num_splits, q_heads] fp32);
    empty splits hold 0 and -inf.

  Example:
    >>> q = jnp.ones((1, 4, 16)); k = jnp.ones((1, 64, 2, 16))
    >>> idx = jnp.array([[[2, 0], [1, -1]]], jnp.int32)
    >>> o, lse = sparse_decode_partials(q, k, k, jnp.array([40], jnp.int32), idx,
    ...                                 block_size=16, num_splits=2, interpret=True)
    >>> o.shape
    (1, 2, 4, 16)
  """
  if block_size < 16 or block_size & (block_size - 1):
    raise ValueError(f"block_size must be a power of two >= 16 for the Triton sparse decode "
                     f"kernel, got {block_size}")
  bsz, hq, d = q.shape
  paged = page_table is not None
  if paged:
    num_pages, page_size, hk, _ = k.shape
    if page_size != block_size:
      raise ValueError(f"page size {page_size} must equal block_size {block_size}")
    capacity = page_table.shape[1] * page_size
    k = k.reshape(num_pages * page_size, hk, d)
    v = v.reshape(num_pages * page_size, hk, v.shape[-1])
  else:
    _, capacity, hk, _ = k.shape
  if indices.ndim != 3 or indices.shape[:2] != (bsz, hk):
    raise ValueError(f"indices must be [batch, kv_heads, m] = [{bsz}, {hk}, m], got "
                     f"{indices.shape}")
  group = hq // hk
  g_pad = max(16, pl.next_power_of_2(group))
  d_pad = max(16, pl.next_power_of_2(d))
  if scale is None:
    scale = 1.0 / math.sqrt(d)
  kernel = functools.partial(_kernel, scale=float(scale), block=block_size, group=group,
                             g_pad=g_pad, head_dim=d, d_pad=d_pad, num_splits=num_splits,
                             num_slots=indices.shape[-1], capacity=capacity, paged=paged)
  out_shape = [jax.ShapeDtypeStruct((bsz, num_splits, hq, d), jnp.float32),
               jax.ShapeDtypeStruct((bsz, num_splits, hq), jnp.float32)]
  args = [kv_lengths.astype(jnp.int32), indices.astype(jnp.int32), q, k, v]
  if paged:
    args.append(page_table.astype(jnp.int32))
  return pl.pallas_call(
      kernel, out_shape=out_shape, grid=(bsz, hk, num_splits),
      compiler_params=compat.triton_compiler_params(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret, name="jattn_sparse_decode")(*args)
