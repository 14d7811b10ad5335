"""Reference single-token decode attention over contiguous and paged KV caches (pure jnp).

Semantics of every decode backend (docs/decode.md, "Usage"): sequence b holds ``kv_lengths[b]``
valid keys (clamped to the capacity) and its query sits at ``kv_lengths[b] - 1``; with
``local_window_size=(left, right)`` it sees keys ``j >= kv_lengths[b] - 1 - left``. The
``implementation="xla"`` path of ``jattn.decode`` (``upcast=False``) and the tests' fp32
reference (``upcast=True``); it materialises [batch, q_heads, max_len] logits.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common.util import one_program
from pallas_kernels.flash.reference import softmax_lse
from pallas_kernels.masks import element_mask, normalize_window

__all__ = ["decode_partials", "decode_reference", "gather_pages", "paged_decode_reference"]


def _visible(kv_lengths, num_keys, window):
  """bool [batch, num_keys]: key j of sequence b is visible to its query."""
  lengths = jnp.minimum(kv_lengths.astype(jnp.int32), num_keys)
  return element_mask((lengths - 1)[:, None], jnp.arange(num_keys, dtype=jnp.int32)[None, :],
                      causal=True, window=window, kv_len=lengths[:, None, None])[:, 0, :]


def _logits(q, k_cache, v_cache, kv_lengths, window, scale, logits_soft_cap, upcast,
            hide_k=False):
  """(logits [b, hk, g, n] fp32, -inf where hidden; v [b, n, hk, dv], 0 where hidden; dtype;
  precision). ``hide_k`` also zeroes hidden keys (finite dq)."""
  b, hq, d = q.shape
  _, n, hk, _ = k_cache.shape
  dt = jnp.float32 if upcast else q.dtype
  prec = jax.lax.Precision.HIGHEST if upcast else None
  scale = 1.0 / (d ** 0.5) if scale is None else scale
  visible = _visible(kv_lengths, n, window)                            # [b, n]
  k = jnp.where(visible[:, :, None, None], k_cache.astype(dt), 0) if hide_k else k_cache
  s = jnp.einsum("bhgd,bnhd->bhgn", q.astype(dt).reshape(b, hk, hq // hk, d), k.astype(dt),
                 precision=prec, preferred_element_type=jnp.float32) * scale
  if logits_soft_cap is not None:
    s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
  s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
  return s, jnp.where(visible[:, :, None, None], v_cache.astype(dt), 0), dt, prec


def _split(s, v, splits):
  """Contiguous key chunks: s [b, hk, g, S, c] (padding -inf), v [b, S, c, hk, dv] (padding 0)."""
  (b, hk, g, n), dv = s.shape, v.shape[-1]
  chunk = -(-n // splits)
  pad = chunk * splits - n
  if pad:
    s = jnp.pad(s, ((0, 0),) * 3 + ((0, pad),), constant_values=-jnp.inf)
    v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
  return s.reshape(b, hk, g, splits, chunk), v.reshape(b, splits, chunk, hk, dv)


def decode_reference(q, k_cache, v_cache, kv_lengths, *, scale=None, local_window_size=None,
                     logits_soft_cap=None, num_splits=None, upcast=True):
  """Decode attention of one query token per sequence over a contiguous KV cache.

  Args:
    q: [batch, q_heads, head_dim].
    k_cache, v_cache: [batch, max_len, kv_heads, head_dim]; query head h reads kv head
      h // (q_heads // kv_heads).
    kv_lengths: int32 [batch], number of valid cache entries per sequence.
    scale: logit scale, default 1/sqrt(head_dim).
    local_window_size: None, int or (left, right) (jax.nn convention).
    logits_soft_cap: None or cap: logits = cap * tanh(logits / cap).
    num_splits: None (one pass) or a number of contiguous cache chunks whose partials are
      merged by log-sum-exp (split-KV in plain XLA; same result).
    upcast: fp32 at HIGHEST precision (True), or the input dtype with fp32 accumulation.

  Returns:
    (out [batch, q_heads, head_dim] in q.dtype, lse [batch, q_heads] fp32, -inf when empty).

  Example:
    >>> q = jax.random.normal(jax.random.key(0), (2, 4, 16))
    >>> k = jax.random.normal(jax.random.key(1), (2, 32, 2, 16))
    >>> out, lse = decode_reference(q, k, k, jnp.array([5, 32], jnp.int32))
    >>> out.shape, lse.shape
    ((2, 4, 16), (2, 4))
  """
  splits = 1 if num_splits is None else int(num_splits)
  if splits < 1:
    raise ValueError(f"num_splits must be >= 1, got {num_splits}")
  return _decode(q, k_cache, v_cache, kv_lengths, scale, logits_soft_cap,
                 window=normalize_window(local_window_size), splits=splits, upcast=bool(upcast))


@one_program("window", "splits", "upcast")
def _decode(q, k_cache, v_cache, kv_lengths, scale, logits_soft_cap, *, window, splits, upcast):
  b, hq, _ = q.shape
  s, v, dt, prec = _logits(q, k_cache, v_cache, kv_lengths, window, scale, logits_soft_cap,
                           upcast, hide_k=True)
  s, v = _split(s, v, splits)
  w, lse = softmax_lse(s)                                         # lse [b, hk, g, S]
  o = jnp.einsum("bhgsc,bschd->bhgsd", w.astype(dt), v, precision=prec,
                 preferred_element_type=jnp.float32)              # [b, hk, g, S, d]
  if splits > 1:  # exact log-sum-exp merge of the per-chunk partials (same algebra as jattn.merge)
    w, lse = softmax_lse(lse)
    o = jnp.sum(w[..., None] * o, axis=-2)
  else:
    o, lse = o[..., 0, :], lse[..., 0]
  return o.reshape(b, hq, o.shape[-1]).astype(q.dtype), lse.reshape(b, hq).astype(jnp.float32)


def gather_pages(pages, page_table):
  """Gather a paged cache into a contiguous one.

  Args:
    pages, page_table: [num_pages, page_size, kv_heads, head_dim] and int32 [batch, max_pages]
      (entries outside [0, num_pages) are clamped: they only matter past a sequence's length).

  Returns:
    [batch, max_pages * page_size, kv_heads, head_dim].

  Example:
    >>> pages = jnp.arange(4 * 16 * 1 * 2.0).reshape(4, 16, 1, 2)
    >>> gather_pages(pages, jnp.array([[2, 0]], jnp.int32)).shape
    (1, 32, 1, 2)
  """
  b, max_pages = page_table.shape
  out = jnp.take(pages, jnp.clip(page_table, 0, pages.shape[0] - 1).reshape(-1), axis=0)
  return out.reshape(b, max_pages * pages.shape[1], *pages.shape[2:])


def paged_decode_reference(q, k_pages, v_pages, page_table, kv_lengths, **kwargs):
  """Decode attention over a paged KV cache (gathers the pages, then :func:`decode_reference`).

  Args:
    q, kv_lengths, **kwargs: as in :func:`decode_reference`.
    k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim].
    page_table: int32 [batch, max_pages]; token t of sequence b lives in page
      ``page_table[b, t // page_size]`` at slot ``t % page_size``.

  Returns:
    As :func:`decode_reference`.

  Example:
    >>> q = jax.random.normal(jax.random.key(0), (1, 2, 16))
    >>> pages = jax.random.normal(jax.random.key(1), (3, 16, 1, 16))
    >>> out, lse = paged_decode_reference(q, pages, pages, jnp.array([[2, 0]], jnp.int32),
    ...                                   jnp.array([20], jnp.int32))
    >>> out.shape
    (1, 2, 16)
  """
  return decode_reference(q, gather_pages(k_pages, page_table), gather_pages(v_pages, page_table),
                          kv_lengths, **kwargs)


@one_program("num_splits", "block", "window_left", "upcast")
def decode_partials(q, k_cache, v_cache, kv_lengths, *, page_table=None, num_splits=None,
                    units=None, block=None, m_hat=None, active=None, scale=None,
                    window_left=None, logits_soft_cap=None, upcast=False):
  """The decode kernels' partials in jnp (``implementation="xla"``); splits are contiguous chunks
  of the cache, units mask their blocks out of their row's logits (O(units x capacity) memory).

  Args:
    q, k_cache, v_cache, kv_lengths, num_splits, units, m_hat, active, scale, window_left,
      logits_soft_cap: as ``pallas_kernels.decode.triton.decode_partials``.
    page_table: None, or int32 [batch, max_pages] (the caches are page pools, gathered first).
    block, upcast: keys per unit block; as :func:`decode_reference`.

  Returns:
    As ``pallas_kernels.decode.triton.decode_partials``.

  Example:
    >>> q = jnp.ones((1, 4, 16)); k = jnp.ones((1, 64, 2, 16))
    >>> o, lse = decode_partials(q, k, k, jnp.array([40]), num_splits=2)
    >>> o.shape, lse.shape
    ((1, 2, 4, 16), (1, 2, 4))
  """
  if page_table is not None:
    k_cache, v_cache = gather_pages(k_cache, page_table), gather_pages(v_cache, page_table)
  b, hq, _ = q.shape
  _, n, hk, _ = k_cache.shape
  g, dv = hq // hk, v_cache.shape[-1]
  s, v, dt, prec = _logits(q, k_cache, v_cache, kv_lengths,
                           None if window_left is None else (window_left, 0), scale,
                           logits_soft_cap, upcast)
  if units is None:
    s, v = _split(s, v, num_splits)
    s, v = s.transpose(0, 3, 1, 2, 4), v.transpose(0, 1, 3, 2, 4)     # [b, S, hk, g|c, c|dv]
    m_rows = None if m_hat is None else m_hat.reshape(b, 1, hk, g)
  else:
    row = jnp.clip(units[0], 0, b - 1)
    pos = jnp.arange(n, dtype=jnp.int32)[None, :]
    inside = (pos >= units[1][:, None] * block) & (pos < (units[1] + units[2])[:, None] * block)
    s = jnp.where(inside[:, None, None, :], s[row], -jnp.inf)[None]    # [1, U, hk, g, n]
    v = jnp.swapaxes(v[row], 1, 2)[None]                               # [1, U, hk, n, dv]
    m_rows = None if m_hat is None else m_hat[row].reshape(1, -1, hk, g)
  mx = jnp.max(s, axis=-1)                                             # [P0, P1, hk, g]
  m = jnp.where(jnp.isfinite(mx), mx, 0.0) if m_rows is None else m_rows
  p = jnp.where(jnp.isneginf(s), 0.0, jnp.exp(s - m[..., None]))
  l = jnp.sum(p, axis=-1)
  acc = jnp.einsum("xyhgc,xyhcd->xyhgd", p.astype(dt), v, precision=prec,
                   preferred_element_type=jnp.float32)                 # [P0, P1, hk, g, dv]
  if active is not None:
    on = (active != 0)[..., None]                                      # [P0, P1, hk, 1]
    acc, l, mx = jnp.where(on[..., None], acc, 0.0), jnp.where(on, l, 0.0), jnp.where(
        on, mx, -jnp.inf)
  p0, p1 = s.shape[:2]
  acc, l, mx = acc.reshape(p0, p1, hq, dv), l.reshape(p0, p1, hq), mx.reshape(p0, p1, hq)
  if m_hat is not None:
    return acc, l, mx
  l_safe = jnp.where(l == 0.0, 1.0, l)
  lse = jnp.where(l == 0.0, -jnp.inf, m.reshape(p0, p1, hq) + jnp.log(l_safe))
  return acc / l_safe[..., None], lse
