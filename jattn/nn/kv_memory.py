"""KV cache accounting: the bytes ``Attention.init_cache`` allocates (``cache_layout``) for a
``Transformer`` config, less the ring positions (an int32 per ring slot) and the cache index."""

import math

import jax.numpy as jnp

from jattn.nn.attention import cache_layout


def kv_cache_bytes(config, context_len, dtype=jnp.bfloat16, *, batch_size=1):
  """KV cache bytes per layer and in total.

  Args:
    config: TransformerConfig.
    context_len: tokens the cache must serve (the ``max_len`` of ``init_cache``).
    dtype, batch_size: cache dtype and sequences.

  Returns:
    dict(per_layer=[bytes of layer i], total=sum, per_token=total / context_len).

  Example:
    >>> from jattn.nn.transformer import TransformerConfig
    >>> cfg = TransformerConfig(100, 2, 64, 8, 8, 8)
    >>> kv_cache_bytes(cfg, 1024)["total"]   # 2 layers x K,V x 8 heads x 8 dims x 1024 x 2 bytes
    524288
  """
  item, per_layer = jnp.dtype(dtype).itemsize, []
  for spec in config.layers:
    rope, hk, d = config.layer_rope_head_dim(spec), config.num_kv_heads, config.head_dim
    layout = cache_layout(spec, context_len, num_kv_heads=hk, head_dim=d,
                          kv_lora_rank=config.kv_lora_rank, rope_head_dim=rope)
    nbytes = sum(batch_size * n * math.prod(shape) * item for _, n, shape in layout.values())
    if spec.kind == "sparse":   # fp32 running key sums per block (decode-time block scores)
      nbytes += batch_size * -(-context_len // spec.block_size) * hk * (d + rope) * 4
    per_layer.append(nbytes)
  total = sum(per_layer)
  return dict(per_layer=per_layer, total=total, per_token=total / context_len)
