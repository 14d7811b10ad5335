"""jattn: IO-aware attention for JAX (re-exports only)."""
from jattn.attention import flash_attention, resolve_implementation
from pallas_kernels.block_schedule import BlockSchedule, make_schedule

__all__ = ["flash_attention", "resolve_implementation", "BlockSchedule", "make_schedule"]
