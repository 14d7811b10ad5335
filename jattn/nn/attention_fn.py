"""``dot_product_attention``: an ``attention_fn`` for Flax's attention modules, on jattn."""

import math

import jax.numpy as jnp
from flax.nnx.nn import dtypes

from jattn import dot_product
from jattn._validate import as_array, check_float, check_number


def dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                          dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                          precision=None, module=None, promote_dtype=dtypes.promote_dtype,
                          is_causal=False, *, implementation=None, interpret=False):
  """``flax.nnx.dot_product_attention``'s signature, run by :func:`jattn.dot_product_attention`.

  An ``attention_fn`` for ``flax.nnx.MultiHeadAttention`` (or linen's) without attention dropout
  (docs/flash.md); rows that see no key return 0 (Flax averages every value there).

  Args:
    query: [batch..., q_len, num_heads, head_dim] (any number of batch axes, or none).
    key: [batch..., kv_len, kv_heads, head_dim]; value: [batch..., kv_len, kv_heads, head_dim_v].
    bias: None or float broadcastable to [batch..., num_heads, q_len, kv_len].
    mask: None or bool/float broadcastable like ``bias``; nonzero entries are visible.
    broadcast_dropout, dropout_rng, precision: unused.
    dropout_rate, deterministic: the rate must be 0 unless ``deterministic``.
    dtype: computation dtype (default: promoted from the inputs by ``promote_dtype``).
    module: must be None (attention weights are never materialised, so they cannot be sown).
    promote_dtype: Flax's dtype promotion function.
    is_causal: causal mask (top-left aligned, as Flax and jax.nn).
    implementation, interpret: as :func:`jattn.dot_product_attention`.

  Returns:
    [batch..., q_len, num_heads, head_dim_v] in the computation dtype.

  Raises:
    ValueError: for dropout (``dropout_rate > 0`` and not ``deterministic``) or a ``module``.

  Example:
    >>> import flax.nnx as nnx, jax.numpy as jnp, jattn
    >>> mha = nnx.MultiHeadAttention(num_heads=2, in_features=16, decode=False,
    ...                              attention_fn=jattn.nn.dot_product_attention,
    ...                              rngs=nnx.Rngs(0))
    >>> mha(jnp.ones((1, 10, 16)), mask=nnx.make_causal_mask(jnp.ones((1, 10)))).shape
    (1, 10, 16)
  """
  del broadcast_dropout, dropout_rng, precision
  if check_number("dropout_rate", dropout_rate, 0, 1) > 0 and not deterministic:
    raise ValueError(f"jattn.nn.dot_product_attention has no attention dropout: got "
                     f"dropout_rate={dropout_rate} with deterministic=False (use dropout_rate=0 "
                     f"or deterministic=True)")
  if module is not None:
    raise ValueError("jattn.nn.dot_product_attention cannot sow attention weights (module must "
                     "be None: call the module with sow_weights=False)")
  for name, x in (("query", query), ("key", key), ("value", value)):
    check_float(name, x)
  query, key, value = promote_dtype((query, key, value), dtype=dtype)
  batch = query.shape[:-3]
  if key.shape[:-3] != batch or value.shape[:-3] != batch:
    raise ValueError(f"query, key and value must have the same batch axes: got query "
                     f"{query.shape}, key {key.shape}, value {value.shape}")
  arrays = [None if bias is None else as_array("bias", bias),
            None if mask is None else as_array("mask", mask).astype(bool)]
  if len(batch) > 1:   # one batch axis: [prod(batch...), ...]
    flat = lambda x: x.reshape((math.prod(batch),) + x.shape[len(batch):])
    query, key, value = flat(query), flat(key), flat(value)
    arrays = [None if x is None else flat(jnp.broadcast_to(x, batch + x.shape[-3:]))
              for x in arrays]
  out = dot_product.dot_product_attention(query, key, value, *arrays, is_causal=is_causal,
                                         implementation=implementation, interpret=interpret)
  return out.reshape(batch + out.shape[-3:])
