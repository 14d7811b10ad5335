"""Input checks shared by the public ops: clear errors that name the problem."""
from __future__ import annotations

import jax.numpy as jnp

IMPLEMENTATIONS = ("xla", "triton", "mosaic_gpu", "mosaic_tpu", "cudnn")


def check_implementation(implementation, allowed=IMPLEMENTATIONS):
  """Raise ValueError unless ``implementation`` is None or one of ``allowed``."""
  if implementation is not None and implementation not in allowed:
    raise ValueError(f"unknown implementation {implementation!r}; expected None or one of {allowed}")


def check_float(name, x):
  """Raise TypeError unless x has a floating dtype."""
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{name} must have a floating dtype (fp32, bf16, fp16), got {x.dtype}")


def check_qkv(q, k, v):
  """Validate [batch, seq, heads, head_dim] q/k/v; return (batch, q_len, kv_len, hq, hk)."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4:
      raise ValueError(f"{name} must be [batch, seq, heads, head_dim], got shape {x.shape}")
    check_float(name, x)
  if not (q.shape[0] == k.shape[0] == v.shape[0]):
    raise ValueError(f"batch sizes differ: q {q.shape}, k {k.shape}, v {v.shape}")
  if q.shape[-1] != k.shape[-1]:
    raise ValueError(f"q and k head_dim differ: q {q.shape}, k {k.shape}")
  if k.shape[:3] != v.shape[:3]:
    raise ValueError(f"k and v must agree in batch, seq and heads: k {k.shape}, v {v.shape}")
  hq, hk = q.shape[2], k.shape[2]
  if hq % hk != 0:
    raise ValueError(f"q_heads ({hq}) must be a multiple of kv_heads ({hk}) for GQA/MQA")
  return q.shape[0], q.shape[1], k.shape[1], hq, hk


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
  if segment_ids.shape != (batch, q_len):
    raise ValueError(f"segment_ids must be [batch, q_len] = {(batch, q_len)}, got {segment_ids.shape}")
  if kv_segment_ids.shape != (batch, kv_len):
    raise ValueError(
        f"kv_segment_ids must be [batch, kv_len] = {(batch, kv_len)}, got {kv_segment_ids.shape}")
  for name, s in (("segment_ids", segment_ids), ("kv_segment_ids", kv_segment_ids)):
    if not jnp.issubdtype(s.dtype, jnp.integer):
      raise TypeError(f"{name} must be an integer array, got {s.dtype}")
  return segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32)
