"""Flax NNX modules built on jattn (re-exports only)."""
from jattn.nn.attention import Attention, cache_layout
from jattn.nn.attention_fn import dot_product_attention
from jattn.nn.kv_memory import kv_cache_bytes
from jattn.nn.rope import apply_rope, rope_frequencies
from jattn.nn.schedule import LayerSpec, local_global_schedule
from jattn.nn.transformer import (MLP, Block, Transformer, TransformerConfig,
                                  attention_probabilities, sparsify, sparsify_config, with_config)

__all__ = ["Attention", "cache_layout", "dot_product_attention", "kv_cache_bytes", "apply_rope",
           "rope_frequencies", "LayerSpec", "local_global_schedule", "MLP", "Block",
           "Transformer", "TransformerConfig", "attention_probabilities", "sparsify",
           "sparsify_config", "with_config"]
