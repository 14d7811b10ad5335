"""KV cache layouts of the decode ops (``kv_layout``), shared by ``jattn.decode`` and ``.sparse``.

"nhd" (default): k/v ``[batch, max_len, kv_heads, head_dim]``. "hnd" (head-major):
``[batch, kv_heads, max_len, head_dim]``, run with no kernel change as the "nhd" cache of
batch x kv_heads one-head sequences (a free reshape): query head ``h * G + g`` (G = q_heads //
kv_heads) becomes query head g of sequence ``b * kv_heads + h``. Head-major pages likewise.
"""
from __future__ import annotations

import jax.numpy as jnp

KV_LAYOUTS = ("nhd", "hnd")


def check_kv_layout(kv_layout, name="kv_layout"):
  """ValueError unless ``kv_layout`` is "nhd" or "hnd"."""
  if kv_layout not in KV_LAYOUTS:
    raise ValueError(f"{name} must be 'nhd' ([batch, len, kv_heads, head_dim]) or 'hnd' "
                     f"([batch, kv_heads, len, head_dim]), got {kv_layout!r}")


def check_hnd_shapes(q, k, v, kv_lengths=None):
  """(batch, kv_heads, max_len); ValueError unless q [b, hq, d], k [b, hk, n, d], v [b, hk, n,
  dv] (and kv_lengths [b]) form a head-major decode call with hq a multiple of hk."""
  if q.ndim != 3:
    raise ValueError(f"q must be [batch, q_heads, head_dim], got {q.shape}")
  if k.ndim != 4 or v.ndim != 4 or v.shape[:3] != k.shape[:3]:
    raise ValueError(f"with kv_layout='hnd', k/v must be [batch, kv_heads, len, d] and agree "
                     f"in all but the last dim (v's head_dim may differ), got {k.shape} / "
                     f"{v.shape}")
  b, hk, n, d = k.shape
  if q.shape[-1] != d or q.shape[1] % hk:
    raise ValueError(f"q {q.shape} does not match the head-major cache {k.shape} "
                     f"([batch, kv_heads, len, head_dim])")
  if q.shape[0] != b:
    raise ValueError(f"q batch {q.shape[0]} != cache batch {b}")
  if kv_lengths is not None and jnp.shape(kv_lengths) != (b,):
    raise ValueError(f"kv_lengths must have shape (batch,) = ({b},), got {jnp.shape(kv_lengths)}")
  return b, hk, n


def hnd_as_sequences(q, k, v, kv_lengths):
  """A head-major decode call (q [b, hq, d], k/v [b, hk, n, d | dv], kv_lengths [b]) as the
  "nhd" call of b * hk one-kv-head sequences; :func:`sequences_as_hnd` turns its results back.

  Example:
    >>> q, k, v, lens = hnd_as_sequences(jnp.zeros((2, 8, 16)), jnp.zeros((2, 4, 64, 16)),
    ...                                  jnp.zeros((2, 4, 64, 8)), jnp.array([3, 5]))
    >>> q.shape, k.shape, v.shape, lens.tolist()
    ((8, 2, 16), (8, 64, 1, 16), (8, 64, 1, 8), [3, 3, 3, 3, 5, 5, 5, 5])
  """
  b, hk, n = check_hnd_shapes(q, k, v, kv_lengths)
  d, g = k.shape[-1], q.shape[1] // hk
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
