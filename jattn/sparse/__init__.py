"""Training-time block sparsity and sparse decode (re-exports only).

* :mod:`jattn.sparse.selection`: :func:`block_scores`, :func:`select_blocks` ->
  :class:`BlockSelection`.
* :mod:`jattn.sparse.attention`: :func:`block_sparse_attention`, :func:`block_sparse_plan`,
  :func:`sparse_attention` (selection + attention with gates "none", "ste", "gumbel").
* :mod:`jattn.sparse.metrics`: :func:`captured_mass`, :func:`block_attention_mass`,
  :func:`block_score_kl`.
* :mod:`jattn.sparse.decode`: :class:`BlockSummaries`, :func:`init_block_summaries`,
  :func:`update_block_summaries`, :func:`select_decode_blocks`, :func:`sparse_decode_attention`,
  :func:`sparse_paged_decode_attention`, :func:`sparse_decode_plan`.
"""
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
