"""CSA: compressed sparse attention along the token axis (docs/nn.md, "Layer kinds").

Entry c pools raw tokens ``[c*r, c*r + 2r)`` (r = ratio) with learned weights (values alike),

    ck[c] = sum_j softmax_j(gate_k[c*r + j] + bias_k[j]) * k[c*r + j]      (per channel)

and is visible to a query at t iff ``c*r + 2r - 1 <= t`` (the "compressed" mode does not exclude
entries its raw window overlaps). Pure functions shared by training and decode (selections are
non-differentiable); query rows run in chunks under ``jax.checkpoint`` (no whole logits)."""

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jattn.merge import merge
from pallas_kernels.common.softmax import safe_lse
from pallas_kernels.common.util import pad_axis
from pallas_kernels.flash.reference import attention_reference

_HI = jax.lax.Precision.HIGHEST
# fp32 logits per query chunk of "compressed" (elements of [batch, q_heads, rows, entries]):
# 2**25 = 128 MiB, i.e. 512 rows at batch 8, 4 heads, 2048 entries.
CHUNK_ELEMENTS = 1 << 25
_SELECTION = "csa_selection"


def num_entries(num_tokens, ratio):
  """Compressed slots for ``num_tokens`` raw tokens (the last may never complete).

  Args:
    num_tokens, ratio: raw tokens and compression ratio r.

  Returns:
    int ``ceil(num_tokens / r)``.

  Example:
    >>> num_entries(30, 4)
    8
  """
  return -(-num_tokens // ratio)


def entry_end(c, ratio):
  """Position of the last raw token of compressed entry(ies) ``c`` (visible to t iff end <= t).

  Args:
    c, ratio: int or int array of entry indices, and compression ratio r.

  Returns:
    ``c * r + 2r - 1`` (same type as c).

  Example:
    >>> entry_end(0, 4), entry_end(1, 4)
    (7, 11)
  """
  return c * ratio + 2 * ratio - 1


@functools.partial(jax.checkpoint, static_argnums=(3, 4))  # no fp32 [b, C, 2r, h, d] residuals
def pool_windows(x, gate, bias, ratio, n_entries):
  """Learned weighted pooling of raw tokens into overlapping windows (width 2r, stride r).

  Args:
    x, gate: [batch, n, heads, dim] raw keys or values, and their gate logits.
    bias, ratio: [2r, heads, dim] learned position bias, and r.
    n_entries: compressed entries to produce (tokens past ``n`` are zero padding).

  Returns:
    [batch, n_entries, heads, dim] in fp32.

  Example:
    >>> x = jnp.ones((1, 16, 2, 4))
    >>> pool_windows(x, x, jnp.zeros((8, 2, 4)), 4, 4).shape
    (1, 4, 2, 4)
  """
  n, need = x.shape[1], n_entries * ratio + ratio
  if need > n:
    x, gate = pad_axis(x, 1, need), pad_axis(gate, 1, need)

  def windows(a):  # [b, C, 2r, h, d]: window c = tokens c*r .. c*r + 2r - 1 (no gather)
    lo = a[:, :n_entries * ratio].reshape(a.shape[0], n_entries, ratio, *a.shape[2:])
    hi = a[:, ratio:need].reshape(lo.shape)
    return jnp.concatenate([lo, hi], axis=2).astype(jnp.float32)
  return pool_one_window(windows(x), windows(gate), bias)


def pool_one_window(xw, gw, bias):
  """Pool explicitly gathered windows (the decode path's new entries).

  Args:
    xw, gw: [batch, m, 2r, heads, dim] raw keys or values of m windows, and their gate logits.
    bias: as :func:`pool_windows`.

  Returns:
    [batch, m, heads, dim] fp32, equal to ``pool_windows`` on the same windows.

  Example:
    >>> w = jnp.ones((1, 3, 8, 2, 4))
    >>> pool_one_window(w, w, jnp.zeros((8, 2, 4))).shape
    (1, 3, 2, 4)
  """
  w = jax.nn.softmax(gw.astype(jnp.float32) + bias.astype(jnp.float32), axis=2)
  return jnp.sum(w * xw.astype(jnp.float32), axis=2)


def _entry_scores(q, ck, q_pos, ratio, scale):
  """Scaled logits q . ck masked to visible entries: [b, hk, g, t, C] fp32 (-inf = invisible)."""
  (b, t, hq, d), c, hk = q.shape, ck.shape[1], ck.shape[2]
  qf = q.astype(jnp.float32).reshape(b, t, hk, hq // hk, d)                     # [b, t, hk, g, d]
  s = jnp.einsum("bthgd,bchd->bhgtc", qf, ck.astype(jnp.float32), precision=_HI) * scale
  vis = entry_end(jnp.arange(c), ratio)[None, :] <= q_pos[:, :, None]          # [b, t, C]
  return jnp.where(vis[:, None, None], s, -jnp.inf), vis


def _softmax_partial(s, cv):
  """Softmax of masked logits s [b, hk, g, t, C] over values cv [b, C, hk, dv]: (out [b, t, hq, dv],
  lse [b, t, hq]) fp32; 0 / -inf for rows with no entry."""
  (b, hk, g, t, _), m = s.shape, jnp.max(s, axis=-1, keepdims=True)
  m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  p = jnp.exp(s - m)
  l, lse = safe_lse(m, jnp.sum(p, axis=-1, keepdims=True))                   # lse [b, hk, g, t, 1]
  o = jnp.einsum("bhgtc,bchd->bthgd", p / l, cv.astype(jnp.float32), precision=_HI)
  return o.reshape(b, t, hk * g, -1), lse[..., 0].transpose(0, 3, 1, 2).reshape(b, t, hk * g)


def _top_k_mask(s, k):
  """Bool mask of the k largest finite entries along the last axis (ties at the k-th may add)."""
  k = min(k, s.shape[-1])
  kth = jax.lax.top_k(jax.lax.stop_gradient(s), k)[0][..., -1:]
  return (s >= kth) & jnp.isfinite(s)


def _saved_selection(mask):
  """``mask`` (bool [..., n]) as the value a chunk's backward reuses: saved bit-packed (bit j of
  uint32 word w = mask[32 w + j]) under ``_SELECTION`` by ``_map_query_chunks``'s remat policy."""
  n, bit = mask.shape[-1], jnp.arange(32, dtype=jnp.uint32)
  words = -(-n // 32)
  m = pad_axis(mask, -1, words * 32).reshape(*mask.shape[:-1], words, 32).astype(jnp.uint32)
  bits = checkpoint_name(jnp.sum(m << bit, axis=-1, dtype=jnp.uint32), _SELECTION)
  return ((bits[..., None] >> bit) & 1).reshape(*mask.shape[:-1], -1)[..., :n].astype(jnp.bool_)


def query_chunk(q_chunk, batch, q_heads, q_len, entries):
  """Query rows per chunk of ``compressed_partial`` (explicit, or from ``CHUNK_ELEMENTS``).

  Args:
    q_chunk: None (auto: the largest power of two with batch * q_heads * rows * entries <=
      ``CHUNK_ELEMENTS``, at least 1) or a positive int.
    batch, q_heads, q_len, entries: the logits' dimensions.

  Returns:
    int in [1, q_len] (q_len: one chunk).

  Example:
    >>> query_chunk(None, 8, 4, 8192, 2048)
    512
  """
  if q_chunk is None:
    rows = max(1, CHUNK_ELEMENTS // max(1, batch * q_heads * entries))
    q_chunk = 1 << (rows.bit_length() - 1)
  if q_chunk < 1:
    raise ValueError(f"q_chunk must be >= 1, got {q_chunk}")
  return max(1, min(q_chunk, q_len))


def _map_query_chunks(fn, q, q_pos, chunk):
  """Row-wise ``fn(q, q_pos) -> (o, lse)`` over chunks of ``chunk`` rows, each under
  ``jax.checkpoint`` saving only ``_SELECTION``; padded rows (position -1) are sliced off."""
  body = jax.checkpoint(fn, policy=jax.checkpoint_policies.save_only_these_names(_SELECTION))
  b, t = q.shape[:2]
  if chunk >= t:
    return body(q, q_pos)
  n = -(-t // chunk)
  q, q_pos = pad_axis(q, 1, n * chunk), pad_axis(q_pos, 1, n * chunk, -1)
  split = lambda x: jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0)
  outs = jax.lax.map(lambda a: body(*a), (split(q), split(q_pos)))
  unchunk = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, n * chunk, *x.shape[3:])[:, :t]
  return jax.tree.map(unchunk, outs)


def compressed_partial(q, ck, cv, q_pos, *, ratio, top_k, scale, q_chunk=None):
  """Attention of each query head over its top-K visible compressed entries.

  Args:
    q: [batch, t, q_heads, d] queries (after RoPE / norms).
    ck, cv: [batch, C, kv_heads, d | dv] compressed keys and values.
    q_pos: int [batch, t] absolute query positions.
    ratio, top_k, scale: compression ratio r, entries kept per query head and token, logit scale.
    q_chunk: query rows per chunk (None: ``query_chunk``'s budget; >= t: one chunk); chunking
      changes only the peak memory, not the math.

  Returns:
    (out [batch, t, q_heads, dv] fp32, lse [batch, t, q_heads] fp32), a partial for ``jattn.merge``.

  Example:
    >>> q = jnp.ones((1, 8, 2, 4)); ck = jnp.ones((1, 2, 1, 4))
    >>> o, lse = compressed_partial(q, ck, ck, jnp.arange(8)[None], ratio=4, top_k=1, scale=0.5)
    >>> o.shape, lse.shape
    ((1, 8, 2, 4), (1, 8, 2))
  """
  def rows(q, q_pos):
    s, _ = _entry_scores(q, ck, q_pos, ratio, scale)
    # The backward reuses the forward's selection (saved as bits), not a top-K threshold: the
    # recomputed s need not be bit-identical, so a threshold could drop the K-th entry's gradient.
    s = jnp.where(_saved_selection(_top_k_mask(s, top_k)), s, -jnp.inf)
    return _softmax_partial(s, cv)
  b, t, hq, _ = q.shape
  return _map_query_chunks(rows, q, q_pos, query_chunk(q_chunk, b, hq, t, ck.shape[1]))


def sink_partial(sink, shape_o):
  """A learned sink as a partial: zero output with lse = sink[h] (one extra softmax logit).

  Args:
    sink: [q_heads] sink logits.
    shape_o: (batch, t, q_heads, dv) of the partial to merge with.

  Returns:
    (zeros [batch, t, q_heads, dv] fp32, lse [batch, t, q_heads] fp32).

  Example:
    >>> o, lse = sink_partial(jnp.zeros(2), (1, 3, 2, 4))
    >>> o.shape, lse.shape
    ((1, 3, 2, 4), (1, 3, 2))
  """
  lse = jnp.broadcast_to(sink.astype(jnp.float32)[None, None, :], tuple(shape_o[:3]))
  return jnp.zeros(tuple(shape_o), jnp.float32), lse


def two_stage_attention(q, k, v, ck, cv, q_pos, *, ratio, block_size, top_k, scale, q_chunk=None):
  """Coarse-to-fine attention: compressed keys pick blocks, raw KV of those blocks is attended.

  Args:
    q, ck, cv, q_pos, scale, q_chunk: as :func:`compressed_partial` (``q_chunk``'s budget
      counts the raw keys).
    k, v: [batch, kv_len, kv_heads, d | dv] raw keys and values; key j sits at position j (rows
      past the filled length lie after every query).
    ratio, block_size: r, and raw tokens per block (a multiple of r).
    top_k: past blocks attended precisely per query token and kv head.

  Returns:
    (out [batch, t, q_heads, dv] fp32, lse [batch, t, q_heads] fp32).

  Example:
    >>> q, k, ck = jnp.ones((1, 16, 2, 8)), jnp.ones((1, 16, 1, 8)), jnp.ones((1, 4, 1, 8))
    >>> o, lse = two_stage_attention(q, k, k, ck, ck, jnp.arange(16)[None], ratio=4,
    ...                              block_size=8, top_k=1, scale=0.35)
    >>> o.shape
    (1, 16, 2, 8)
  """
  if block_size % ratio:
    raise ValueError(f"block_size ({block_size}) must be a multiple of ratio ({ratio})")
  (b, t, hq), kv_len, c = q.shape[:3], k.shape[1], ck.shape[1]
  epb = block_size // ratio                                   # entries starting in each block
  nb = max(-(-kv_len // block_size), -(-c // epb))
  kp, blocks = jnp.arange(kv_len), jnp.arange(nb)

  def rows(q, q_pos):
    s, vis = _entry_scores(q, ck, q_pos, ratio, scale)        # [b, hk, g, rows, C]
    # Block scores per kv head: best group-mean entry score among the block's visible entries.
    sg = jnp.where(vis[:, None], jnp.mean(jnp.where(vis[:, None, None], s, 0.0), axis=2), -jnp.inf)
    sg = pad_axis(sg, 3, nb * epb, -jnp.inf)
    block_score = jnp.max(sg.reshape(*sg.shape[:3], nb, epb), axis=-1)   # [b, hk, rows, nb]
    own = (q_pos // block_size)[:, None, :, None]                         # [b, 1, rows, 1]
    block_score = jnp.where(blocks < own, block_score, -jnp.inf)          # past blocks only
    fine = _saved_selection(_top_k_mask(block_score, top_k) | (blocks == own))  # [b, hk, rows, nb]
    fine_mask = jnp.take(fine, kp // block_size, axis=-1)                 # [b, hk, rows, kv_len]
    fine_mask = fine_mask & (kp[None, None, None, :] <= q_pos[:, None, :, None])
    o_f, lse_f = attention_reference(q, k, v, causal=False, block_mask=fine_mask, scale=scale)
    # Coarse partial: visible entries whose block is not attended precisely.
    coarse = ~jnp.take(fine, jnp.arange(c) * ratio // block_size, axis=-1)   # [b, hk, rows, C]
    o_c, lse_c = _softmax_partial(jnp.where(coarse[:, :, None], s, -jnp.inf), cv)
    return merge(o_f.astype(jnp.float32), lse_f.transpose(0, 2, 1), o_c, lse_c)
  return _map_query_chunks(rows, q, q_pos, query_chunk(q_chunk, b, hq, t, max(kv_len, c)))
