"""fp32 reference attention: the semantics every backend must match (docs/flash.md, "Usage":
empty rows, masked keys never leak). It materialises the [q_len, kv_len] logits (tests, small
problems, the ``implementation="xla"`` path of ``jattn.flash_attention``) and is differentiable
by autodiff, including through the log-sum-exp, with zero gradients for empty rows.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common.util import one_program
from pallas_kernels.masks import element_mask, normalize_window


def attention_reference(q, k, v, *, causal=False, local_window_size=None, q_segment_ids=None,
                        kv_segment_ids=None, scale=None, logits_soft_cap=None, block_mask=None,
                        bias=None, upcast=True):
  """Reference multi-head attention returning (out, lse).

  Args:
    q, k, v: [batch, q_len, q_heads, head_dim], [batch, kv_len, kv_heads, head_dim] and
      [batch, kv_len, kv_heads, head_dim_v]; q_heads % kv_heads == 0 (GQA).
    causal, local_window_size: bottom-right aligned causal mask; None, int or (left, right)
      (jax.nn convention).
    q_segment_ids, kv_segment_ids: None or int32 [batch, q_len] / [batch, kv_len]; 0 is padding.
    scale, logits_soft_cap: logit scale (None: 1/sqrt(head_dim)); None or cap: logits = cap *
      tanh(logits / cap).
    block_mask: None or bool broadcastable to [batch, kv_heads, q_len, kv_len], an extra mask
      (for example a block-sparse selection expanded to elements); a 4-D mask may also have
      q_heads heads (one mask per query head).
    bias: None or float broadcastable to [batch, q_heads, q_len, kv_len] (4-D; heads 1 or
      q_heads), added to the (soft-capped) logits.
    upcast: compute in fp32 at HIGHEST precision (True) or in the input dtype.

  Returns:
    (out [batch, q_len, q_heads, head_dim_v] in q.dtype, lse [batch, q_heads, q_len] fp32,
    natural log, -inf for rows that see no key).

  Example:
    >>> q = jax.random.normal(jax.random.key(0), (1, 8, 2, 16))
    >>> out, lse = attention_reference(q, q, q, causal=True)
    >>> out.shape, lse.shape
    ((1, 8, 2, 16), (1, 2, 8))
  """
  return _attention(q, k, v, q_segment_ids, kv_segment_ids, scale, logits_soft_cap, block_mask,
                    bias, causal=bool(causal), window=normalize_window(local_window_size),
                    upcast=bool(upcast))


@one_program("causal", "window", "upcast")
def _attention(q, k, v, q_segment_ids, kv_segment_ids, scale, logits_soft_cap, block_mask, bias,
               *, causal, window, upcast):
  b, sq, hq, d = q.shape
  _, sk, hk, _ = k.shape
  bad_key = ~(jnp.isfinite(k).all(-1) & jnp.isfinite(v).all(-1))  # [b, sk, hk]: hidden, rows NaN
  k, v = (jnp.where(bad_key[..., None], jnp.zeros((), x.dtype), x) for x in (k, v))
  scale = 1.0 / (d ** 0.5) if scale is None else scale
  dt = jnp.float32 if upcast else q.dtype
  prec = jax.lax.Precision.HIGHEST if upcast else None
  qf = q.astype(dt).reshape(b, sq, hk, hq // hk, d)  # [b, sq, hk, g, d]
  s = jnp.einsum("bqhgd,bkhd->bhgqk", qf, k.astype(dt), precision=prec).astype(jnp.float32) * scale
  if logits_soft_cap is not None:
    s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
  s = jnp.where(jnp.swapaxes(bad_key, 1, 2)[:, :, None, None], jnp.nan, s)  # rows seeing it: NaN
  seg = {} if q_segment_ids is None else dict(q_seg=q_segment_ids[:, None, None, :],
                                               kv_seg=kv_segment_ids[:, None, None, :])
  mask = element_mask(jnp.arange(sq) + (sk - sq), jnp.arange(sk), causal=causal, window=window,
                      **seg)  # [(b, 1, 1,) sq, sk]
  if bias is not None:
    s = s + _per_kv_head(jnp.asarray(bias, jnp.float32), hq, hk)
  if block_mask is not None:
    bm = jnp.asarray(block_mask, bool)
    mask = mask & (_per_kv_head(bm, hq, hk) if bm.ndim == 4 and bm.shape[1] == hq
                   else jnp.broadcast_to(bm, (b, hk) + bm.shape[-2:])[:, :, None])
  w, lse = softmax_lse(jnp.where(mask, s, -jnp.inf))  # lse [b, hk, g, sq]
  w = jnp.where(mask, w, 0.0)  # a NaN row's hidden keys get weight 0, not NaN
  o = jnp.einsum("bhgqk,bkhd->bqhgd", w.astype(dt), v.astype(dt), precision=prec)
  return (o.reshape(b, sq, hq, v.shape[-1]).astype(q.dtype),
          lse.reshape(b, hq, sq).astype(jnp.float32))


def softmax_lse(s):
  """Softmax over the last axis and its log-sum-exp; a row of only -inf logits gets weights 0
  and lse -inf (the references' convention for a query that sees nothing).

  Args:
    s: fp32 logits [..., S], masked entries -inf.

  Returns:
    (weights [..., S], lse [...]).

  Example:
    >>> w, lse = softmax_lse(jnp.array([[0.0, -jnp.inf], [-jnp.inf, -jnp.inf]]))
    >>> w.tolist(), lse.tolist()
    ([[1.0, 0.0], [0.0, 0.0]], [0.0, -inf])
  """
  m = jnp.max(s, axis=-1, keepdims=True)
  m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  p = jnp.exp(s - m)
  l = jnp.sum(p, axis=-1, keepdims=True)
  l_safe = jnp.where(l == 0.0, 1.0, l)
  return p / l_safe, jnp.where(l == 0.0, -jnp.inf, m + jnp.log(l_safe))[..., 0]


def _per_kv_head(x, hq, hk):
  """[B', 1 | hq, T', S'] -> [B', 1 | hk, 1 | G, T', S'] (query head h = kv head h // G, G-th)."""
  return x[:, :, None] if x.shape[1] == 1 else x.reshape(x.shape[0], hk, hq // hk, *x.shape[2:])
