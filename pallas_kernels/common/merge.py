"""Exact merge of partial attention results by log-sum-exp.

A partial result over a subset of keys is a pair (out, lse): out is the softmax-weighted average of
the values in that subset and lse the natural log of the softmax denominator (-inf when the subset
holds no visible key). Attention over the union of disjoint subsets is

    lse = log(sum_i exp(lse_i)),    out = sum_i exp(lse_i - lse) * out_i.

Split-KV decoding, two-stage (coarse + fine) retrieval with one softmax and a current-block plus
selected-blocks split all combine their partials with these two functions. Both are computed in
fp32, are safe for empty partials (an all-empty merge gives 0 output and -inf lse, never NaN) and
are differentiable with finite gradients everywhere, including through the returned lse.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["merge_partials", "merge"]


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
  outs = jnp.asarray(outs)
  lses = jnp.asarray(lses)
  if outs.ndim != lses.ndim + 1 or outs.shape[:-1] != lses.shape:
    raise ValueError(
        f"outs must have shape lses.shape + (head_dim,); got outs {outs.shape}, lses {lses.shape}")
  if not -lses.ndim <= axis < lses.ndim:
    raise ValueError(f"axis {axis} out of range for lses of rank {lses.ndim}")
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
    o1: first partial output, shape ``lse1.shape + (head_dim,)``.
    lse1: its log-sum-exp (-inf when empty).
    o2: second partial output, same shape as ``o1``.
    lse2: its log-sum-exp, same shape as ``lse1``.

  Returns:
    ``(out, lse)`` as :func:`merge_partials`; out in the promoted dtype of ``o1`` and ``o2``.

  Example:
    >>> o, lse = merge(jnp.ones((2, 8)), jnp.zeros(2), jnp.zeros((2, 8)), jnp.zeros(2))
    >>> o[0, 0], lse[0]   # equal weights: mean of 1 and 0, log(e^0 + e^0)
    (Array(0.5, dtype=float32), Array(0.6931472, dtype=float32))
  """
  dtype = jnp.result_type(o1, o2)
  if jnp.shape(o1) != jnp.shape(o2) or jnp.shape(lse1) != jnp.shape(lse2):
    raise ValueError(
        f"merge needs equal shapes; got o {jnp.shape(o1)} vs {jnp.shape(o2)}, "
        f"lse {jnp.shape(lse1)} vs {jnp.shape(lse2)}")
  outs = jnp.stack([jnp.asarray(o1, dtype), jnp.asarray(o2, dtype)], axis=0)
  lses = jnp.stack([jnp.asarray(lse1, jnp.float32), jnp.asarray(lse2, jnp.float32)], axis=0)
  return merge_partials(outs, lses, axis=0)
