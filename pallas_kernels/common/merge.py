"""Exact merge of partial attention results (out, lse) by log-sum-exp (docs/design.md, "Partial
results and the LSE merge"): in XLA (:func:`merge_partials`, :func:`merge`), fp32, safe for empty
partials (0 output, -inf lse, never NaN) with finite gradients; in Pallas (Triton) for the GPU
decode kernels (:func:`merge_partials_pallas`, :func:`store_merged_heads`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import compat
from pallas_kernels.common.softmax import safe_lse
from pallas_kernels.common.util import check_float, check_int, next_pow2, one_program

# The documented API; the in-kernel merge pieces serve the decode kernels.
__all__ = ["merge", "merge_partials", "merge_partials_by_row", "merge_partials_pallas"]
MAX_ROW_PARTIALS = 64   # partials one row of merge_partials_pallas(row_units=...) may have


def merge_partials(outs, lses, axis=0):
  """Merge partial attention results along one axis by log-sum-exp.

  Args:
    outs: partial outputs, shape ``lses.shape + (head_dim,)``; any float dtype. Entries whose lse
      is -inf are ignored (they may hold anything finite or not).
    lses: partial log-sum-exps (natural log), fp32 preferred; -inf marks an empty partial.
    axis: the axis of ``lses`` and ``outs`` indexing the partials (negative: from ``lses``'s end),
      of length >= 1; other axes may have size 0 (empty results).

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
  if not lses.ndim:
    raise ValueError("lses must have an axis of partials (ndim >= 1), got a 0-d array")
  check_int("axis", axis, -lses.ndim, lses.ndim - 1)
  if not lses.shape[axis]:
    raise ValueError(f"axis {axis} (the partials) must have length >= 1, got lses {lses.shape}")
  return _merge(outs, lses, axis=axis % lses.ndim)


@one_program("axis")
def _merge(outs, lses, *, axis):
  lse32 = lses.astype(jnp.float32)
  m = jnp.max(lse32, axis=axis, keepdims=True)
  # The max only stabilises the exponentials: the result does not depend on it.
  m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  w = jnp.exp(lse32 - m)                                   # 0 for empty partials
  total, lse = safe_lse(m, jnp.sum(w, axis=axis, keepdims=True))
  contrib = jnp.where((w > 0.0)[..., None], outs.astype(jnp.float32), 0.0)
  out = jnp.sum((w / total)[..., None] * contrib, axis=axis)
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
  total, lse = safe_lse(m, jax.ops.segment_sum(w, rows, num_rows))
  contrib = jnp.where((w > 0.0)[..., None], w[..., None] * outs.astype(jnp.float32), 0.0)
  return jax.ops.segment_sum(contrib, rows, num_rows) / total[..., None], lse


def store_merged_heads(o_ref, lse_ref, out_ref, lse_out_ref, b, heads, *, num_splits, head_dim,
                       d_pad, rows=None):
  """In a Triton kernel: merge each of ``heads``' partials of sequence ``b`` (refs o [B, S, Hq, D],
  lse [B, S, Hq] fp32, S = ``num_splits``; or with ``rows``, the ref of ``row_units``, row b's
  from ``rows[b]`` on) as :func:`merge_partials`, and store them to out [B, Hq, D] and lse
  [B, Hq]. All heads are computed before any store: the compiler cannot move a load past one."""
  cols = jnp.arange(d_pad, dtype=jnp.int32)                          # [d_pad]
  srows = jnp.arange(next_pow2(num_splits, minimum=16), dtype=jnp.int32)   # [s_pad]
  s_ok, src = srows < num_splits, b
  if rows is not None:
    first = plgpu.load(rows.at[b])
    s_ok, srows, src = srows < plgpu.load(rows.at[b + 1]) - first, first + srows, 0
  mask = s_ok[:, None] if d_pad == head_dim else s_ok[:, None] & (cols < head_dim)[None, :]
  res = []
  for hh in heads:
    lse = plgpu.load(lse_ref.at[src, srows, hh], mask=s_ok, other=-jnp.inf)   # [s_pad]
    o = plgpu.load(o_ref.at[src, srows[:, None], hh, cols[None, :]], mask=mask, other=0.0)
    m = jnp.max(lse)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    w = jnp.exp(lse - m)                                             # 0 for empty partials
    total, lse = safe_lse(m, jnp.sum(w))
    contrib = jnp.where((w > 0.0)[:, None], o, 0.0)                  # [s_pad, d_pad]
    res.append((jnp.sum(contrib * (w / total)[:, None], axis=0), lse))   # [d_pad], scalar
  for hh, (out, lse) in zip(heads, res):
    plgpu.store(out_ref.at[b, hh, cols], out.astype(out_ref.dtype), mask=cols < head_dim)
    plgpu.store(lse_out_ref.at[b, hh], lse)


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

  def kernel(*refs):   # one (batch, query head) program; refs: [row starts,] o, lse, out, lse out
    store_merged_heads(*refs[-4:], pl.program_id(0), [pl.program_id(1)], num_splits=ns,
                       head_dim=d, d_pad=next_pow2(d, minimum=16), rows=refs[0] if rows else None)
  return pl.pallas_call(
      kernel, out_shape=[jax.ShapeDtypeStruct((bsz, hq, d), out_dtype),
                         jax.ShapeDtypeStruct((bsz, hq), jnp.float32)], grid=(bsz, hq),
      compiler_params=compat.triton_compiler_params(num_warps=4, num_stages=1),
      interpret=interpret, name="jattn_merge_partials")(
          *rows, outs.astype(jnp.float32), lses.astype(jnp.float32))
