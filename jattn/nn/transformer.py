"""A small decoder-only LM of pre-norm blocks (``jattn.nn.Attention``, SwiGLU MLP), final RMSNorm
and tied or untied output embedding; plus dense attention probabilities and post-hoc sparsity."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jattn._validate import check_flags, check_int, check_number
from jattn.nn.attention import Attention, check_kv_cache_layout
from jattn.nn.schedule import LayerSpec
from pallas_kernels.masks import element_mask


def _module_list(items):
  if hasattr(nnx, "List"):
    return nnx.List(items)
  return nnx.data(list(items)) if hasattr(nnx, "data") else list(items)  # older flax: plain list


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Configuration of ``Transformer``.

  Args:
    vocab_size, num_layers, d_model: vocabulary size, decoder blocks and model width.
    num_heads, num_kv_heads, head_dim: query heads, key/value heads (num_heads % num_kv_heads
      == 0; 1 = MQA) and per-head width.
    layers: tuple of ``num_layers`` LayerSpec; None = all "global" with RoPE 10000.
    mlp_dim: SwiGLU hidden width (default 4 * d_model).
    tie_embeddings: share the input embedding with the output projection (a bool, as are
      qk_norm, interpret and mla_absorb).
    kv_lora_rank: None, or the MLA latent width (all layers use MLA).
    rope_head_dim: MLA decoupled RoPE width (used by layers with RoPE); 0 without MLA.
    qk_norm, implementation, interpret, mla_absorb, kv_cache_layout, context_mesh,
      context_axis: every layer's, as :class:`jattn.nn.Attention`.
    norm_eps, param_dtype: RMSNorm epsilon and parameter dtype.
    dtype: computation dtype (None: the parameter dtype); logits come out in this dtype.

  Example:
    >>> from jattn.nn.schedule import local_global_schedule
    >>> cfg = TransformerConfig(256, 6, 64, 4, 2, 16, layers=local_global_schedule(6, window=8))
    >>> cfg.layers[5].kind
    'global'
  """
  vocab_size: int
  num_layers: int
  d_model: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  layers: tuple | None = None
  mlp_dim: int | None = None
  tie_embeddings: bool = True
  kv_lora_rank: int | None = None
  rope_head_dim: int = 0
  qk_norm: bool = False
  implementation: str | None = None
  interpret: bool = False
  norm_eps: float = 1e-6
  param_dtype: object = jnp.float32
  dtype: object = None
  mla_absorb: bool = True
  kv_cache_layout: str = "nhd"
  context_mesh: object = None
  context_axis: str | None = None

  def __post_init__(self):
    for name in ("vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim"):
      check_int(name, getattr(self, name))
    for name in ("mlp_dim", "kv_lora_rank"):
      if getattr(self, name) is not None:
        check_int(name, getattr(self, name))
    check_int("rope_head_dim", self.rope_head_dim, 0)
    if self.rope_head_dim and self.kv_lora_rank is None:
      raise ValueError(f"rope_head_dim is an MLA option (set kv_lora_rank), got rope_head_dim="
                       f"{self.rope_head_dim} with kv_lora_rank=None")
    check_flags(tie_embeddings=self.tie_embeddings, qk_norm=self.qk_norm,
                interpret=self.interpret, mla_absorb=self.mla_absorb)
    check_number("norm_eps", self.norm_eps, 0, open_lo=True)
    layers = [LayerSpec("global")] * self.num_layers if self.layers is None else self.layers
    object.__setattr__(self, "layers", tuple(layers))
    if len(self.layers) != self.num_layers:
      raise ValueError(f"layers has {len(self.layers)} specs for num_layers={self.num_layers}")
    if bad := [s for s in self.layers if not isinstance(s, LayerSpec)]:
      raise TypeError(f"layers must hold LayerSpec, got {type(bad[0]).__name__}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                       f"({self.num_kv_heads})")
    check_kv_cache_layout(self.kv_cache_layout, kinds=tuple(s.kind for s in self.layers),
                          mla=self.kv_lora_rank is not None)

  def layer_rope_head_dim(self, spec):
    """The MLA RoPE width a layer uses (0 for NoPE layers or without MLA)."""
    return 0 if self.kv_lora_rank is None or spec.rope_base is None else self.rope_head_dim


class MLP(nnx.Module):
  """SwiGLU MLP: down(silu(gate(x)) * up(x)).

  Args:
    d_model, hidden: model and hidden widths.
    param_dtype, dtype: parameter and computation dtypes (dtype None: inferred).
    rngs: ``nnx.Rngs`` (keyword-only).

  Example:
    >>> MLP(8, 16, rngs=nnx.Rngs(0))(jnp.ones((1, 3, 8))).shape
    (1, 3, 8)
  """

  def __init__(self, d_model, hidden, *, param_dtype=jnp.float32, dtype=None, rngs):
    lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                                  rngs=rngs)
    self.gate, self.up, self.down = lin(d_model, hidden), lin(d_model, hidden), lin(hidden, d_model)

  def __call__(self, x):
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
  """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x)).

  Args:
    config, spec: TransformerConfig and this block's LayerSpec.
    rngs: ``nnx.Rngs`` (keyword-only).

  Example:
    >>> cfg = TransformerConfig(16, 1, 8, 2, 1, 4)
    >>> Block(cfg, cfg.layers[0], rngs=nnx.Rngs(0))(jnp.ones((1, 3, 8))).shape
    (1, 3, 8)
  """

  def __init__(self, config, spec, *, rngs):
    c, pd, dt = config, config.param_dtype, config.dtype
    norm = lambda: nnx.RMSNorm(c.d_model, epsilon=c.norm_eps, dtype=dt, param_dtype=pd, rngs=rngs)
    self.attn_norm = norm()
    self.attn = Attention(c.d_model, c.num_heads, c.num_kv_heads, c.head_dim, spec,
                          kv_lora_rank=c.kv_lora_rank, rope_head_dim=c.layer_rope_head_dim(spec),
                          qk_norm=c.qk_norm, mla_absorb=c.mla_absorb,
                          implementation=c.implementation, interpret=c.interpret,
                          kv_cache_layout=c.kv_cache_layout, context_mesh=c.context_mesh,
                          context_axis=c.context_axis, param_dtype=pd, dtype=dt, rngs=rngs)
    self.mlp_norm = norm()
    self.mlp = MLP(c.d_model, c.mlp_dim or 4 * c.d_model, param_dtype=pd, dtype=dt, rngs=rngs)

  def __call__(self, x, segment_ids=None, positions=None, *, return_qk=False):
    a = self.attn(self.attn_norm(x), segment_ids, positions, return_qk=return_qk)
    x = x + (a[0] if return_qk else a)
    x = x + self.mlp(self.mlp_norm(x))
    return (x, a[1]) if return_qk else x

  def decode(self, x):
    x = x + self.attn.decode(self.attn_norm(x))
    return x + self.mlp(self.mlp_norm(x))


class Transformer(nnx.Module):
  """Decoder-only LM whose attention layers follow ``config.layers``.

  Args:
    config: TransformerConfig.
    rngs: ``nnx.Rngs`` (keyword-only).

  Example:
    >>> from jattn.nn.schedule import local_global_schedule
    >>> cfg = TransformerConfig(64, 6, 32, 4, 2, 8, layers=local_global_schedule(6, window=4))
    >>> model = Transformer(cfg, rngs=nnx.Rngs(0))
    >>> tokens = jnp.zeros((2, 10), jnp.int32)
    >>> model(tokens).shape
    (2, 10, 64)
    >>> model.init_cache(2, 16, jnp.float32)
    >>> model.decode(tokens[:, :3]).shape          # prefill 3 tokens, then step 1 at a time
    (2, 3, 64)
  """

  def __init__(self, config, *, rngs):
    self.config = c = config
    kw = dict(dtype=c.dtype, param_dtype=c.param_dtype, rngs=rngs)
    self.embed = nnx.Embed(c.vocab_size, c.d_model, **kw)
    self.blocks = _module_list([Block(c, s, rngs=rngs) for s in c.layers])
    self.final_norm = nnx.RMSNorm(c.d_model, epsilon=c.norm_eps, **kw)
    self.lm_head = (None if c.tie_embeddings
                    else nnx.Linear(c.d_model, c.vocab_size, use_bias=False, **kw))

  def _logits(self, x):
    x = self.final_norm(x)
    return self.embed.attend(x) if self.lm_head is None else self.lm_head(x)

  def __call__(self, tokens, segment_ids=None, positions=None, *, return_qk=False):
    """Logits [batch, seq, vocab] of int ``tokens`` [batch, seq]; ``segment_ids``, ``positions``
    and ``return_qk`` (then also a per-layer list of its dicts) as :meth:`Attention.__call__`."""
    x, qks = self.embed(tokens), []
    for blk in self.blocks:
      out = blk(x, segment_ids, positions, return_qk=return_qk)
      x, qk = out if return_qk else (out, None)
      qks.append(qk)
    return (self._logits(x), qks) if return_qk else self._logits(x)

  def init_cache(self, batch_size, max_len, dtype=jnp.float32):
    """Every layer's ``Attention.init_cache``."""
    for blk in self.blocks:
      blk.attn.init_cache(batch_size, max_len, dtype)

  def decode(self, tokens):
    """Append int ``tokens`` [batch, t >= 1] (prefill or steps) to the cache; their logits.

    Rows advance together from one cache index: decode packed documents one per row (equal
    lengths) or per call, each from a fresh ``init_cache``, to match the packed forward."""
    x = self.embed(tokens)
    for blk in self.blocks:
      x = blk.decode(x)
    return self._logits(x)


def sparsify_config(config, top_k, *, block_size=64, q_block_size=64, kinds=("global",),
                    gate_grad="none"):
  """A copy of ``config`` whose layers of the given kinds become top-K block-sparse layers
  (each keeps its RoPE base).

  Args:
    config: TransformerConfig.
    top_k, block_size, q_block_size, gate_grad: the new layers' (:class:`LayerSpec`).
    kinds: layer kinds to convert (default only "global").

  Returns:
    TransformerConfig.

  Example:
    >>> cfg = TransformerConfig(16, 2, 8, 2, 1, 4)
    >>> [s.kind for s in sparsify_config(cfg, 2, block_size=4).layers]
    ['sparse', 'sparse']
  """
  layers = tuple(
      LayerSpec("sparse", rope_base=s.rope_base, block_size=block_size, top_k=top_k,
                q_block_size=q_block_size, gate_grad=gate_grad) if s.kind in kinds else s
      for s in config.layers)
  return dataclasses.replace(config, layers=layers)


def with_config(model, config):
  """A new Transformer for ``config`` holding a copy of ``model``'s parameters.

  Args:
    model: Transformer.
    config: a config with the same parameter shapes (e.g. from ``sparsify_config``).

  Returns:
    Transformer (no cache).

  Example:
    >>> cfg = TransformerConfig(16, 1, 8, 2, 1, 4)
    >>> m = Transformer(cfg, rngs=nnx.Rngs(0))
    >>> m2 = with_config(m, cfg)
  """
  new = Transformer(config, rngs=nnx.Rngs(0))
  nnx.update(new, jax.tree.map(jnp.copy, nnx.state(model, nnx.Param)))
  return new


def sparsify(model, top_k, *, block_size=64, q_block_size=64, kinds=("global",)):
  """Post-hoc sparsity: ``model``'s weights with its global layers switched to kind "sparse".

  Args:
    model: a trained (dense) Transformer.
    top_k, block_size, q_block_size, kinds: as for :func:`sparsify_config`.

  Returns:
    Transformer with the same parameters (copied) and a sparsified config.

  Example:
    >>> cfg = TransformerConfig(16, 1, 8, 2, 1, 4)
    >>> sparse_model = sparsify(Transformer(cfg, rngs=nnx.Rngs(0)), top_k=2, block_size=4)
  """
  return with_config(model, sparsify_config(model.config, top_k, block_size=block_size,
                                            q_block_size=q_block_size, kinds=kinds))


def attention_probabilities(q, k, spec=None, *, segment_ids=None, scale=None):
  """Dense attention probabilities of one layer from its captured q/k (heatmaps, captured mass),
  under its dense mask: causal, the "local" window, segment ids.

  Args:
    q, k: [batch, seq, q_heads | kv_heads, d] (from ``Transformer(..., return_qk=True)``).
    spec: the layer's LayerSpec (None = global).
    segment_ids: None or int [batch, seq].
    scale: logit scale (default 1/sqrt(d), as the layer uses).

  Returns:
    fp32 [batch, q_heads, seq, seq]; rows sum to 1 (0 for rows that see nothing).

  Example:
    >>> q = jnp.ones((1, 4, 2, 8))
    >>> attention_probabilities(q, q[:, :, :1]).shape
    (1, 2, 4, 4)
  """
  _, s, hq, d = q.shape
  scale = 1.0 / d ** 0.5 if scale is None else scale
  kf = jnp.repeat(k.astype(jnp.float32), hq // k.shape[2], axis=2)
  logits = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kf,
                      precision=jax.lax.Precision.HIGHEST) * scale
  window = (spec.window - 1, 0) if spec is not None and spec.kind == "local" else None
  seg = None if segment_ids is None else segment_ids[:, None, :]
  pos = jnp.arange(s)
  mask = element_mask(pos, pos, causal=True, window=window, q_seg=seg, kv_seg=seg)
  return jax.nn.softmax(logits, axis=-1, where=mask)   # 0 where masked, also in empty rows
