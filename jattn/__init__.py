"""jattn: IO-aware attention for JAX (re-exports only)."""
from jattn.attention import flash_attention, resolve_implementation
from pallas_kernels.block_schedule import BlockSchedule, make_schedule
from jattn.sparse import (BlockSelection, BlockSummaries, block_sparse_attention, captured_mass,
                          init_block_summaries, select_blocks, sparse_attention,
                          sparse_decode_attention, sparse_paged_decode_attention,
                          update_block_summaries)

__all__ = ["flash_attention", "resolve_implementation", "BlockSchedule", "make_schedule",
           "BlockSelection", "BlockSummaries", "block_sparse_attention", "captured_mass",
           "init_block_summaries", "select_blocks", "sparse_attention", "sparse_decode_attention",
           "sparse_paged_decode_attention", "update_block_summaries"]
