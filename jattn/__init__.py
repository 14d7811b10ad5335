"""jattn: IO-aware attention for JAX (re-exports only; ``jattn.nn`` loads on first use)."""
import importlib

from jattn._plan import Plan
from jattn._validate import debug_checks
from jattn.attention import flash_attention, flash_attention_plan
from jattn.dot_product import dot_product_attention
from jattn.context_parallel import (ContextParallelPlan, context_parallel_attention,
                                    context_parallel_attention_shard,
                                    context_parallel_decode_attention, context_parallel_permute,
                                    context_parallel_plan, context_parallel_unpermute)
from pallas_kernels.block_schedule import BlockSchedule, make_schedule
from jattn.decode import (append_kv, append_kv_paged, decode_attention, decode_plan,
                          paged_decode_attention)
from jattn.decode_serving import DecodeSchedule, decode_schedule
from jattn.packing import PackPlan, pack_bfd, segments_from_lengths
from jattn.merge import merge_partials  # jattn.merge stays the module (merge() lives there)
from jattn.sparse import (BlockSelection, BlockSummaries, block_sparse_attention,
                          block_sparse_plan, captured_mass, init_block_summaries, select_blocks,
                          sparse_attention, sparse_decode_attention,
                          sparse_paged_decode_attention, update_block_summaries)

__version__ = "0.1.0"

__all__ = ["__version__", "nn", "Plan", "debug_checks", "flash_attention", "flash_attention_plan",
           "dot_product_attention", "BlockSchedule", "make_schedule",
           "BlockSelection", "BlockSummaries", "block_sparse_attention", "block_sparse_plan",
           "captured_mass",
           "init_block_summaries", "select_blocks", "sparse_attention", "sparse_decode_attention",
           "sparse_paged_decode_attention", "update_block_summaries",
           "decode_attention", "decode_plan", "paged_decode_attention", "append_kv",
           "append_kv_paged", "DecodeSchedule", "decode_schedule",
           "merge_partials", "PackPlan", "pack_bfd", "segments_from_lengths",
           "ContextParallelPlan", "context_parallel_attention", "context_parallel_attention_shard",
           "context_parallel_decode_attention", "context_parallel_permute",
           "context_parallel_plan", "context_parallel_unpermute"]


def __getattr__(name):
  # ``jattn.nn`` (Flax NNX layers) imports flax: loaded on first access, keeping the import light
  if name == "nn":
    return importlib.import_module("jattn.nn")
  raise AttributeError(f"module 'jattn' has no attribute {name!r}")
