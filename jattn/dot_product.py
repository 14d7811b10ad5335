"""``dot_product_attention``: ``jax.nn.dot_product_attention``'s signature on
:func:`jattn.flash_attention` (sequence lengths become segment ids, top-left aligned masks
bottom-right aligned ones over equal padded lengths)."""

import jax.numpy as jnp

from jattn._validate import as_array, check_flags, check_qkv
from jattn.attention import broadcast_mask_or_bias, flash_attention
from pallas_kernels.common.util import pad_axis
from pallas_kernels.masks import normalize_window


def _lengths(name, x, batch):
  if x is None:
    return None
  x = as_array(name, x)
  if x.shape != (batch,) or not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array of shape (batch,) = ({batch},), got "
                     f"{x.dtype} {x.shape}")
  return x.astype(jnp.int32)


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                          is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size=None, implementation=None, interpret=False):
  """Scaled dot-product attention with ``jax.nn.dot_product_attention``'s signature.

  Same shapes and semantics as jax.nn (top-left aligned masks and windows, sequence lengths,
  boolean masks, additive biases); the few differences are listed in docs/flash.md.

  Args:
    query: [batch, q_len, q_heads, head_dim] or [q_len, q_heads, head_dim].
    key, value: [batch, kv_len, kv_heads, head_dim(_v)] (query's rank); kv_heads divides q_heads.
    bias: None or float, broadcastable to [batch, q_heads, q_len, kv_len] (at most 4-D; missing
      leading axes are added; each axis 1 or full), added to the scaled logits.
    mask: None or bool, shaped like ``bias``; True where a query may see a key.
    scale: logit scale (None: 1 / sqrt(head_dim)).
    is_causal: query i sees keys j <= i (top-left aligned, as jax.nn).
    query_seq_lengths, key_value_seq_lengths: None or int [batch]: rows at or past the length
      see no key (output 0); keys at or past it are masked.
    local_window_size: None, int w or (left, right): query i sees keys i - left .. i + right.
    implementation: None (:func:`jattn.flash_attention_plan`) or a name of
      :func:`jattn.flash_attention`'s; ``mask`` and ``bias`` run on "xla" and "triton" only.
    interpret: run a Pallas kernel in interpret mode (CPU tests).

  Returns:
    The output, shaped like ``query`` with value's head_dim, in query's dtype.

  Example:
    >>> import jax
    >>> q, k = jnp.ones((2, 100, 4, 64)), jnp.ones((2, 80, 2, 64))
    >>> m = jax.random.bernoulli(jax.random.key(2), 0.5, (2, 1, 100, 80))
    >>> dot_product_attention(q, k, k, mask=m, is_causal=True).shape
    (2, 100, 4, 64)
  """
  query, key, value = map(as_array, ("query", "key", "value"), (query, key, value))
  rank = query.ndim
  if rank not in (3, 4) or key.ndim != rank or value.ndim != rank:
    raise ValueError(f"query, key and value must all be rank 4 (BTNH) or all rank 3 (TNH), got "
                     f"shapes {query.shape}, {key.shape}, {value.shape}")
  check_flags(is_causal=is_causal)
  q, k, v = (jnp.asarray(x) if rank == 4 else jnp.asarray(x)[None] for x in (query, key, value))
  check_qkv(q, k, v, names=("query", "key", "value"))
  (b, t, n, _), s = q.shape, k.shape[1]
  arrays = {}
  for name, x in (("mask", mask), ("bias", bias)):
    if x is not None:
      x = as_array(name, x)
      if x.ndim > 4:
        raise ValueError(f"{name} must have at most 4 axes, got shape {x.shape}")
      arrays[name] = broadcast_mask_or_bias(name, x.reshape((1,) * (4 - x.ndim) + x.shape),
                                            (b, n, t, s))
  q_len = _lengths("query_seq_lengths", query_seq_lengths, b)
  kv_len = _lengths("key_value_seq_lengths", key_value_seq_lengths, b)
  window = normalize_window(local_window_size)

  # jax.nn aligns causal masks and windows top-left, jattn bottom-right: the same for equal
  # lengths. Keys past the last visible one (t - 1 + right) are dropped; then the shorter side
  # is padded (padded keys are masked, padded queries are sliced off).
  if (is_causal or window is not None) and t != s:
    right = 0 if is_causal else window[1]
    s_vis = s if right is None else min(s, t + right)
    length = max(t, s_vis)
    q, k, v = (pad_axis(x, 1, length) for x in (q, k[:, :s_vis], v[:, :s_vis]))
    arrays = {name: pad_axis(pad_axis(x[..., :s_vis], 3, length), 2, length)
              for name, x in arrays.items()}
    if length != s_vis:   # padded keys: masked by the kv lengths
      kv_len = (jnp.full((b,), s_vis, jnp.int32) if kv_len is None else jnp.minimum(kv_len, s_vis))
  seg = kv_seg = None
  if q_len is not None or kv_len is not None:
    seg, kv_seg = ((jnp.arange(n, dtype=jnp.int32) < (n if x is None else x[:, None]))
                   .astype(jnp.int32) * jnp.ones((b, 1), jnp.int32)
                   for x, n in ((q_len, q.shape[1]), (kv_len, k.shape[1])))
  out = flash_attention(q, k, v, causal=is_causal, local_window_size=window, segment_ids=seg,
                        kv_segment_ids=kv_seg, scale=scale, implementation=implementation,
                        interpret=interpret, **arrays)[:, :t]
  return out if rank == 4 else out[0]
