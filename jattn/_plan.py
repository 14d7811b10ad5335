"""The resolved plan of a call: which implementation runs, with which kernel configs
(docs/design.md, "How a call is planned"); the ``*_plan`` functions return it."""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Plan:
  """What one call runs.

  Attributes:
    op: the op family: "flash", "block_sparse", "decode", "paged_decode", "sparse_decode".
    implementation: the forward's ("xla", "triton", "mosaic_gpu", "mosaic_tpu", "cudnn").
    config: the forward kernel's ``BlockSizes``, or None ("xla", "cudnn"); None fields: the
      kernel's launch heuristic.
    backward: the backward's implementation, or None for a forward-only op (decode).
    backward_config: the backward kernels' config (``config`` for "triton" and "mosaic_tpu").
    table: the tuning table the configs were read from, or None (none read).
    device_kind: the device the plan was resolved for (jax's ``device_kind``), or None.
    fallback: None, or (a boolean ``mask`` on Hopper) the plan run when the mask is not uniform
      on every ``jattn.attention.MASK_TILE`` tile (decided on device; both compiled).

  Example:
    >>> import jax, jax.numpy as jnp, jattn
    >>> x = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16)
    >>> p = jattn.flash_attention_plan(x, x, x, causal=True, device_kind="NVIDIA H200")
    >>> p.op, p.implementation, p.backward, p.table
    ('flash', 'mosaic_gpu', 'mosaic_gpu', 'nvidia_h200.json')
    >>> type(p.config).__module__, type(p.backward_config).__module__
    ('pallas_kernels.flash.mosaic_gpu', 'pallas_kernels.flash.mosaic_gpu_bwd')
  """
  op: str
  implementation: str
  config: Any = None
  backward: str | None = None
  backward_config: Any = None
  table: str | None = None
  device_kind: str | None = None
  fallback: Plan | None = None
