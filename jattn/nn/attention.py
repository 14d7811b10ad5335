"""``Attention``: one Flax NNX attention layer for every ``LayerSpec`` kind (GQA/MQA or MLA),
with KV caches for ``decode`` (docs/nn.md: the layer kinds, their kernels and their caches)."""

import jax
import jax.numpy as jnp
from flax import nnx

from jattn import sparse
from jattn._layout import check_kv_layout
from jattn._validate import check_flags, check_int, is_traced
from jattn.attention import flash_attention
from jattn.context_parallel import context_parallel_attention, context_parallel_permute
from jattn.decode import decode_attention, resolve_decode_implementation
from jattn.merge import merge
from jattn.nn import csa as csa_ops
from jattn.nn.rope import apply_rope
from jattn.nn.schedule import LayerSpec
from pallas_kernels.common.util import next_pow2, round_up

# decode implementations that run absorbed MLA decode (any key width, narrower values).
ABSORB_IMPLEMENTATIONS = ("xla", "triton", "mosaic_tpu")
# Largest Triton query tile [pad16(heads), pow2(r + rope_head_dim)] for absorbed decode (larger
# tiles and their fp32 accumulators do not fit in registers).
TRITON_ABSORB_MAX_TILE = 16 * 256
# MLA RoPE layers cache one array per token: [latent | rotated k_rope].
MLA_ROPE_CACHE = "latent_k_rope"


def _set(var, value):
  if hasattr(var, "set_value"):
    var.set_value(value)
  else:  # older flax
    var.value = value


def check_kv_cache_layout(kv_cache_layout, *, kinds=(), mla=False):
  """ValueError unless ``kv_cache_layout`` is "nhd" or "hnd", and "hnd" fits the layers.

  Args:
    kv_cache_layout, kinds, mla: "nhd" or "hnd"; the ``LayerSpec.kind`` of every layer that
      will keep a cache in it; whether the layers are MLA (``kv_lora_rank`` set).

  Returns:
    None.

  Example:
    >>> check_kv_cache_layout("hnd", kinds=("global", "local", "sparse"))
    >>> check_kv_cache_layout("hnd", kinds=("csa",))
    Traceback (most recent call last):
    ...
    ValueError: kv_cache_layout='hnd' is not supported for 'csa' layers: ...
  """
  check_kv_layout(kv_cache_layout, "kv_cache_layout")
  if mla and kv_cache_layout == "hnd":
    raise ValueError("kv_cache_layout='hnd' is not supported with MLA (kv_lora_rank): the MLA "
                     "cache holds a per-token latent [batch, len, kv_lora_rank (+ rope_head_dim)] "
                     "with no kv head axis to put first; use kv_cache_layout='nhd'")
  if "csa" in kinds and kv_cache_layout == "hnd":
    raise ValueError("kv_cache_layout='hnd' is not supported for 'csa' layers: their decode "
                     "never calls the contiguous decode kernels (it pools raw windows into "
                     "compressed entries); use kv_cache_layout='nhd'")


class Attention(nnx.Module):
  """Multi-head causal self-attention for one ``LayerSpec``, with an optional KV cache.

  Args:
    d_model, num_heads: model width and query heads.
    num_kv_heads: key/value heads (GQA/MQA; with MLA, the heads keys/values are up-projected to).
    head_dim: per-head width (MLA: the non-RoPE part and the value width; queries/keys have
      ``head_dim + rope_head_dim`` channels).
    spec: the layer's ``LayerSpec`` (kind, window, RoPE base, sparsity, CSA settings).
    kv_lora_rank: None (plain GQA) or the MLA latent width.
    rope_head_dim: MLA only: width of the decoupled RoPE part of queries/keys (even, > 0).
    qk_norm: RMSNorm each query/key head (MLA: the non-RoPE part) before RoPE.
    mla_absorb: MLA only: absorb the up-projections in single-token decode where valid
      (``absorbed_decode``) instead of expanding the cache every step.
    implementation, interpret: passed to the attention ops (None = per platform; Pallas
      interpret mode for CPU tests).
    kv_cache_layout: "nhd" [batch, slots, kv_heads, head_dim] (default) or "hnd" [batch,
      kv_heads, slots, head_dim] ("global", "local", "sparse"; not MLA).
    context_mesh, context_axis: None, or a mesh and the axis the sequence is split over: the
      forward runs context-parallel (docs/context_parallel.md) on zig-zag ordered sequences
      (``jattn.context_parallel_permute``; default positions too).
    param_dtype, dtype: parameter dtype, and the projections' (None: from the inputs/params).
    rngs: ``nnx.Rngs`` (keyword-only); ``gate_grad="gumbel"`` layers draw noise from it.

  Example:
    >>> layer = Attention(64, 4, 2, 16, LayerSpec("local", window=8), rngs=nnx.Rngs(0))
    >>> y = layer(jnp.ones((2, 20, 64)))
    >>> layer.init_cache(2, 32, jnp.float32)
    >>> y_step = layer.decode(jnp.ones((2, 1, 64)))
  """

  def __init__(self, d_model, num_heads, num_kv_heads, head_dim, spec=None, *, kv_lora_rank=None,
               rope_head_dim=0, qk_norm=False, mla_absorb=True, implementation=None,
               interpret=False, kv_cache_layout="nhd", context_mesh=None, context_axis=None,
               param_dtype=jnp.float32, dtype=None, rngs):
    spec = LayerSpec("global") if spec is None else spec
    if not isinstance(spec, LayerSpec):
      raise TypeError(f"spec must be a LayerSpec, got {type(spec).__name__}")
    if num_heads % num_kv_heads:
      raise ValueError(
          f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    check_flags(qk_norm=qk_norm, mla_absorb=mla_absorb, interpret=interpret)
    check_int("rope_head_dim", rope_head_dim, 0)
    if kv_lora_rank is not None:
      check_int("kv_lora_rank", kv_lora_rank)
    self.mla, self.kv_cache_layout = kv_lora_rank is not None, kv_cache_layout
    check_kv_cache_layout(kv_cache_layout, kinds=(spec.kind,), mla=self.mla)
    if self.mla:
      if spec.kind == "csa":
        raise ValueError("MLA (kv_lora_rank) with a 'csa' layer is not supported: CSA pools raw "
                         "keys/values, MLA caches a latent")
      if spec.rope_base is not None and (rope_head_dim <= 0 or rope_head_dim % 2):
        raise ValueError("MLA with RoPE needs an even rope_head_dim > 0 (the decoupled RoPE part)")
      if spec.rope_base is None and rope_head_dim:
        raise ValueError("rope_head_dim with a NoPE layer (rope_base=None) would be ignored; "
                         "pass rope_head_dim=0 for NoPE MLA layers")
    elif rope_head_dim:
      raise ValueError("rope_head_dim is an MLA option (set kv_lora_rank)")
    elif spec.rope_base is not None and head_dim % 2:
      raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    if spec.kind == "csa" and spec.csa_mode == "two_stage" and implementation not in (None, "xla"):
      raise ValueError("CSA 'two_stage' runs the jnp reference path only; "
                       f"implementation={implementation!r} cannot be honoured")
    if (context_mesh is None) != (context_axis is None):
      raise ValueError("context_mesh and context_axis go together, got "
                       f"context_mesh={context_mesh!r}, context_axis={context_axis!r}")
    if context_mesh is not None and spec.kind == "csa":
      raise ValueError("context parallelism runs 'global', 'local' and 'sparse' layers, got "
                       "kind 'csa'")
    if context_mesh is not None and context_axis not in context_mesh.axis_names:
      raise ValueError(f"context_axis {context_axis!r} is not an axis of the mesh "
                       f"{context_mesh.axis_names}")
    self.context_mesh, self.context_axis, self.spec = context_mesh, context_axis, spec
    self.d_model, self.num_heads, self.num_kv_heads = d_model, num_heads, num_kv_heads
    self.head_dim, self.rope_head_dim, self.kv_lora_rank = head_dim, rope_head_dim, kv_lora_rank
    self.implementation, self.interpret = implementation, interpret
    self.qk_dim, self.qk_norm, self.mla_absorb = head_dim + rope_head_dim, qk_norm, mla_absorb
    lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                                  rngs=rngs)
    norm = lambda n: nnx.RMSNorm(n, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    kv_width = num_kv_heads * head_dim
    self.wq = lin(d_model, num_heads * self.qk_dim)
    if self.mla:
      self.w_dkv, self.kv_norm = lin(d_model, kv_lora_rank), norm(kv_lora_rank)
      self.w_uk, self.w_uv = lin(kv_lora_rank, kv_width), lin(kv_lora_rank, kv_width)
      self.w_kr = lin(d_model, rope_head_dim) if rope_head_dim else None
    else:
      self.wk, self.wv = lin(d_model, kv_width), lin(d_model, kv_width)
    self.wo = lin(num_heads * head_dim, d_model)
    if qk_norm:
      self.q_norm, self.k_norm = norm(head_dim), norm(head_dim)
    if spec.kind == "csa":
      zeros = lambda *shape: nnx.Param(jnp.zeros(shape, param_dtype))
      self.gate_k, self.gate_v = lin(d_model, kv_width), lin(d_model, kv_width)
      self.bias_k = zeros(2 * spec.compress_ratio, num_kv_heads, head_dim)
      self.bias_v = zeros(2 * spec.compress_ratio, num_kv_heads, head_dim)
      self.sink = zeros(num_heads) if spec.csa_sink else None
    self.gate_rngs = rngs if spec.gate_grad == "gumbel" else None
    self.cache_names = ()

  # ---------------------------------------------------------------- projections
  def _project(self, x, positions):
    """x [b, t, d_model] -> (q [b, t, hq, qk_dim], cache entries of the t tokens)."""
    (b, t, _), base, d = x.shape, self.spec.rope_base, self.head_dim
    heads = lambda a: a.reshape(b, t, self.num_kv_heads, d)
    q = self.wq(x).reshape(b, t, self.num_heads, self.qk_dim)
    if self.mla:
      q_nope = self.q_norm(q[..., :d]) if self.qk_norm else q[..., :d]
      q = jnp.concatenate([q_nope, apply_rope(q[..., d:], positions, base)], axis=-1)
      ent = {"latent": self.kv_norm(self.w_dkv(x))}                    # [b, t, r]
      if self.rope_head_dim:  # one cache array [latent | k_rope]: [b, t, r + rope_dim]
        k_rope = apply_rope(self.w_kr(x), positions, base)            # [b, t, rope_dim]
        ent = {MLA_ROPE_CACHE: jnp.concatenate([ent["latent"], k_rope], axis=-1)}
    else:
      k, v = heads(self.wk(x)), heads(self.wv(x))
      if self.qk_norm:
        q, k = self.q_norm(q), self.k_norm(k)
      q, k = apply_rope(q, positions, base), apply_rope(k, positions, base)
      ent = {"k": k, "v": v}
    if self.spec.kind == "csa":
      ent["gk"], ent["gv"] = heads(self.gate_k(x)), heads(self.gate_v(x))
    return q, ent

  def _expand(self, ent):
    """Cache entries -> (k [b, n, hk, qk_dim], v [b, n, hk, head_dim]); MLA up-projects the
    latent (all kv heads share the cached k_rope)."""
    if not self.mla:
      return ent["k"], ent["v"]
    r, rope = self.kv_lora_rank, self.rope_head_dim
    c = ent[MLA_ROPE_CACHE if rope else "latent"]
    lat = c[..., :r] if rope else c
    b, n, _ = c.shape
    heads = lambda lin: lin(lat).reshape(b, n, self.num_kv_heads, self.head_dim)
    k, v = heads(self.w_uk), heads(self.w_uv)
    k = self.k_norm(k) if self.qk_norm else k
    if rope:
      kr = jnp.broadcast_to(c[:, :, None, r:].astype(k.dtype), (b, n, self.num_kv_heads, rope))
      k = jnp.concatenate([k, kr], axis=-1)
    return k, v

  @property
  def scale(self):
    return 1.0 / (self.qk_dim ** 0.5)

  @property
  def absorbed_decode(self):
    """Whether single-token decode ("global"/"local") attends the MLA latent directly.

    True for MLA layers with ``mla_absorb``, without ``qk_norm``, on an implementation in
    ``ABSORB_IMPLEMENTATIONS`` (on "triton" only up to ``TRITON_ABSORB_MAX_TILE``).

    Example:
      >>> mla = Attention(64, 4, 2, 16, kv_lora_rank=24, rope_head_dim=8, rngs=nnx.Rngs(0))
      >>> mla.absorbed_decode, Attention(64, 4, 2, 16, rngs=nnx.Rngs(0)).absorbed_decode
      (True, False)
    """
    if not (self.mla and self.mla_absorb and not self.qk_norm):
      return False
    impl = resolve_decode_implementation(self.implementation)
    if impl == "triton":
      tile = round_up(self.num_heads, 16) * next_pow2(self.kv_lora_rank + self.rope_head_dim)
      return tile <= TRITON_ABSORB_MAX_TILE
    return impl in ABSORB_IMPLEMENTATIONS

  # ---------------------------------------------------------------- forward
  def __call__(self, x, segment_ids=None, positions=None, *, return_qk=False):
    """Full (training) forward pass; the cache is neither read nor written.

    Args:
      x: [batch, seq, d_model].
      segment_ids: None or int [batch, seq] packed-document ids (0 = padding).
      positions: None (0..seq-1) or int [batch, seq] positions for RoPE (restart per document).
      return_qk: also return ``{"q": q, "k": k}`` as fed to attention (after norms and RoPE;
        q [batch, seq, heads, qk_dim], k [batch, seq, kv_heads, qk_dim]).

    Returns:
      y [batch, seq, d_model] (and the q/k dict if return_qk).
    """
    (b, s, _), spec, cp = x.shape, self.spec, self.context_mesh is not None
    impl = dict(implementation=self.implementation, interpret=self.interpret)
    if cp:
      impl.update(mesh=self.context_mesh, axis_name=self.context_axis)
    if positions is None:
      positions = jnp.arange(s, dtype=jnp.int32)
      if cp:
        positions = context_parallel_permute(
            positions[None], self.context_mesh.shape[self.context_axis])[0]
      positions = jnp.broadcast_to(positions, (b, s))
    q, ent = self._project(x, positions)
    k, v = self._expand(ent)
    if spec.kind in ("global", "local"):
      attend = context_parallel_attention if cp else flash_attention
      window = (spec.window - 1, 0) if spec.kind == "local" else None
      o = attend(q, k, v, causal=True, local_window_size=window, segment_ids=segment_ids,
                 scale=self.scale, **impl)
    elif spec.kind == "sparse":
      o = sparse.sparse_attention(
          q, k, v, block_size=spec.block_size, top_k=spec.top_k, q_block_size=spec.q_block_size,
          gate_grad=spec.gate_grad, rng=self.gate_rngs() if spec.gate_grad == "gumbel" else None,
          causal=True, segment_ids=segment_ids, scale=self.scale,
          score_aux_weight=spec.score_aux_weight, score_aux_pool=spec.score_aux_pool, **impl)
    elif segment_ids is not None:
      raise NotImplementedError("CSA layers do not support packed segment ids (compressed windows "
                                "would straddle documents)")
    else:   # csa: the raw keys/values pooled into compressed entries
      r, c = spec.compress_ratio, csa_ops.num_entries(s, spec.compress_ratio)
      ck = csa_ops.pool_windows(k, ent["gk"], self.bias_k[...], r, c)
      cv = csa_ops.pool_windows(v, ent["gv"], self.bias_v[...], r, c)
      q_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
      o = self._csa_attend(q, k, v, ck, cv, q_pos)
    y = self.wo(o.astype(x.dtype).reshape(b, s, self.num_heads * self.head_dim))
    return (y, {"q": q, "k": k}) if return_qk else y

  def _csa_attend(self, q, k, v, ck, cv, q_pos, kv_valid=None):
    """CSA output of queries at q_pos [b, t]: "two_stage" (raw key j at position j), or the raw
    window (``_chunk_flash``) merged with the top-K compressed entries and the optional sink."""
    spec = self.spec
    if spec.csa_mode == "two_stage":
      return csa_ops.two_stage_attention(q, k, v, ck, cv, q_pos, ratio=spec.compress_ratio,
                                         block_size=spec.block_size, top_k=spec.top_k,
                                         scale=self.scale)[0]
    o_l, lse_l = self._chunk_flash(q, k, v, kv_valid, window=(spec.window - 1, 0), return_lse=True)
    o_c, lse_c = csa_ops.compressed_partial(q, ck, cv, q_pos, ratio=spec.compress_ratio,
                                            top_k=spec.top_k, scale=self.scale)
    sink = None if self.sink is None else self.sink[...]

    @jax.checkpoint  # elementwise: recompute in the bwd rather than keep fp32 stacks per layer
    def combine(o_l, lse_l, o_c, lse_c, sink):
      o, lse = merge(o_l.astype(jnp.float32), lse_l.transpose(0, 2, 1), o_c, lse_c)
      if sink is not None:
        o, lse = merge(o, lse, *csa_ops.sink_partial(sink, o.shape))
      return o
    return combine(o_l, lse_l, o_c, lse_c, sink)

  # ---------------------------------------------------------------- cache
  def _head_major(self, name):   # "hnd" K/V of global/local/sparse layers
    return self.kv_cache_layout == "hnd" and name in ("k", "v")

  def _slot_axis(self, name):   # the token-slot axis of cache array ``name`` as stored
    return 2 if self._head_major(name) else 1

  def _at_slots(self, name, slots):   # index of token slots ``slots`` of ``name`` as stored
    return (slice(None),) * self._slot_axis(name) + (slots,)

  def _relayout(self, name, a):   # token-major [b, t, hk, d] <-> stored layout (an involution)
    return jnp.swapaxes(a, 1, 2) if self._head_major(name) else a

  def cache_layout(self, max_len):
    """What ``init_cache(batch_size, max_len)`` allocates: :func:`cache_layout` of this layer.

    Example:
      >>> layer = Attention(64, 4, 1, 16, LayerSpec("local", window=8), rngs=nnx.Rngs(0))
      >>> layer.cache_layout(100)["k"]
      ('ring', 8, (1, 16))
    """
    return cache_layout(self.spec, max_len, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                        kv_lora_rank=self.kv_lora_rank, rope_head_dim=self.rope_head_dim)

  def init_cache(self, batch_size, max_len, dtype=jnp.float32):
    """Allocate (or reset) the KV cache as ``nnx.Cache`` variables.

    Args:
      batch_size: rows decoded together.
      max_len: total tokens (prompt + generated) the cache must hold (local layers: a ring).
      dtype: cache dtype (e.g. jnp.bfloat16).
    """
    layout = self.cache_layout(max_len)
    for name, (_, slots, shape) in layout.items():
      full_shape = ((batch_size, shape[0], slots) + shape[1:] if self._head_major(name)
                    else (batch_size, slots) + shape)
      setattr(self, f"cache_{name}", nnx.Cache(jnp.zeros(full_shape, dtype)))
    for size in sorted({slots for storage, slots, _ in layout.values() if storage == "ring"}):
      setattr(self, f"ring_pos_{size}", nnx.Cache(jnp.full((size,), -1, jnp.int32)))
    if self.spec.kind == "sparse":   # running per-block key sums for decode-time block scores
      nb, hk = -(-max_len // self.spec.block_size), self.num_kv_heads
      shape = (batch_size, hk, nb) if self._head_major("k") else (batch_size, nb, hk)
      self.cache_block_sums = nnx.Cache(jnp.zeros(shape + (self.qk_dim,), jnp.float32))
    self.cache_index = nnx.Cache(jnp.zeros((), jnp.int32))
    self.cache_names, self.cache_max_len = tuple(layout), max_len

  def decode(self, x, *, return_qk=False):
    """Append t >= 1 tokens to the cache and attend them to everything cached (by position).

    Args:
      x: [batch, t, d_model] the next t tokens' inputs (positions continue from the cache index).
      return_qk: also return ``{"q": q}`` for the new tokens.

    Returns:
      y [batch, t, d_model]; the cache index advances by t. Writing past ``max_len`` raises
      outside jit and is unchecked under jit: size the cache for the whole sequence.
    """
    if not self.cache_names:
      raise ValueError("call init_cache(batch_size, max_len, dtype) before decode")
    (b, t, _), spec, p = x.shape, self.spec, self.cache_index[...]
    if not is_traced(p) and int(p) + t > self.cache_max_len:   # traced (jit): not checkable
      raise ValueError(f"decode of {t} tokens at position {int(p)} overflows the cache "
                       f"(max_len={self.cache_max_len}); call init_cache with a larger max_len")
    pos = p + jnp.arange(t, dtype=jnp.int32)                         # [t]
    q, ent = self._project(x, jnp.broadcast_to(pos, (b, t)))
    dt = self._cache(self.cache_names[0])[...].dtype   # attend in it: kernels want one dtype
    q, ent = q.astype(dt), {n: a.astype(dt) for n, a in ent.items()}
    if spec.kind in ("global", "sparse"):
      full = self._write_full(ent, p)
      if spec.kind == "global" and t == 1:
        o = self._decode_one(q, full, jnp.full((b,), p + 1, jnp.int32))
      elif spec.kind == "global":  # roll the cache so the chunk ends it: bottom-right causal
        k, v = self._expand({n: self._relayout(n, a) for n, a in full.items()})
        shift = k.shape[1] - (p + t)
        roll = lambda a: jnp.roll(a, shift, axis=1)
        o = self._chunk_flash(q, roll(k), roll(v), jnp.arange(k.shape[1]) >= shift)
      else:
        o = self._sparse_decode(q, *self._expand(full), pos, p)
    elif spec.kind == "local":
      w = spec.window
      if t == 1:  # write first: the ring then holds exactly the visible window (order is moot)
        self._ring_write(ent, w, pos)
        lens = jnp.full((b,), jnp.minimum(p + 1, w), jnp.int32)
        o = self._decode_one(q, {n: self._cache(n)[...] for n in ent}, lens)
      else:
        keys, valid = self._ring_unrolled(ent, w)
        o = self._chunk_flash(q, *self._expand(keys), valid, window=(w - 1, 0))
        self._ring_write(ent, w, pos)
    else:
      o = self._csa_decode(q, ent, pos, p)
    _set(self.cache_index, p + t)
    y = self.wo(o.astype(x.dtype).reshape(b, t, self.num_heads * self.head_dim))
    return (y, {"q": q}) if return_qk else y

  def _decode_one(self, q, ent, lengths):
    """q [b, 1, hq, qk_dim] over the cache as stored -> o [b, 1, hq, head_dim] (cache dtype;
    fp32 when absorbed: q_abs[h] = W_uk[g] q_nope[h] attends [latent | k_rope] as keys and
    values, o[h] = W_uv[g]^T o_lat[h][:r], absorption matmuls in fp32 at HIGHEST)."""
    q = q[:, 0]                                                      # [b, hq, qk_dim]
    if not self.absorbed_decode:  # (MLA caches are always "nhd"; plain K/V as stored)
      return decode_attention(q, *self._expand(ent), lengths, scale=self.scale,
                              implementation=self.implementation, interpret=self.interpret,
                              kv_layout=self.kv_cache_layout)[:, None]
    (b, hq, _), hk, d, r = q.shape, self.num_kv_heads, self.head_dim, self.kv_lora_rank
    f32, hi = jnp.float32, jax.lax.Precision.HIGHEST
    w = lambda lin: lin.kernel[...].astype(f32).reshape(r, hk, d)    # [r, hk, d]
    q_nope = q[..., :d].astype(f32).reshape(b, hk, hq // hk, d)      # [b, hk, group, d]
    q_abs = jnp.einsum("bgjd,rgd->bgjr", q_nope, w(self.w_uk), precision=hi)
    kv = ent[MLA_ROPE_CACHE if self.rope_head_dim else "latent"][:, :, None]  # [b, n, 1, r+rope]
    q = jnp.concatenate([q_abs.reshape(b, hq, r).astype(kv.dtype), q[..., d:]], axis=-1)
    o = decode_attention(q, kv, kv, lengths, scale=self.scale,   # values: the same array
                         implementation=self.implementation, interpret=self.interpret)
    o = o[..., :r].astype(f32).reshape(b, hk, hq // hk, r)          # [b, hk, group, r]
    o = jnp.einsum("bgjr,rgd->bgjd", o, w(self.w_uv), precision=hi)
    return o.reshape(b, 1, hq, d)

  def _cache(self, name):
    return getattr(self, f"cache_{name}")

  def _write_full(self, ent, p, names=None):
    """Write the new tokens at position p of full caches; returns the caches."""
    out = {}
    for n in (names or list(ent)):
      var, new = self._cache(n), self._relayout(n, ent[n])
      out[n] = jax.lax.dynamic_update_slice_in_dim(var[...], new, p, axis=self._slot_axis(n))
      _set(var, out[n])
    return out

  def _ring_unrolled(self, ent, size, names=None):
    """Ring contents in position order (p - size .. p - 1; position x sits in slot x % size),
    then the new chunk; and the valid-slot mask (negative positions are invalid)."""
    names = names or list(ent)
    opos = self.cache_index[...] - size + jnp.arange(size, dtype=jnp.int32)  # [size]
    ring = lambda n: self._relayout(n, self._cache(n)[...][self._at_slots(n, opos % size)])
    keys = {n: jnp.concatenate([ring(n), ent[n]], axis=1) for n in names}
    return keys, jnp.concatenate([opos >= 0, jnp.ones((ent[names[0]].shape[1],), bool)])

  def _chunk_flash(self, q, k, v, kv_valid=None, window=None, return_lse=False):
    """t queries at the last t positions of contiguous keys k [b, n] (bottom-right aligned);
    ``kv_valid`` [n] (None: all valid) masks empty slots through kv segment ids."""
    seg_q = seg_k = None
    k, v = k.astype(q.dtype), v.astype(q.dtype)   # MLA's expanded keys come out in fp32
    if kv_valid is not None:
      seg_q = jnp.ones(q.shape[:2], jnp.int32)
      seg_k = jnp.broadcast_to(kv_valid.astype(jnp.int32)[None], (q.shape[0], k.shape[1]))
    return flash_attention(q, k, v, causal=True, local_window_size=window, segment_ids=seg_q,
                           kv_segment_ids=seg_k, scale=self.scale, return_lse=return_lse,
                           implementation=self.implementation, interpret=self.interpret)

  def _ring_write(self, ent, size, pos, names=None):
    """Write the last min(t, size) new tokens (positions ``pos`` [t]) into rings of ``size``."""
    m = min(pos.shape[0], size)
    slots = pos[-m:] % size
    for n in (names or list(ent)):
      var = self._cache(n)
      _set(var, var[...].at[self._at_slots(n, slots)].set(self._relayout(n, ent[n][:, -m:])))
    rp = getattr(self, f"ring_pos_{size}")
    _set(rp, rp[...].at[slots].set(pos[-m:]))

  def _sparse_decode(self, q, k, v, pos, p):
    """Per-token top-K decode (``select_blocks(q_block_size=1)`` rules) for t new queries; the
    cached fp32 per-block key sums grow by the t new keys only (all in the cache layout)."""
    spec, (b, t) = self.spec, q.shape[:2]
    k_new = jax.lax.dynamic_slice_in_dim(k, p, t, axis=self._slot_axis("k")).astype(jnp.float32)
    sums = self.cache_block_sums[...].at[self._at_slots("k", pos // spec.block_size)].add(k_new)
    _set(self.cache_block_sums, sums)
    summaries = sparse.BlockSummaries(sums=sums, lengths=jnp.full((b,), p + t, jnp.int32),
                                      block_size=spec.block_size, layout=self.kv_cache_layout)
    impl = self.implementation   # a share of blocks (float top_k) selects in XLA
    impl = "xla" if isinstance(spec.top_k, float) and impl == "triton" else impl

    def one(qi, length):  # v may be narrower than k (MLA): the output has v's head dim
      return sparse.sparse_decode_attention(
          qi, k, v, jnp.full((b,), length, jnp.int32), summaries, block_size=spec.block_size,
          top_k=spec.top_k, scale=self.scale, implementation=impl,
          interpret=self.interpret, kv_layout=self.kv_cache_layout)
    return jax.vmap(one, in_axes=(1, 0), out_axes=1)(q, pos + 1)   # [b, t, hq, dv]

  def _csa_decode(self, q, ent, pos, p):
    spec, layout = self.spec, self.cache_layout(self.cache_max_len)
    (b, t), r, raw_size = q.shape[:2], spec.compress_ratio, layout["k"][1]
    # raw k/v and gates of each new entry's window (positions P - 2r + 1 .. P, P = p + i)
    valid = ((pos + 1) % r == 0) & (pos + 1 >= 2 * r)
    cidx = jnp.where(valid, (pos + 1) // r - 2, layout["ck"][1])   # out of range -> dropped
    X = pos[:, None] - 2 * r + 1 + jnp.arange(2 * r)[None]         # [t, 2r]

    def recent(n, size):  # [b, t, 2r, hk, d] from ring n (``size`` slots) and the new tokens
      idx = jnp.clip(jnp.where(X >= p, size + (X - p), X % size), 0, size + t - 1)
      return jnp.concatenate([self._cache(n)[...], ent[n]], axis=1)[:, idx]
    gk, gv = recent("gk", 2 * r), recent("gv", 2 * r)
    if spec.csa_mode == "two_stage":
      full = self._write_full(ent, p, ["k", "v"])
      xi = jnp.clip(X, 0, full["k"].shape[1] - 1)
      kw, vw = full["k"][:, xi], full["v"][:, xi]
    else:
      kw, vw = recent("k", raw_size), recent("v", raw_size)
    comp = {}
    for n, xw, gw, bias in (("ck", kw, gk, self.bias_k), ("cv", vw, gv, self.bias_v)):
      var, new = self._cache(n), csa_ops.pool_one_window(xw, gw, bias[...])  # [b, t, hk, d]
      comp[n] = var[...].at[:, cidx].set(new.astype(var[...].dtype), mode="drop")
      _set(var, comp[n])
    kv_valid = None
    if spec.csa_mode == "compressed":  # raw k/v: the ring (in position order) then the chunk
      full, kv_valid = self._ring_unrolled(ent, raw_size, ["k", "v"])
      self._ring_write(ent, raw_size, pos, ["k", "v"])
    self._ring_write(ent, 2 * r, pos, ["gk", "gv"])
    return self._csa_attend(q, full["k"], full["v"], comp["ck"], comp["cv"],
                            jnp.broadcast_to(pos, (b, t)), kv_valid)


def cache_layout(spec, max_len, *, num_kv_heads, head_dim, kv_lora_rank=None, rope_head_dim=0):
  """What a layer caches for a context of ``max_len`` tokens.

  Args:
    spec, max_len: the layer's LayerSpec and the context length.
    num_kv_heads, head_dim, kv_lora_rank, rope_head_dim: as :class:`Attention`.

  Returns:
    dict name -> (storage "full", "ring" or "compressed", slots, per-slot shape).

  Example:
    >>> cache_layout(LayerSpec("global"), 10, num_kv_heads=2, head_dim=4)["v"]
    ('full', 10, (2, 4))
  """
  hk, d, r = num_kv_heads, head_dim, spec.compress_ratio
  if kv_lora_rank is not None:  # RoPE layers: one array [latent | k_rope] per token
    per = ({MLA_ROPE_CACHE: (kv_lora_rank + rope_head_dim,)} if rope_head_dim
           else {"latent": (kv_lora_rank,)})
  else:
    per = {"k": (hk, d), "v": (hk, d)}
  csa_ring = spec.kind == "csa" and spec.csa_mode == "compressed"
  raw = (("ring", spec.window) if spec.kind == "local"
         else ("ring", max(spec.window, 2 * r)) if csa_ring else ("full", max_len))
  out = {n: raw + (s,) for n, s in per.items()}
  if spec.kind == "csa":
    c = csa_ops.num_entries(max_len, r)
    out.update(gk=("ring", 2 * r, (hk, d)), gv=("ring", 2 * r, (hk, d)),
               ck=("compressed", c, (hk, d)), cv=("compressed", c, (hk, d)))
  return out
