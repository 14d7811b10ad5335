"""Online softmax in the base-2 domain, its finalisation, and the backward's per-row terms.

Base 2 folds ``log2(e)`` into the logit scale: one multiply-add and one ``exp2`` per element. A
row that saw no key gets output 0 and log-sum-exp -inf, never NaN. The log-sum-exp's cotangent
enters the backward exactly like the row term ``rowsum(dO * O)`` (``delta_rows``).

Masked keys never leak (docs/flash.md): the forward hides a partial tile's non-finite values
(``hide_nonfinite_values``), the dQ kernel zeroes them (``zero_nonfinite``), the dK/dV kernel
selects p and dS to 0 at masked entries."""

import math

import jax.numpy as jnp
from jax import lax

__all__ = ["LOG2E", "LN2", "online_softmax_step", "finalize", "delta_rows", "lse_base2",
           "zero_nonfinite", "hide_nonfinite_values"]

LOG2E, LN2 = math.log2(math.e), math.log(2.0)


def online_softmax_step(s, m, l, *, factor=None, guard_empty=False):
  """One online-softmax step over a tile of logits, base 2.

  Args:
    s, factor: [R, N] fp32 logits (masked -inf), base 2 already or turned into base 2 by the
      float ``factor`` (e.g. scale * log2(e), folded into the exponent's multiply-add).
    m, l: [R] running max of the base-2 logits (-inf or a very negative finite value at start)
      and running sum of exp2(logit - m).
    guard_empty: ``m`` may be -inf after this tile (a row that has seen only masked logits):
      exponentiate against 0 there, so that no ``-inf - -inf`` NaN appears.

  Returns:
    (p [R, N] = exp2(s * factor - m_new), alpha [R] = exp2(m - m_new), m_new [R], l_new [R]).

  Example:
    >>> s = jnp.array([[0.0, 1.0], [-jnp.inf, -jnp.inf]])
    >>> m0, l0 = jnp.full((2,), -jnp.inf), jnp.zeros((2,))
    >>> p, alpha, m, l = online_softmax_step(s, m0, l0, guard_empty=True)
    >>> l.tolist()
    [1.5, 0.0]
  """
  row_max = s.max(axis=1)
  if factor is not None:
    row_max, s = row_max * factor, s * factor
  m_new = jnp.maximum(m, row_max)
  m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if guard_empty else m_new
  alpha = jnp.exp2(m - m_use)
  p = jnp.exp2(s - lax.broadcast_in_dim(m_use, s.shape, [0]))
  return p, alpha, m_new, l * alpha + p.sum(axis=1)


def finalize(acc, m, l):
  """The output and natural-log log-sum-exp of an online softmax.

  Args:
    acc: [R, D] fp32 sum of exp2(logit - m) * v.
    m, l: [R] base-2 running max and running sum.

  Returns:
    (out [R, D] fp32 = acc / l, lse [R] fp32 = m ln 2 + ln l); rows with l == 0 keep their
    accumulator (0) and get -inf.

  Example:
    >>> acc = jnp.array([[1.0, 1.0], [0.0, 0.0]])  # a row that saw no key accumulated 0
    >>> out, lse = finalize(acc, jnp.zeros((2,)), jnp.array([2.0, 0.0]))
    >>> out[:, 0].tolist(), lse.tolist()
    ([0.5, 0.0], [0.6931471824645996, -inf])
  """
  l_safe, lse = safe_lse(m * LN2, l)
  return acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0]), lse


def safe_lse(m, total):
  """(total with 1 where it is 0, ``m + log(total)`` with -inf there): a softmax's denominator and
  log-sum-exp, safe for rows that saw no key (never NaN, finite gradients)."""
  empty = total == 0.0
  total = jnp.where(empty, 1.0, total)
  return total, jnp.where(empty, -jnp.inf, m + jnp.log(total))


def delta_rows(out, d_out, d_lse=None):
  """delta = rowsum(dO * O) - dLSE, fp32, by elementwise products (no reduced-precision matmul).

  Args:
    out, d_out: [B, Sq, Hq, Dv] the forward's output and its cotangent.
    d_lse: None or [B, Hq, Sq] the cotangent of the log-sum-exp.

  Returns:
    delta [B, Hq, Sq] fp32.

  Example:
    >>> delta_rows(jnp.ones((1, 3, 2, 4)), jnp.ones((1, 3, 2, 4))).shape
    (1, 2, 3)
  """
  delta = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1)  # [B, Sq, Hq]
  delta = jnp.swapaxes(delta, 1, 2)  # [B, Hq, Sq]
  return delta if d_lse is None else delta - d_lse.astype(jnp.float32)


def lse_base2(lse):
  """Natural-log log-sum-exp -> base 2, with +inf for rows that see no key (-inf).

  Args:
    lse: fp32 log-sum-exp, natural log, -inf for empty rows.

  Returns:
    lse * log2(e), +inf where lse is -inf (exp2(s - lse2) = 0 there).

  Example:
    >>> lse_base2(jnp.array([0.0, -jnp.inf])).tolist()
    [0.0, inf]
  """
  return jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E)


def zero_nonfinite(x):
  """x with its non-finite entries replaced by 0 (``x * 0 == 0`` exactly for finite x).

  Args:
    x: a float array (a K or V tile).

  Returns:
    x where finite, else 0 (same shape and dtype).

  Example:
    >>> zero_nonfinite(jnp.array([1.0, jnp.inf, jnp.nan])).tolist()
    [1.0, 0.0, 0.0]
  """
  return jnp.where(x * 0 == 0, x, jnp.zeros_like(x))


def hide_nonfinite_values(k, v):
  """The K / V tile of a partial tile: k with NaN rows at the keys whose value holds a
  non-finite entry (the element mask turns their logits to -inf for the rows that cannot see
  them), and v with those entries 0 (p = 0 then meets 0, not NaN).

  Args:
    k, v: [N, D] key tile and [N, Dv] value tile.

  Returns:
    (k [N, D], v [N, Dv]), both unchanged where v is finite.

  Example:
    >>> k, v = hide_nonfinite_values(jnp.ones((2, 2)), jnp.array([[1.0, jnp.inf], [2.0, 3.0]]))
    >>> k[:, 0].tolist(), v[:, 1].tolist()
    ([nan, 1.0], [0.0, 3.0])
  """
  bad = jnp.sum((v * 0).astype(jnp.float32), axis=1, keepdims=True)  # [N, 1]: 0, or NaN
  return k + bad.astype(k.dtype), zero_nonfinite(v)
