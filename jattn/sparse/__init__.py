"""Training-time block sparsity and sparse decode (docs/sparse.md), re-exported from
``selection``, ``attention`` (gate gradients included), ``metrics`` and ``decode``."""
from jattn.sparse.attention import block_sparse_attention, block_sparse_plan, sparse_attention
from jattn.sparse.decode import (BlockSummaries, init_block_summaries, select_decode_blocks,
                                 sparse_decode_attention, sparse_decode_plan,
                                 sparse_paged_decode_attention, update_block_summaries)
from jattn.sparse.metrics import block_attention_mass, block_score_kl, captured_mass
from jattn.sparse.selection import BlockSelection, block_scores, select_blocks

__all__ = [
    "BlockSelection", "block_scores", "select_blocks", "block_sparse_attention",
    "block_sparse_plan", "sparse_attention", "captured_mass", "block_attention_mass",
    "block_score_kl", "BlockSummaries", "init_block_summaries", "update_block_summaries",
    "select_decode_blocks", "sparse_decode_attention", "sparse_paged_decode_attention",
    "sparse_decode_plan",
]
