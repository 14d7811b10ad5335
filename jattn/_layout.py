"""KV cache layouts of the decode ops (``kv_layout``, docs/decode.md): "hnd" runs as the "nhd"
cache of batch x kv_heads one-head sequences (query head ``h * G + g`` becomes query head g of
sequence ``b * kv_heads + h``), shared by ``jattn.decode`` and ``jattn.sparse``."""
from __future__ import annotations

import jax.numpy as jnp

KV_LAYOUTS = ("nhd", "hnd")


def check_kv_layout(kv_layout, name="kv_layout"):
  """ValueError unless ``kv_layout`` is "nhd" or "hnd"."""
  if kv_layout not in KV_LAYOUTS:
    raise ValueError(f"{name} must be 'nhd' ([batch, len, kv_heads, head_dim]) or 'hnd' "
                     f"([batch, kv_heads, len, head_dim]), got {kv_layout!r}")


def hnd_as_sequences(q, k, v, kv_lengths):
  """A head-major decode call (q [b, hq, d], k/v [b, hk, n, d | dv], kv_lengths [b]; validated
  by ``jattn.decode.check_decode_call``) as the "nhd" call of b * hk one-kv-head sequences;
  :func:`sequences_as_hnd` turns its results back.

  Example:
    >>> q, k, v, lens = hnd_as_sequences(jnp.zeros((2, 8, 16)), jnp.zeros((2, 4, 64, 16)),
    ...                                  jnp.zeros((2, 4, 64, 8)), jnp.array([3, 5]))
    >>> q.shape, k.shape, v.shape, lens.tolist()
    ((8, 2, 16), (8, 64, 1, 16), (8, 64, 1, 8), [3, 3, 3, 3, 5, 5, 5, 5])
  """
  b, hk, n, d = k.shape
  g = q.shape[1] // hk
  return (q.reshape(b * hk, g, d), k.reshape(b * hk, n, 1, d),
          v.reshape(b * hk, n, 1, v.shape[-1]), jnp.repeat(jnp.asarray(kv_lengths), hk))


def hnd_pages_as_sequences(q, k_pages, v_pages, page_table, kv_lengths):
  """:func:`hnd_as_sequences` for pools [num_pages, kv_heads, page_size, d], reshaped (free) to
  [num_pages * kv_heads, page_size, 1, d]: page p of kv head h becomes page ``p * kv_heads + h``
  (ids clamped to the pool).

  Example:
    >>> pages = jnp.zeros((3, 2, 16, 8))
    >>> out = hnd_pages_as_sequences(jnp.zeros((1, 4, 8)), pages, pages, jnp.array([[2, 0]]),
    ...                              jnp.array([20]))
    >>> out[1].shape, out[3].tolist(), out[4].tolist()
    ((6, 16, 1, 8), [[4, 0], [5, 1]], [20, 20])
  """
  p, hk, ps, d = k_pages.shape
  b, hq, _ = q.shape
  table = jnp.clip(page_table, 0, p - 1)[:, None, :] * hk + jnp.arange(hk, dtype=page_table.dtype)[
      None, :, None]                                  # ids clamped into the pool, as for "nhd"
  return (q.reshape(b * hk, hq // hk, d), k_pages.reshape(p * hk, ps, 1, d),
          v_pages.reshape(p * hk, ps, 1, v_pages.shape[-1]), table.reshape(b * hk, -1),
          jnp.repeat(jnp.asarray(kv_lengths), hk))


def sequences_as_hnd(batch, *per_query_head):
  """Results [batch * kv_heads, G, ...] of the :func:`hnd_as_sequences` call, each reshaped back
  to [batch, q_heads, ...]."""
  return tuple(x.reshape(batch, x.shape[0] // batch * x.shape[1], *x.shape[2:])
               for x in per_query_head)
