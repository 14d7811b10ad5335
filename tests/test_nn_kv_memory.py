"""KV cache accounting: the seed's budgets and agreement with what init_cache allocates."""
import math

import jax.numpy as jnp
from flax import nnx

from jattn.nn import (LayerSpec, Transformer, TransformerConfig, kv_cache_bytes,
                      local_global_schedule)

SEED = dict(vocab_size=1000, d_model=512, num_heads=8, num_kv_heads=8, head_dim=64)


def test_local_global_5to1_at_32k_is_at_most_20_percent():
  dense = TransformerConfig(num_layers=12, **SEED)
  lg = TransformerConfig(num_layers=12, layers=local_global_schedule(12, 5, window=512), **SEED)
  full = kv_cache_bytes(dense, 32768, jnp.bfloat16)
  ours = kv_cache_bytes(lg, 32768, jnp.bfloat16)
  assert full["total"] == 12 * 2 * 8 * 64 * 32768 * 2
  assert ours["total"] <= 0.20 * full["total"]
  assert ours["per_layer"][5] == full["per_layer"][5]                 # global layers: full cache
  assert ours["per_layer"][0] == full["per_layer"][0] * 512 // 32768  # local: ring of 512


def test_csa_compressed_at_32k_is_at_most_30_percent():
  dense = TransformerConfig(num_layers=12, **SEED)
  csa = TransformerConfig(num_layers=12, **SEED, layers=tuple(
      LayerSpec("csa", window=512, top_k=64, compress_ratio=4) for _ in range(12)))
  ratio = kv_cache_bytes(csa, 32768)["total"] / kv_cache_bytes(dense, 32768)["total"]
  assert ratio <= 0.30
  assert ratio > 0.25        # 1/4 compressed + the raw window: not free
  gqa_csa = TransformerConfig(num_layers=12, **{**SEED, "num_kv_heads": 1}, layers=csa.layers)
  joint = kv_cache_bytes(dense, 32768)["total"] / kv_cache_bytes(gqa_csa, 32768)["total"]
  assert 16 <= joint <= 32


def test_accounting_matches_allocated_caches():
  layers = (LayerSpec("local", window=7), LayerSpec("global", rope_base=None),
            LayerSpec("sparse", top_k=2, block_size=4),
            LayerSpec("csa", window=5, top_k=2, compress_ratio=3),
            LayerSpec("csa", csa_mode="two_stage", top_k=1, block_size=6, compress_ratio=3))
  # by hand, batch 3, bf16, 50 tokens, 2 kv heads x 4 dims (48 bytes per token and array):
  # local ring 7 x (K, V); global/sparse 50 x (K, V); CSA compressed: 17 entries x (K, V) + a raw
  # ring of max(5, 2*3) + a gate ring of 6; two_stage: raw 50 + 17 entries + gate ring 6.
  # MLA (latent 6, RoPE key 2): 48 bytes per token with RoPE, 36 without (global NoPE).
  # sparse also keeps fp32 key sums per 4-token block: 3 x 13 blocks x 2 heads x 4 dims x 4 B.
  expected = ([48 * 14, 48 * 100, 48 * 100 + 3 * 13 * 2 * 4 * 4, 48 * (34 + 12 + 12),
               48 * (100 + 34 + 12)],
              [48 * 7, 36 * 50, 48 * 50 + 3 * 13 * 2 * 6 * 4])   # MLA sparse: k is 4 + 2 dims
  for kw, want in zip((dict(layers=layers), dict(layers=layers[:3], kv_lora_rank=6,
                                                  rope_head_dim=2)), expected):
    cfg = TransformerConfig(vocab_size=11, num_layers=len(kw["layers"]), d_model=16, num_heads=4,
                            num_kv_heads=2, head_dim=4, **{k: v for k, v in kw.items()})

    def build():
      m = Transformer(cfg, rngs=nnx.Rngs(0))
      m.init_cache(3, 50, jnp.bfloat16)
      return m

    model = nnx.eval_shape(build)            # shapes and dtypes only
    got = []
    for blk in model.blocks:
      a = blk.attn
      arrs = [getattr(a, f"cache_{n}") for n in a.cache_names]
      if hasattr(a, "cache_block_sums"):
        arrs.append(a.cache_block_sums)
      got.append(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in arrs))
    acct = kv_cache_bytes(cfg, 50, jnp.bfloat16, batch_size=3)
    assert acct["per_layer"] == got == want
    assert acct["total"] == sum(got)
