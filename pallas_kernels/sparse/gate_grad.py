"""Per-tile sums of dLoss/dlogits over the kept tiles of a block selection (Pallas, Triton).

The straight-through gate of ``jattn.sparse.sparse_attention`` adds a zero-valued bias to every
logit of a kept tile; its cotangent is the tile's sum of dS = P * (dO.v - delta), with
delta = dO.out - dlse. One program per (batch, query head, query tile) walks its kept key blocks,
recomputing P = exp(scale * q k^T - lse) under the element mask and dP = dO v^T (a flash
backward's dQ pass without its accumulator), and reduces dS to one number per kept tile.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import compat
from pallas_kernels.common.util import next_pow2, pad_axis

__all__ = ["tile_logit_grads"]


def _kernel(idx_ref, cnt_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest, scale,
            block_q, block_k, group, kv_len, q_offset, causal, segmented, slots_pad):
  """One (batch, query head, query tile) program. Refs: idx [B, Hk, nq, M] (ascending, valid
  first); cnt [B, Hk, nq]; q [B, Sq_p, Hq, D_p]; k [B, Sk_p, Hk, D_p]; v [B, Sk_p, Hk, Dv_p];
  do [B, Sq_p, Hq, Dv_p]; lse, delta [B, Hq, Sq_p] fp32 (lse -inf on padded rows); optional
  q_seg [B, Sq_p], kv_seg [B, Sk_p]; output [B, Hq, nq, slots_pad] fp32."""
  *seg_refs, o_ref = rest                                            # q_seg, kv_seg if segmented
  b = pl.program_id(0)
  h = pl.program_id(1)
  i = pl.program_id(2)
  hk = h // group
  rows = i * block_q + jnp.arange(block_q, dtype=jnp.int32)          # [block_q]
  cols = jnp.arange(q_ref.shape[-1], dtype=jnp.int32)
  cols_v = jnp.arange(v_ref.shape[-1], dtype=jnp.int32)
  q = plgpu.load(q_ref.at[b, rows[:, None], h, cols[None, :]])       # [block_q, d_p]
  do = plgpu.load(do_ref.at[b, rows[:, None], h, cols_v[None, :]])   # [block_q, dv_p]
  lse = plgpu.load(lse_ref.at[b, h, rows])                           # [block_q]
  delta = plgpu.load(delta_ref.at[b, h, rows])
  row_ok = lse != -jnp.inf                    # a NaN lse (a row that sees a NaN key) stays NaN
  lse = jnp.where(row_ok, lse, 0.0)
  q_pos = rows + q_offset
  if segmented:
    q_seg = plgpu.load(seg_refs[0].at[b, rows])
  precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  count = plgpu.load(cnt_ref.at[b, hk, i])
  slot_ids = jnp.arange(slots_pad, dtype=jnp.int32)
  offs = jnp.arange(block_k, dtype=jnp.int32)

  def body(t, acc):
    blk = plgpu.load(idx_ref.at[b, hk, i, t])
    k_pos = blk * block_k + offs                                     # [block_k]
    k = plgpu.load(k_ref.at[b, k_pos[:, None], hk, cols[None, :]])   # [block_k, d_p]
    v = plgpu.load(v_ref.at[b, k_pos[:, None], hk, cols_v[None, :]])
    s = plgpu.dot(q, k, trans_b=True, precision=precision) * scale  # [block_q, block_k] fp32
    mask = row_ok[:, None] & (k_pos < kv_len)[None, :]
    if causal:
      mask = mask & (k_pos[None, :] <= q_pos[:, None])
    if segmented:
      k_seg = plgpu.load(seg_refs[1].at[b, k_pos])
      mask = mask & (q_seg[:, None] == k_seg[None, :]) & (k_seg != 0)[None, :]
    p = jnp.where(mask, jnp.exp(jnp.where(mask, s - lse[:, None], 0.0)), 0.0)
    dp = plgpu.dot(do, v, trans_b=True, precision=precision)         # [block_q, block_k] fp32
    ds = jnp.where(mask, p * (dp - delta[:, None]), 0.0)   # NaN values or delta at hidden keys
    val = jnp.sum(jnp.sum(ds, axis=1), axis=0)
    return jnp.where(slot_ids == t, val, acc)

  acc = jax.lax.fori_loop(0, count, body, jnp.zeros((slots_pad,), jnp.float32))
  plgpu.store(o_ref.at[b, h, i, slot_ids], acc)


@functools.partial(jax.jit, static_argnames=("block_q", "block_k", "causal", "scale",
                                             "num_warps", "num_stages", "interpret"))
def tile_logit_grads(q, k, v, out, lse, dout, dlse, indices, counts, q_segment_ids=None,
                     kv_segment_ids=None, *, block_q, block_k, causal, scale, num_warps=4,
                     num_stages=2, interpret=False):
  """Sum of dLoss/dlogits over each kept tile, summed over the query heads of each kv group.

  Args:
    q, k, v: [batch, q_len, q_heads, head_dim], [batch, kv_len, kv_heads, head_dim | head_dim_v];
      one float dtype.
    out, lse: the forward's output [batch, q_len, q_heads, head_dim_v] and log-sum-exp
      [batch, q_heads, q_len] (fp32, -inf for empty rows).
    dout, dlse: their cotangents (same shapes).
    indices, counts: int32 [batch, kv_heads, num_q_blocks, max_selected], kept key blocks
      ascending, and int32 [batch, kv_heads, num_q_blocks], how many are valid.
    q_segment_ids, kv_segment_ids: None or int32 [batch, q_len] / [batch, kv_len].
    block_q, block_k: the selection's tiles (powers of two >= 16).
    causal, scale: bottom-right aligned causal mask; logit scale.
    num_warps, num_stages: launch parameters.
    interpret: run in the Pallas interpreter (CPU tests).

  Returns:
    fp32 [batch, kv_heads, num_q_blocks, max_selected] (0 in unused slots).

  Example:
    >>> x, lse = jax.random.normal(jax.random.key(0), (1, 32, 1, 16)), jnp.zeros((1, 1, 32))
    >>> idx, cnt = jnp.array([[[[0, -1], [0, 1]]]], jnp.int32), jnp.array([[[1, 2]]], jnp.int32)
    >>> tile_logit_grads(x, x, x, x, lse, x, lse, idx, cnt, block_q=16, block_k=16, causal=True,
    ...                  scale=0.25, interpret=True).shape
    (1, 1, 2, 2)
  """
  for name, n in (("block_q", block_q), ("block_k", block_k)):
    if n < 16 or n & (n - 1):
      raise ValueError(f"{name} must be a power of two >= 16 for the Triton kernel, got {n}")
  b, sq, hq, _ = q.shape
  _, sk, hk, _ = v.shape
  group = hq // hk
  nq, nk = -(-sq // block_q), -(-sk // block_k)
  m = indices.shape[-1]
  if indices.shape[:3] != (b, hk, nq) or counts.shape != (b, hk, nq):
    raise ValueError(f"indices [b, kv_heads, nq, m] / counts [b, kv_heads, nq] expected with "
                     f"nq={nq}; got {indices.shape}, {counts.shape}")
  f32 = jnp.float32
  delta = jnp.einsum("bshd,bshd->bhs", dout.astype(f32), out.astype(f32)) - dlse.astype(f32)
  def pad(x, n):                             # n rows (axis 1), lanes to a power of two >= 16
    return pad_axis(pad_axis(x, 1, n), 3, next_pow2(x.shape[3], minimum=16))
  args = [indices.astype(jnp.int32), counts.astype(jnp.int32), pad(q, nq * block_q),
          pad(k, nk * block_k), pad(v, nk * block_k), pad(dout.astype(q.dtype), nq * block_q),
          pad_axis(lse.astype(f32), 2, nq * block_q, -jnp.inf), pad_axis(delta, 2, nq * block_q)]
  segmented = q_segment_ids is not None
  if segmented:
    args += [pad_axis(q_segment_ids.astype(jnp.int32), 1, nq * block_q),
             pad_axis(kv_segment_ids.astype(jnp.int32), 1, nk * block_k)]
  slots_pad = next_pow2(m, minimum=16)
  kernel = functools.partial(_kernel, scale=float(scale), block_q=block_q, block_k=block_k,
                             group=group, kv_len=sk, q_offset=sk - sq, causal=bool(causal),
                             segmented=segmented, slots_pad=slots_pad)
  res = pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((b, hq, nq, slots_pad), f32), grid=(b, hq, nq),
      compiler_params=compat.triton_compiler_params(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret, name="jattn_sparse_gate_grad")(*args)
  return res.reshape(b, hk, group, nq, slots_pad).sum(2)[..., :m]
