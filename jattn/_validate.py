"""Input checks shared by the public ops: errors name the argument, what was expected and what came.

Values the ops read (lengths, page ids, segment ids) are checked when concrete or inside
:func:`debug_checks`; shapes, dtypes and static arguments always.
"""
from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.common.util import check_flags, check_float, check_int  # noqa: F401 (shared)

IMPLEMENTATIONS = ("xla", "triton", "mosaic_gpu", "mosaic_tpu", "cudnn")
_INT32 = np.iinfo(np.int32)
_DEBUG = []   # one list of messages per active debug_checks() block (innermost last)


def check_implementation(implementation, allowed=IMPLEMENTATIONS):
  if implementation is not None and implementation not in allowed:
    raise ValueError(f"unknown implementation {implementation!r}; expected None or one of "
                     f"{allowed}")


def as_array(name, x):
  """x as is when traced or a jax array, else as numpy (same width); TypeError unless numbers."""
  if is_traced(x) or isinstance(x, jax.Array):
    return x
  if (x := np.asarray(x)).dtype.kind not in "biuf" and not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{name} must be an array of numbers, got {x.dtype}")
  return x


def check_nonempty(**arrays):
  for name, x in arrays.items():
    if 0 in tuple(x.shape):
      raise ValueError(f"{name} must have no zero-size dimension, got shape {tuple(x.shape)}")


def check_number(name, x, lo=-math.inf, hi=math.inf, *, open_lo=False):
  """x as a float: TypeError unless a static number, ValueError unless finite in [lo, hi]."""
  try:
    if isinstance(x, (str, bytes, bool, np.bool_)):
      raise TypeError
    x = float(x)
  except (TypeError, ValueError, jax.errors.ConcretizationTypeError):
    raise TypeError(f"{name} must be a Python number (static), got {x!r}") from None
  if not (math.isfinite(x) and lo <= x <= hi) or (open_lo and x == lo):
    want = (f" in [{lo}, {hi}]" if hi < math.inf else f" {'>' if open_lo else '>='} {lo}"
            ) if lo > -math.inf else ""
    raise ValueError(f"{name} must be a finite number{want}, got {x}")
  return x


def check_scale_and_cap(scale=None, logits_soft_cap=None, head_dim=None):
  """(scale, logits_soft_cap) as floats or None (with ``head_dim``, a None scale becomes
  1 / sqrt(head_dim)); ValueError unless scale is finite and the cap finite and > 0."""
  scale = (None if head_dim is None else 1.0 / math.sqrt(head_dim)) if scale is None else (
      check_number("scale", scale))
  return scale, None if logits_soft_cap is None else check_number(
      "logits_soft_cap", logits_soft_cap, 0, open_lo=True)


def check_qkv(q, k, v, names=("q", "k", "v")):
  """(batch, q_len, kv_len, hq, hk) of valid [batch, seq, heads, head_dim] q/k/v."""
  nq, nk, nv = names
  for name, x in zip(names, (q, k, v)):
    check_float(name, x)
    if x.ndim != 4:
      raise ValueError(f"{name} must be [batch, seq, heads, head_dim], got shape {x.shape}")
  check_nonempty(**dict(zip(names, (q, k, v))))
  check_same_dtype(**dict(zip(names, (q, k, v))))
  if not (q.shape[0] == k.shape[0] == v.shape[0]):
    raise ValueError(f"batch sizes differ: {nq} {q.shape}, {nk} {k.shape}, {nv} {v.shape}")
  if q.shape[-1] != k.shape[-1]:
    raise ValueError(f"{nq} and {nk} head_dim differ: {nq} {q.shape}, {nk} {k.shape}")
  if k.shape[:3] != v.shape[:3]:
    raise ValueError(f"{nk} and {nv} must agree in batch, seq and heads: {nk} {k.shape}, {nv} "
                     f"{v.shape}")
  hq, hk = q.shape[2], k.shape[2]
  if hq % hk != 0:
    raise ValueError(f"q_heads ({hq}) must be a multiple of kv_heads ({hk}) for GQA/MQA: {nq} "
                     f"{q.shape}, {nk} {k.shape}")
  return q.shape[0], q.shape[1], k.shape[1], hq, hk


def check_same_dtype(**arrays):
  """Raise TypeError naming the arrays unless they share one dtype."""
  if len({x.dtype for x in arrays.values()}) > 1:
    raise TypeError("dtypes differ: " + ", ".join(f"{n} {x.dtype}" for n, x in arrays.items())
                    + " (cast them to one)")


def as_int32(name, x):
  """An integer array as int32 without changing a value (else ValueError or TypeError)."""
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array, got {x.dtype}")
  if not np.can_cast(x.dtype, np.int32):
    if is_traced(x):
      raise TypeError(f"{name} must be int32 (or narrower) under jax.jit, got {x.dtype}: a "
                      f"cast could merge distinct values")
    check_range(name, x, _INT32.min, _INT32.max)
  return x if isinstance(x, jax.ShapeDtypeStruct) else jnp.asarray(x, jnp.int32)


def check_segments(segment_ids, kv_segment_ids, batch, q_len, kv_len):
  """Validate segment ids; kv_segment_ids defaults to segment_ids when q_len == kv_len."""
  if segment_ids is None:
    if kv_segment_ids is not None:
      raise ValueError("kv_segment_ids given without segment_ids")
    return None, None
  if kv_segment_ids is None:
    if q_len != kv_len:
      raise ValueError("q_len != kv_len: pass kv_segment_ids along with segment_ids")
    kv_segment_ids = segment_ids
  ids = {"segment_ids": as_array("segment_ids", segment_ids),
         "kv_segment_ids": as_array("kv_segment_ids", kv_segment_ids)}
  for (name, x), axis, n in zip(ids.items(), ("q_len", "kv_len"), (q_len, kv_len)):
    if x.shape != (batch, n):
      raise ValueError(f"{name} must be [batch, {axis}] = {(batch, n)}, got {x.shape}")
  return tuple(as_int32(name, x) for name, x in ids.items())


def check_lengths(name, lengths, batch, capacity=None):
  """int32 ``lengths`` of shape (batch,), range-checked in [0, capacity] (:func:`check_range`)."""
  lengths = as_array(name, lengths)
  if lengths.shape != (batch,):
    raise ValueError(f"{name} must have shape (batch,) = ({batch},), got {lengths.shape}")
  lengths = as_int32(name, lengths)
  check_range(name, lengths, 0, _INT32.max if capacity is None else capacity)
  return lengths


def is_traced(x):
  """Whether x's values are unknown now (a tracer or a ``jax.ShapeDtypeStruct``)."""
  return isinstance(x, (jax.core.Tracer, jax.ShapeDtypeStruct))


def _first_bad(name, x, lo, hi, valid):
  x = np.asarray(x)
  bad = (x < np.asarray(lo)) | (x > np.asarray(hi))
  if valid is not None:
    bad = bad & np.asarray(valid)
  if not bad.any():
    return None
  i = tuple(int(j) for j in np.argwhere(bad)[0])
  val, lo, hi = (np.broadcast_to(np.asarray(t), bad.shape)[i] for t in (x, lo, hi))
  return f"{name}[{', '.join(map(str, i))}] = {val}, expected a value in [{lo}, {hi}]"


def _report(name, x, lo, hi, valid):
  if (msg := _first_bad(name, x, lo, hi, valid)) and _DEBUG:
    _DEBUG[-1].append(msg)


def check_range(name, x, lo, hi, *, valid=None):
  """ValueError naming the first entry of x outside [lo, hi] among ``valid()`` (a lazy bool mask);
  traced values only inside :func:`debug_checks`."""
  traced = any(is_traced(a) for a in (x, lo, hi))
  if (traced and not _DEBUG) or isinstance(x, jax.ShapeDtypeStruct):   # shapes only: no values
    return
  valid = None if valid is None else valid()
  if not (traced or is_traced(valid)):
    if msg := _first_bad(name, x, lo, hi, valid):
      raise ValueError(msg)
  elif _DEBUG:
    jax.debug.callback(functools.partial(_report, name), x, jnp.asarray(lo), jnp.asarray(hi), valid)


@contextlib.contextmanager
def debug_checks():
  """Check traced values too (lengths, page ids, segment lengths) of the ops called inside the
  block; at its end the block raises ValueError naming the first bad value. Entering and leaving
  clears jax's compilation caches (jitted functions retrace); for debugging, not production.

  Returns:
    A context manager.

  Example:
    >>> import jax, jax.numpy as jnp, jattn
    >>> k = jnp.zeros((1, 32, 1, 8)); q = jnp.zeros((1, 1, 8))
    >>> f = jax.jit(lambda lens: jattn.decode_attention(q, k, k, lens, implementation="xla"))
    >>> try:
    ...   with jattn.debug_checks():
    ...     _ = f(jnp.array([40]))
    ... except ValueError as e:
    ...   print(e)
    kv_lengths[0] = 40, expected a value in [0, 32]
  """
  found = []
  jax.clear_caches()
  _DEBUG.append(found)
  try:
    yield
    jax.effects_barrier()
  finally:
    _DEBUG.pop()
    jax.clear_caches()
  found = list(dict.fromkeys(found))   # a value checked twice (a call and its plan) counts once
  if found:
    more = f" (first of {len(found)} bad values)" if len(found) > 1 else ""
    raise ValueError(found[0] + more)
