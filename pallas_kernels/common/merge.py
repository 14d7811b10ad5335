"""Exact merge of partial attention results by log-sum-exp.

A partial result over a subset of keys is a pair (out, lse): out is the softmax-weighted average of
the values in that subset and lse the natural log of the softmax denominator (-inf when the subset
holds no visible key). Attention over the union of disjoint subsets is

    lse = log(sum_i exp(lse_i)),    out = sum_i exp(lse_i - lse) * out_i.

:func:`merge_partials` and :func:`merge` (XLA) compute this in fp32, safe for empty partials (an
all-empty merge gives 0 output and -inf lse, never NaN), with finite gradients everywhere,
including through the returned lse. The GPU decode kernels use the same arithmetic in Pallas
(Triton): :func:`merge_partials_pallas` (forward only) and :func:`store_merged_heads` (in-kernel).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import compat
from pallas_kernels.common.util import check_float, check_int, next_pow2

# The documented API; the in-kernel merge pieces serve the decode kernels.
__all__ = ["merge", "merge_partials", "merge_partials_by_row", "merge_partials_pallas"]
MAX_ROW_PARTIALS = 64   # partials one row of merge_partials_pallas(row_units=...) may have


def merge_partials(outs, lses, axis=0):
  """Merge partial attention results along one axis by log-sum-exp.

  Args:
    outs: partial outputs, shape ``lses.shape + (head_dim,)``; any float dtype. Entries whose lse
      is -inf are ignored (they may hold anything finite or not).
    lses: partial log-sum-exps (natural log), fp32 preferred; -inf marks an empty partial.
    axis: the axis of ``lses`` (and the same axis of ``outs``) that indexes the partials; negative
      values count from the end of ``lses``.

  Returns:
    ``(out, lse)``: out has ``outs.shape`` without ``axis``, in ``outs.dtype``; lse has
    ``lses.shape`` without ``axis``, fp32, -inf where every partial is empty (out is 0 there).

  Example:
    >>> outs = jnp.ones((2, 3, 4))                 # [splits, heads, head_dim]
    >>> lses = jnp.array([[0.0, 1.0, -jnp.inf], [0.0, -jnp.inf, -jnp.inf]])
    >>> out, lse = merge_partials(outs, lses, axis=0)
    >>> out.shape, lse.shape
    ((3, 4), (3,))
  """
  for name, x in (("outs", outs), ("lses", lses)):   # lists: as numpy
    check_float(name, x if hasattr(x, "dtype") else np.asarray(x))
  outs, lses = jnp.asarray(outs), jnp.asarray(lses)
  if outs.ndim != lses.ndim + 1 or outs.shape[:-1] != lses.shape or not outs.shape[-1]:
    raise ValueError(f"outs must have shape lses.shape + (head_dim,), head_dim >= 1; got outs "
                     f"{outs.shape}, lses {lses.shape}")
  check_int("axis", axis, -lses.ndim, lses.ndim - 1)
  axis = axis % lses.ndim
  lse32 = lses.astype(jnp.float32)
  m = jnp.max(lse32, axis=axis, keepdims=True)
  # The max only stabilises the exponentials: the result does not depend on it.
  m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  w = jnp.exp(lse32 - m)                                   # 0 for empty partials
  total = jnp.sum(w, axis=axis, keepdims=True)
  empty = total == 0.0
  total_safe = jnp.where(empty, 1.0, total)
  weights = w / total_safe                                 # [..., splits, ...]
  contrib = jnp.where((w > 0.0)[..., None], outs.astype(jnp.float32), 0.0)
  out = jnp.sum(weights[..., None] * contrib, axis=axis)
  lse = jnp.where(empty, -jnp.inf, m + jnp.log(total_safe))
  return out.astype(outs.dtype), jnp.squeeze(lse, axis=axis)


def merge(o1, lse1, o2, lse2):
  """Merge two partial attention results over disjoint key sets.

  Args:
    o1, lse1, o2, lse2: two partial outputs of shape ``lse.shape + (head_dim,)`` and their
      log-sum-exps (-inf when empty); the two partials have equal shapes.

  Returns:
    ``(out, lse)`` as :func:`merge_partials`; out in the promoted dtype of ``o1`` and ``o2``.

  Example:
    >>> o, lse = merge(jnp.ones((2, 8)), jnp.zeros(2), jnp.zeros((2, 8)), jnp.zeros(2))
    >>> o[0, 0], lse[0]   # equal weights: mean of 1 and 0, log(e^0 + e^0)
    (Array(0.5, dtype=float32), Array(0.6931472, dtype=float32))
  """
  dtype = jnp.result_type(o1, o2)
  if jnp.shape(o1) != jnp.shape(o2) or jnp.shape(lse1) != jnp.shape(lse2):
    raise ValueError(f"merge needs equal shapes; got o {jnp.shape(o1)} vs {jnp.shape(o2)}, "
                     f"lse {jnp.shape(lse1)} vs {jnp.shape(lse2)}")
  outs = jnp.stack([jnp.asarray(o1, dtype), jnp.asarray(o2, dtype)], axis=0)
  lses = jnp.stack([jnp.asarray(lse1, jnp.float32), jnp.asarray(lse2, jnp.float32)], axis=0)
  return merge_partials(outs, lses, axis=0)


def merge_partials_by_row(outs, lses, rows, num_rows):
  """:func:`merge_partials` of partials grouped by row id (any number per row, in any order).

  Args:
    outs, lses: [units, heads, head_dim] partial outputs and [units, heads] fp32 log-sum-exps
      (entries with lse -inf are ignored).
    rows: int [units]: the row of each partial; ids outside [0, num_rows) are dropped.
    num_rows: number of rows (static).

  Returns:
    (out [num_rows, heads, head_dim] fp32, lse [num_rows, heads] fp32); a row with no
    non-empty partial gives 0 and -inf.

  Example:
    >>> out, lse = merge_partials_by_row(jnp.ones((3, 2, 4)), jnp.zeros((3, 2)),
    ...                                  jnp.array([1, 1, 5]), 2)
    >>> out[1, 0].tolist(), float(lse[1, 0]), float(lse[0, 0])
    ([1.0, 1.0, 1.0, 1.0], 0.6931471824645996, -inf)
  """
  lse32 = lses.astype(jnp.float32)
  m = jax.ops.segment_max(lse32, rows, num_rows)                     # [rows, heads]
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  w = jnp.exp(lse32 - m[jnp.clip(rows, 0, num_rows - 1)])            # 0 for empty partials
  total = jax.ops.segment_sum(w, rows, num_rows)
  contrib = jnp.where((w > 0.0)[..., None], w[..., None] * outs.astype(jnp.float32), 0.0)
  empty = total == 0.0
  total_safe = jnp.where(empty, 1.0, total)
  out = jax.ops.segment_sum(contrib, rows, num_rows) / total_safe[..., None]
  return out, jnp.where(empty, -jnp.inf, m + jnp.log(total_safe))


def merged_head(o_ref, lse_ref, b, hh, *, num_splits, head_dim, d_pad, first=None, count=None):
  """In a Triton kernel: (out [d_pad], lse) fp32, the merge of head ``hh``'s partials of sequence
  ``b`` from refs o [B, S, Hq, D] and lse [B, S, Hq] fp32 (S = ``num_splits``, or ``count`` from
  ``first``, traced, count <= num_splits); as :func:`merge_partials` for empty partials."""
  srows = jnp.arange(next_pow2(num_splits, minimum=16), dtype=jnp.int32)             # [s_pad]
  cols = jnp.arange(d_pad, dtype=jnp.int32)                          # [d_pad]
  s_ok = srows < (num_splits if count is None else count)
  srows = srows if first is None else first + srows
  lse = plgpu.load(lse_ref.at[b, srows, hh], mask=s_ok, other=-jnp.inf)   # [s_pad]
  mask = s_ok[:, None] if d_pad == head_dim else s_ok[:, None] & (cols < head_dim)[None, :]
  o = plgpu.load(o_ref.at[b, srows[:, None], hh, cols[None, :]], mask=mask, other=0.0)
  m = jnp.max(lse)
  m = jnp.where(m == -jnp.inf, 0.0, m)
  w = jnp.exp(lse - m)                                               # 0 for empty partials
  total = jnp.sum(w)
  empty = total == 0.0
  total_safe = jnp.where(empty, 1.0, total)
  contrib = jnp.where((w > 0.0)[:, None], o, 0.0)                    # [s_pad, d_pad]
  out = jnp.sum(contrib * (w / total_safe)[:, None], axis=0)         # [d_pad]
  return out, jnp.where(empty, -jnp.inf, m + jnp.log(total_safe))


def store_merged_heads(o_ref, lse_ref, out_ref, lse_out_ref, b, heads, *, num_splits, head_dim,
                       d_pad, rows=None):
  """:func:`merged_head` of each of ``heads`` of sequence ``b``, stored to out [B, Hq, D] and lse
  [B, Hq]; all heads are computed before any store, as the compiler cannot move a load past a
  store. ``rows``: None or the ref of ``row_units`` (:func:`merge_partials_pallas`)."""
  cols = jnp.arange(d_pad, dtype=jnp.int32)                          # [d_pad]
  first = None if rows is None else plgpu.load(rows.at[b])
  count = None if rows is None else plgpu.load(rows.at[b + 1]) - first
  res = [merged_head(o_ref, lse_ref, b if rows is None else 0, hh, num_splits=num_splits,
                     head_dim=head_dim, d_pad=d_pad, first=first, count=count) for hh in heads]
  for hh, (out, lse) in zip(heads, res):
    plgpu.store(out_ref.at[b, hh, cols], out.astype(out_ref.dtype), mask=cols < head_dim)
    plgpu.store(lse_out_ref.at[b, hh], lse)


def _merge_kernel(*refs, num_splits, head_dim, d_pad):
  """One (batch, query head) program; refs: [row starts,] o, lse, out, lse out."""
  rows = refs[0] if len(refs) == 5 else None
  store_merged_heads(*refs[-4:], pl.program_id(0), [pl.program_id(1)], num_splits=num_splits,
                     head_dim=head_dim, d_pad=d_pad, rows=rows)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret"))
def merge_partials_pallas(outs, lses, *, out_dtype=None, interpret=False, row_units=None):
  """:func:`merge_partials` over axis 1 of split partials, as one Pallas kernel (Triton); with
  ``row_units`` :func:`merge_partials_by_row` of a schedule's row-contiguous units. One program
  per (batch, query head), writing ``out_dtype`` itself (no XLA convert follows).

  Args:
    outs, lses: fp32 [batch, num_splits, q_heads, head_dim] and [batch, num_splits, q_heads].
    out_dtype, interpret: dtype of the merged output (default outs.dtype); run in the Pallas
      interpreter (CPU tests).
    row_units: None, or int32 [batch + 1]: outs [1, U, q_heads, head_dim] (lses [1, U, q_heads])
      hold row b's partials at rows row_units[b] .. row_units[b + 1] - 1, at most
      ``MAX_ROW_PARTIALS`` a row.

  Returns:
    (out [batch, q_heads, head_dim] in out_dtype, lse [batch, q_heads] fp32).

  Example:
    >>> o = jnp.ones((1, 3, 2, 16)); lse = jnp.zeros((1, 3, 2))
    >>> out, l = merge_partials_pallas(o, lse, interpret=True)
    >>> out.shape, l.shape
    ((1, 2, 16), (1, 2))
  """
  bsz, ns, hq, d = outs.shape
  if lses.shape != (bsz, ns, hq):
    raise ValueError(f"lses must be {(bsz, ns, hq)}, got {lses.shape}")
  out_dtype = outs.dtype if out_dtype is None else jnp.dtype(out_dtype)
  rows = () if row_units is None else (row_units.astype(jnp.int32),)
  if rows:
    bsz, ns = row_units.shape[0] - 1, min(ns, MAX_ROW_PARTIALS)
  kernel = functools.partial(_merge_kernel, num_splits=ns, head_dim=d,
                             d_pad=next_pow2(d, minimum=16))
  return pl.pallas_call(
      kernel, out_shape=[jax.ShapeDtypeStruct((bsz, hq, d), out_dtype),
                         jax.ShapeDtypeStruct((bsz, hq), jnp.float32)],
      grid=(bsz, hq),
      compiler_params=compat.triton_compiler_params(num_warps=4, num_stages=1),
      interpret=interpret, name="jattn_merge_partials")(
          *rows, outs.astype(jnp.float32), lses.astype(jnp.float32))
