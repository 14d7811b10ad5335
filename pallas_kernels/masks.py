"""Element-level mask semantics shared by every attention path (references and kernels).

Query i of a q_len-long block attending into a kv_len-long sequence sits at absolute position
``i + (kv_len - q_len)`` (bottom-right alignment). Key j is visible to query i iff
  * causal:  j <= qpos(i)
  * window (left, right):  qpos(i) - left <= j <= qpos(i) + right
  * segments: q_seg[i] == kv_seg[j] != 0
  * j < kv_len (padding added inside kernels is never visible)
"""
from __future__ import annotations

import operator

import jax.numpy as jnp


# A window side this long reaches past any sequence (positions are int32): it is unbounded, and
# the kernels never add it to a position (which would overflow).
UNBOUNDED_SIDE = 2 ** 30


def normalize_window(local_window_size):
  """Turn ``local_window_size`` into ``(left, right)`` or None.

  Args:
    local_window_size: None, an int w (meaning (w, w)) or a pair (left, right) of non-negative
      ints; ``None`` inside the pair means unbounded on that side, as does a side of at least
      ``UNBOUNDED_SIDE`` (2**30) tokens.

  Returns:
    None or a tuple (left, right) where each side is an int or None.

  Example:
    >>> normalize_window(512), normalize_window((511, None)), normalize_window((0, 2**31))
    ((512, 512), (511, None), (0, None))
  """
  if local_window_size is None:
    return None
  pair = isinstance(local_window_size, (tuple, list))
  sides = tuple(local_window_size) if pair else (local_window_size,) * 2
  if len(sides) != 2 or any(isinstance(s, bool) or not (s is None and pair or hasattr(
      s, "__index__")) for s in sides):   # a float (NaN included) or a bool is refused
    raise TypeError(f"local_window_size must be an int or a (left, right) pair of ints, got "
                    f"{local_window_size!r}")
  w = tuple(None if s is None else operator.index(s) for s in sides)
  if any(side is not None and side < 0 for side in w):
    raise ValueError(f"local_window_size sides must be >= 0, got {local_window_size!r}")
  return tuple(None if s is None or s >= UNBOUNDED_SIDE else s for s in w)


def visible(q_pos, k_pos, q_seg=None, kv_seg=None, *, causal, window, kv_len=None):
  """The visibility rule on already-broadcastable arrays (used inside kernels and by element_mask).

  Args:
    q_pos, k_pos: int arrays of absolute (bottom-right aligned) query positions and of key
      positions, broadcastable to each other.
    q_seg, kv_seg: None, or int arrays of segment ids broadcastable like q_pos / k_pos.
    causal, window: bool; None or (left, right) from ``normalize_window``.
    kv_len: if given, keys at positions >= kv_len are invisible (inside-kernel padding).

  Returns:
    bool array of the broadcast shape.

  Example:
    >>> bool(visible(jnp.int32(3), jnp.int32(1), causal=True, window=(1, 0)))
    False
  """
  mask = jnp.ones(jnp.broadcast_shapes(jnp.shape(q_pos), jnp.shape(k_pos)), dtype=bool)
  if kv_len is not None:
    mask = mask & (k_pos < kv_len)
  if causal:
    mask = mask & (k_pos <= q_pos)
  if window is not None:
    left, right = window
    if left is not None:
      mask = mask & (k_pos >= q_pos - left)
    if right is not None:
      mask = mask & (k_pos <= q_pos + right)
  if q_seg is not None:
    mask = mask & (q_seg == kv_seg) & (kv_seg != 0)
  return mask


def element_mask(q_pos, k_pos, *, causal, window, kv_len=None, q_seg=None, kv_seg=None):
  """``visible`` of every query against every key: q_pos[..., :, None] vs k_pos[..., None, :].

  Args:
    q_pos, k_pos: int arrays [..., tq] of query positions and [..., tk] of key positions.
    causal, window, kv_len: as for ``visible``.
    q_seg, kv_seg: None, or int arrays [..., tq] / [..., tk] of segment ids.

  Returns:
    bool array [..., tq, tk].

  Example:
    >>> m = element_mask(jnp.arange(4), jnp.arange(4), causal=True, window=None)
    >>> bool(m[0, 1]), bool(m[1, 0])
    (False, True)
  """
  return visible(q_pos[..., :, None], k_pos[..., None, :],
                 None if q_seg is None else q_seg[..., :, None],
                 None if kv_seg is None else kv_seg[..., None, :],
                 causal=causal, window=window, kv_len=kv_len)
