"""Rotary position embeddings (RoPE), half-split ("NeoX") convention: the halves (x1, x2) of the
first ``rotary_dim`` channels rotate by ``position * base ** (-2i / rotary_dim)`` for pair i, at
explicit positions (packed documents restart at 0; decode continues from the cache index)."""

import jax.numpy as jnp

from jattn._validate import as_array, as_int32, check_float, check_int, check_number


def rope_frequencies(rotary_dim, base=10000.0):
  """Inverse frequencies of RoPE.

  Args:
    rotary_dim, base: even number of rotated channels, and the RoPE base (theta).

  Returns:
    fp32 array [rotary_dim // 2] of ``base ** (-2i / rotary_dim)``.

  Example:
    >>> rope_frequencies(4).shape
    (2,)
  """
  check_int("rotary_dim", rotary_dim)
  if rotary_dim % 2:
    raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
  base = check_number("base", base, 0, open_lo=True)
  return base ** (-jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim)


def apply_rope(x, positions, base=10000.0, rotary_dim=None):
  """Rotate the first ``rotary_dim`` channels of every head by its token's position.

  Args:
    x: [batch, seq, heads, head_dim] (or [batch, seq, head_dim] for a head-shared key).
    positions: int [batch, seq] absolute positions (restart at 0 per packed document).
    base: RoPE base; None returns x unchanged (NoPE).
    rotary_dim: rotated channels (even, <= head_dim); default all of head_dim.

  Returns:
    Array like x (same dtype); computed in fp32.

  Example:
    >>> apply_rope(jnp.ones((1, 5, 2, 8)), jnp.arange(5)[None]).shape
    (1, 5, 2, 8)
  """
  if base is None:
    return x
  check_float("x", x)
  positions = as_int32("positions", as_array("positions", positions))
  if x.ndim not in (3, 4) or 0 in x.shape or positions.shape != x.shape[:2]:
    raise ValueError(f"x must be [batch, seq, (heads,) head_dim] (no zero-size axis) and "
                     f"positions [batch, seq]: got x {x.shape}, positions {positions.shape}")
  d = x.shape[-1]
  rotary_dim = d if rotary_dim is None else rotary_dim
  if rotary_dim > d or rotary_dim % 2:
    raise ValueError(f"rotary_dim must be even and <= head_dim={d}, got {rotary_dim}")
  ang = positions.astype(jnp.float32)[..., None] * rope_frequencies(rotary_dim, base)
  if x.ndim == 4:
    ang = ang[:, :, None, :]  # [b, s, 1, rotary_dim/2]
  cos, sin = jnp.cos(ang), jnp.sin(ang)
  xf = x.astype(jnp.float32)
  x1, x2 = jnp.split(xf[..., :rotary_dim], 2, axis=-1)
  rot = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return jnp.concatenate([rot, xf[..., rotary_dim:]], axis=-1).astype(x.dtype)
