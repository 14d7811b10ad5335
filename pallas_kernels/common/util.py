"""Small helpers shared by the kernel modules: integer rounding, powers of two, padding, checks."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["cdiv", "round_up", "next_pow2", "pad_axis", "one_program"]


def one_program(*static_argnames):
  """Decorator: the function runs as one jitted program per static configuration, so that an
  eager call compiles once instead of dispatching op by op (under an outer jit it is inlined).

  Args:
    *static_argnames: the (hashable) arguments that select the program.

  Returns:
    A decorator; the wrapped function keeps its name, docstring and signature.

  Example:
    >>> scale = one_program("n")(lambda x, n: x * n)
    >>> int(scale(jnp.int32(3), n=3))
    9
  """
  def wrap(f):
    program = jax.jit(f, static_argnames=static_argnames)
    return functools.wraps(f)(lambda *args, **kwargs: program(*args, **kwargs))
  return wrap


def cdiv(n: int, d: int) -> int:
  """ceil(n / d) for Python ints.

  Args:
    n, d: the numerator and the positive denominator.

  Returns:
    The rounded-up quotient.

  Example:
    >>> cdiv(129, 128)
    2
  """
  return -(-n // d)


def round_up(n: int, m: int) -> int:
  """The smallest multiple of ``m`` that is >= ``n``.

  Args:
    n, m: the value to round and the positive multiple.

  Returns:
    ``cdiv(n, m) * m``.

  Example:
    >>> round_up(72, 128)
    128
  """
  return cdiv(n, m) * m


def next_pow2(n: int, *, minimum: int = 1) -> int:
  """The smallest power of two that is >= ``n`` and >= ``minimum``.

  Args:
    n, minimum: a non-negative int and the lower bound (Triton dots need >= 16 per axis).

  Returns:
    A power of two.

  Example:
    >>> next_pow2(96), next_pow2(1), next_pow2(8, minimum=16)
    (128, 1, 16)
  """
  return max(int(minimum), 1 << max(0, int(n) - 1).bit_length())


def pad_axis(x, axis: int, size: int, value=0):
  """Pad ``x`` at the end of ``axis`` up to ``size`` with ``value`` (no copy when it fits).

  Args:
    x, axis: the array and the axis to pad.
    size, value: the new length of that axis (>= its current length) and the fill value.

  Returns:
    The padded array.

  Example:
    >>> pad_axis(jnp.ones((2, 3)), 1, 4).shape
    (2, 4)
  """
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


def check_segment_ids(q_segment_ids, kv_segment_ids, q_shape, k_shape) -> None:
  """ValueError unless the segment ids are both None or [batch, len] of q and k, both given."""
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("q_segment_ids and kv_segment_ids must be given together")
  if q_segment_ids is not None and (tuple(q_segment_ids.shape) != tuple(q_shape[:2])
                                    or tuple(kv_segment_ids.shape) != (q_shape[0], k_shape[1])):
    raise ValueError(f"segment ids must be [batch, len]: got {q_segment_ids.shape}, "
                     f"{kv_segment_ids.shape} for q {tuple(q_shape)}, k {tuple(k_shape)}")


def check_qkv_shapes(q, k, v, same_dv=True):
  """Raise ValueError unless q [B, Sq, Hq, D], k [B, Sk, Hk, D] and v [B, Sk, Hk, Dv] agree
  (Dv == D when ``same_dv``) and Hq % Hk == 0; returns (B, Sq, Hq, D, Sk, Hk, Dv)."""
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"q, k, v must be [batch, seq, heads, head_dim], got {q.shape}, {k.shape}, "
                     f"{v.shape}")
  (b, sq, hq, d), (_, sk, hk, d_v) = q.shape, v.shape
  if k.shape[0] != b or k.shape[3] != d or v.shape[:3] != k.shape[:3] or (same_dv and d_v != d):
    raise ValueError(f"q, k, v shapes do not agree: {q.shape}, {k.shape}, {v.shape} (k and v "
                     f"must have the same {'shape' if same_dv else 'batch, seq and heads'} and "
                     f"q's head dim)")
  if hq % hk:
    raise ValueError(f"q heads ({hq}) must be a multiple of kv heads ({hk})")
  return b, sq, hq, d, sk, hk, d_v


def check_int(name, x, lo=1, hi=2**31 - 1):
  """Raise ValueError unless x is an int (not a bool) in [lo, hi]."""
  if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) or not (lo <= x <= hi):
    raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {x!r}")


_FLOATS = tuple(map(jnp.dtype, ("float16", "bfloat16", "float32", "float64")))


def check_float(name, x):
  """Raise TypeError unless x is an array of fp16, bf16, fp32 (or fp64: with jax x64 on)."""
  if not (hasattr(x, "shape") and getattr(x, "dtype", None) in _FLOATS):
    raise TypeError(f"{name} must have a floating dtype (fp32, bf16, fp16), got "
                    f"{getattr(x, 'dtype', type(x).__name__)}")


def check_flags(**flags):
  """Raise TypeError naming the first flag that is not a Python or numpy bool."""
  for name, f in flags.items():
    if not isinstance(f, (bool, np.bool_)):
      raise TypeError(f"{name} must be a bool, got {f!r}")
