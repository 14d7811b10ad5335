"""Per-layer attention choices (``LayerSpec``) and the seed's periodic local/global schedule."""
from __future__ import annotations

import dataclasses

from jattn._validate import check_int, check_number
from jattn.sparse.selection import check_top_k

KINDS = ("global", "local", "sparse", "csa")
CSA_MODES = ("compressed", "two_stage")
GATE_GRADS = ("none", "ste", "gumbel")


@dataclasses.dataclass(frozen=True)
class LayerSpec:
  """What one attention layer does. Validated on construction (bad combinations raise).

  Args:
    kind: "global", "local" (query t sees t - window + 1 .. t), "sparse" (top-K block-sparse)
      or "csa" (``jattn.nn.csa``), all causal (docs/nn.md, "Layer kinds").
    window: local window in tokens ("local", and the raw window of CSA "compressed").
    rope_base: RoPE base, or None for no positional encoding (NoPE).
    block_size, q_block_size: key block size ("sparse"; CSA "two_stage") and the query block
      size sharing one selection ("sparse").
    top_k: selected blocks ("sparse", CSA "two_stage") or compressed entries (CSA "compressed");
      "sparse" also takes a float in (0, 1], the share of each query block's blocks kept.
    compress_ratio: tokens per compressed entry (stride; windows of 2 x ratio) for "csa".
    csa_mode: "compressed" or "two_stage" ("csa" only; see ``jattn.nn.csa``).
    csa_sink: learned attention sink per head ("csa" "compressed" only).
    gate_grad: gradient through block selection, passed to ``sparse_attention`` ("sparse"):
      "none", "ste" or "gumbel" (gumbel draws from the layer's rngs during training).
    score_aux_weight, score_aux_pool: "sparse" only: ``sparse_attention``'s score-distillation
      weight w >= 0 (0: off) and how its target pools a block's queries ("sum" or "max").

  Example:
    >>> LayerSpec("local", window=512).kind
    'local'
    >>> LayerSpec("sparse", top_k=4, block_size=64, rope_base=None).top_k
    4
  """
  kind: str
  window: int | None = None
  rope_base: float | None = 10000.0
  block_size: int = 64
  top_k: int | None = None
  q_block_size: int = 64
  compress_ratio: int = 4
  csa_mode: str = "compressed"
  csa_sink: bool = False
  gate_grad: str = "none"
  score_aux_weight: float = 0.0
  score_aux_pool: str = "sum"

  def __post_init__(self):
    k, w = self.kind, check_number("score_aux_weight", self.score_aux_weight, 0)
    if self.score_aux_pool not in ("sum", "max"):
      raise ValueError(f"score_aux_pool must be 'sum' or 'max', got {self.score_aux_pool!r}")
    if k not in KINDS:
      raise ValueError(f"LayerSpec.kind must be one of {KINDS}, got {k!r}")
    if self.rope_base is not None:   # None: NoPE
      check_number("rope_base", self.rope_base, 0, open_lo=True)
    for name in ("block_size", "q_block_size", "compress_ratio", "window", "top_k"):
      if getattr(self, name) is not None or name not in ("window", "top_k"):
        sparse_top_k = name == "top_k" and k == "sparse"   # blocks, or a share of a row's
        check_top_k(self.top_k) if sparse_top_k else check_int(name, getattr(self, name))
    if k == "global":
      if self.window is not None:
        raise ValueError("a 'global' layer has no window; use kind='local' for a sliding window")
      if self.top_k is not None:
        raise ValueError("a 'global' layer has no top_k; use kind='sparse'")
    elif k == "local":
      if self.window is None:
        raise ValueError("a 'local' layer needs window=<tokens>")
      if self.top_k is not None:
        raise ValueError("a 'local' layer has no top_k")
    elif k == "sparse":
      if self.top_k is None:
        raise ValueError("a 'sparse' layer needs top_k=<blocks>")
      if self.window is not None:
        raise ValueError("a 'sparse' layer has no window (sparse_attention is causal top-K)")
      if self.gate_grad not in GATE_GRADS:
        raise ValueError(f"gate_grad must be one of {GATE_GRADS}, got {self.gate_grad!r}")
    else:  # csa
      if self.csa_mode not in CSA_MODES:
        raise ValueError(f"csa_mode must be one of {CSA_MODES}, got {self.csa_mode!r}")
      if self.top_k is None:
        raise ValueError("a 'csa' layer needs top_k (compressed entries or blocks)")
      if self.csa_mode == "compressed" and self.window is None:
        raise ValueError("CSA 'compressed' needs window=<raw local window tokens>")
      if self.csa_mode == "two_stage":
        if self.window is not None:
          raise ValueError("CSA 'two_stage' has no raw window (its own block is attended raw)")
        if self.csa_sink:
          raise ValueError("csa_sink is only supported by CSA 'compressed'")
        if self.block_size % self.compress_ratio:
          raise ValueError(f"CSA 'two_stage' needs block_size ({self.block_size}) to be a "
                           f"multiple of compress_ratio ({self.compress_ratio})")
    if k != "csa" and (self.csa_sink or self.csa_mode != "compressed"):
      raise ValueError("csa_mode/csa_sink only apply to kind='csa'")
    if k != "sparse" and self.gate_grad != "none":
      raise ValueError("gate_grad only applies to kind='sparse'")
    if k != "sparse" and (w or self.score_aux_pool != "sum"):
      raise ValueError("score_aux_weight/score_aux_pool only apply to kind='sparse'")


def local_global_schedule(num_layers, local_per_global=5, window=512, local_rope_base=10000.0,
                          global_rope_base=None):
  """The seed's periodic pattern: ``local_per_global`` local layers, then one global layer.

  Args:
    num_layers: total layers.
    local_per_global: local layers before each global layer (5 -> every sixth layer is global).
    window: local window in tokens.
    local_rope_base, global_rope_base: RoPE bases (global default None = NoPE, the seed's).

  Returns:
    tuple of ``num_layers`` LayerSpec: layer i is global iff (i + 1) % (local_per_global + 1) == 0.

  Example:
    >>> [s.kind for s in local_global_schedule(6)]
    ['local', 'local', 'local', 'local', 'local', 'global']
  """
  check_int("num_layers", num_layers)
  check_int("local_per_global", local_per_global, lo=0)
  period = local_per_global + 1
  return tuple(LayerSpec("global", rope_base=global_rope_base) if (i + 1) % period == 0
               else LayerSpec("local", window=window, rope_base=local_rope_base)
               for i in range(num_layers))
