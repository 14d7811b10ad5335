"""Step-by-step decode equals the full forward pass (fp32, within 2e-3) for every layer kind."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jattn.nn import Attention, LayerSpec, Transformer, TransformerConfig, local_global_schedule

BASE = dict(vocab_size=61, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8)
# prefill, single steps, chunks longer than the local window (they wrap the ring), more steps;
# two chunk sizes only, so the jitted decode compiles twice
CHUNKS = (9, 1, 1, 9, 1, 9)
SEQ = sum(CHUNKS)  # 30


def _rel(a, b):
  a, b = (np.asarray(x, np.float64) for x in (a, b))   # numpy: no program per shape
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _decode_vs_full(cfg, seed, batch=2, chunks=CHUNKS):
  model = Transformer(cfg, rngs=nnx.Rngs(seed))
  seq = sum(chunks)
  tokens = jax.random.randint(jax.random.key(seed + 100), (batch, seq), 0, cfg.vocab_size)
  full = nnx.jit(lambda m, t: m(t))(model, tokens)
  model.init_cache(batch, seq, jnp.float32)
  step = nnx.jit(lambda m, t: m.decode(t))
  outs, i = [], 0
  for c in chunks:
    outs.append(step(model, tokens[:, i:i + c]))
    i += c
  dec = jnp.concatenate(outs, axis=1)
  assert dec.shape == full.shape == (batch, seq, cfg.vocab_size)
  assert bool(jnp.all(jnp.isfinite(dec)))
  return model, tokens, full, dec


def test_local_global_ring_buffer_wraps():
  cfg = TransformerConfig(num_layers=6, layers=local_global_schedule(6, window=8), **BASE)
  model, tokens, full, dec = _decode_vs_full(cfg, seed=1)
  assert _rel(dec, full) < 2e-3
  # local layers hold a ring of `window` tokens, not max_len
  assert model.blocks[0].attn.cache_k[...].shape[1] == 8
  assert model.blocks[5].attn.cache_k[...].shape[1] == SEQ


@pytest.mark.parametrize("top_k", [2, 0.4])
def test_sparse_layers_q_block_1_mqa(top_k):
  """Decode equals the full forward; a fractional top_k (each token keeps 40% of its visible
  blocks) selects the same blocks token by token in both."""
  layers = (LayerSpec("local", window=8),
            LayerSpec("sparse", block_size=4, top_k=top_k, q_block_size=1, rope_base=None))
  cfg = TransformerConfig(num_layers=2, layers=layers, **{**BASE, "num_kv_heads": 1})
  _, _, full, dec = _decode_vs_full(cfg, seed=2)
  assert _rel(dec, full) < 2e-3


def test_fractional_top_k_decodes_under_triton():
  """A share of blocks (float top_k) with implementation="triton" decodes through the XLA
  sparse decode (the Triton one selects a whole number of blocks): same logits as "xla"."""
  spec = LayerSpec("sparse", block_size=16, top_k=0.4, q_block_size=16, rope_base=None)
  logits = []
  for impl in ("xla", "triton"):
    cfg = TransformerConfig(num_layers=1, layers=(spec,), implementation=impl, interpret=True,
                            **BASE)
    logits.append(_decode_vs_full(cfg, seed=5, batch=1, chunks=(9, 1, 1))[3])
  np.testing.assert_allclose(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def test_sparse_decode_block_sums_are_incremental(monkeypatch):
  """Sparse layers keep their block summaries in the cache: each decode step adds only its new
  keys (no re-read of the whole cache), and the sums equal those of the whole cache."""
  from jattn import sparse
  layers = (LayerSpec("sparse", block_size=4, top_k=2, q_block_size=1, rope_base=None),)
  cfg = TransformerConfig(num_layers=1, layers=layers, **BASE)
  model = Transformer(cfg, rngs=nnx.Rngs(3))
  tokens = jax.random.randint(jax.random.key(4), (2, 13), 0, cfg.vocab_size)

  def no_resummary(*a, **k):
    raise AssertionError("decode re-summarised the whole cache")

  monkeypatch.setattr(sparse, "init_block_summaries", no_resummary)
  model.init_cache(2, 16, jnp.float32)
  attn = model.blocks[0].attn
  assert attn.cache_block_sums[...].shape == (2, 4, 2, 8)    # ceil(16 / 4) blocks, fp32
  # jitted (as a model decodes): a call of init_block_summaries while tracing still raises
  step = nnx.jit(lambda m, t: m.decode(t))
  i = 0
  for c in (5, 1, 3, 1, 3):        # chunks that cross block boundaries
    step(model, tokens[:, i:i + c])
    i += c
  monkeypatch.undo()
  want = sparse.init_block_summaries(attn.cache_k[...], jnp.full((2,), i, jnp.int32),
                                     block_size=4).sums
  np.testing.assert_allclose(attn.cache_block_sums[...], want, rtol=1e-6, atol=1e-6)
  model.init_cache(2, 16, jnp.float32)                        # a reset clears them
  assert not bool(jnp.any(model.blocks[0].attn.cache_block_sums[...]))


def test_csa_both_modes():
  layers = (LayerSpec("csa", window=6, top_k=2, compress_ratio=2, csa_sink=True),
            LayerSpec("csa", csa_mode="two_stage", block_size=6, top_k=1, compress_ratio=3,
                      rope_base=None))
  cfg = TransformerConfig(num_layers=2, layers=layers, **BASE)
  _, _, full, dec = _decode_vs_full(cfg, seed=5)
  assert _rel(dec, full) < 2e-3


def test_mla_qk_norm():
  cfg = TransformerConfig(num_layers=2, layers=local_global_schedule(2, 1, window=8),
                          kv_lora_rank=12, rope_head_dim=4, qk_norm=True, tie_embeddings=False,
                          **BASE)
  model, _, full, dec = _decode_vs_full(cfg, seed=7)
  assert _rel(dec, full) < 2e-3
  # the cache holds the latent (and the RoPE key in RoPE layers) only
  attn = model.blocks[1].attn                                  # global NoPE layer
  assert attn.cache_names == ("latent",)
  assert attn.cache_latent[...].shape == (2, SEQ, 12)
  local = model.blocks[0].attn                                 # local RoPE layer: ring of 8
  assert local.cache_names == ("latent_k_rope",)               # one array [latent | k_rope]
  assert local.cache_latent_k_rope[...].shape == (2, 8, 12 + 4)


def test_packed_rows_decode_one_document_at_a_time():
  """Packed forward (segment ids, restarting positions) == decoding each document on its own."""
  # (sparse layers are left out: their key blocks are aligned to the packed row, so per-document
  # decoding selects from differently aligned blocks)
  layers = (LayerSpec("local", window=5), LayerSpec("global", rope_base=None))
  cfg = TransformerConfig(num_layers=2, layers=layers, **BASE)
  model = Transformer(cfg, rngs=nnx.Rngs(11))
  lengths = [(9, 14, 5), (17, 9)]         # row 1 ends in 2 padding tokens
  seq = 28
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.vocab_size, (2, seq))
  seg = np.zeros((2, seq), np.int32)
  pos = np.zeros((2, seq), np.int32)
  for r, lens in enumerate(lengths):
    s = 0
    for d, n in enumerate(lens):
      seg[r, s:s + n] = d + 1
      pos[r, s:s + n] = np.arange(n)
      s += n
  fwd = nnx.jit(lambda m, t, s, p: m(t, s, p))
  full = fwd(model, jnp.asarray(tokens), jnp.asarray(seg), jnp.asarray(pos))
  step = nnx.jit(lambda m, t: m.decode(t))
  for r, lens in enumerate(lengths):
    s = 0
    for n in lens:
      doc = jnp.asarray(tokens[r:r + 1, s:s + n])
      model.init_cache(1, 17, jnp.float32)            # one cache size for every document
      outs = [step(model, doc[:, :3])] + [step(model, doc[:, i:i + 1]) for i in range(3, n)]
      assert _rel(jnp.concatenate(outs, 1), full[r:r + 1, s:s + n]) < 2e-3
      s += n
  # the packing matters: without segment ids the second document sees the first
  unpacked = fwd(model, jnp.asarray(tokens), jnp.ones((2, seq), jnp.int32),
                 jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (2, seq)))
  assert _rel(unpacked[:, 9:23], full[:, 9:23]) > 1e-2


def test_fp32_weights_with_bf16_cache_on_pallas_kernels():
  """fp32 parameters with a bf16 cache: decode hands the kernels one dtype (the cache's), for a
  prefill chunk and a single token of every layer kind (the Triton kernels reject mixed q/k/v);
  the result matches the "xla" path decoding the same weights into the same bf16 cache."""
  import dataclasses
  from jattn.nn.transformer import with_config
  layers = (LayerSpec("global", rope_base=None), LayerSpec("local", window=8),
            LayerSpec("sparse", block_size=16, top_k=1, q_block_size=16),
            LayerSpec("csa", window=8, top_k=2, compress_ratio=4))
  cfg = TransformerConfig(num_layers=4, layers=layers, implementation="triton", interpret=True,
                          **BASE)
  model = Transformer(cfg, rngs=nnx.Rngs(3))
  ref = with_config(model, dataclasses.replace(cfg, implementation="xla", interpret=False))
  tokens = jax.random.randint(jax.random.key(4), (1, 40), 0, cfg.vocab_size)
  outs = []
  for m in (model, ref):
    m.init_cache(1, 40, jnp.bfloat16)
    step = nnx.jit(lambda m, t: m.decode(t))
    outs.append(jnp.concatenate([step(m, tokens[:, :39]), step(m, tokens[:, 39:])], axis=1))
  assert outs[0].dtype == jnp.float32
  assert _rel(outs[0], outs[1]) < 2e-2  # bf16 attention on both paths


def test_mla_sparse_decode_on_pallas_kernels():
  """MLA values are narrower than its keys (head_dim vs head_dim + rope_head_dim): the Triton
  block-sparse decode (sparse layer) and the Triton split-KV decode (the single steps of the
  local and global layers, absorbed: keys latent + RoPE key, values the latent, one kv head)
  take the unpadded values, return value-width outputs and match the q_block_size=1 forward."""
  import dataclasses
  from jattn.nn.transformer import with_config
  layers = (LayerSpec("local", window=8),
            LayerSpec("sparse", block_size=16, top_k=1, q_block_size=16), LayerSpec("global"))
  cfg = TransformerConfig(num_layers=3, layers=layers, kv_lora_rank=12, rope_head_dim=8,
                          implementation="triton", interpret=True, **BASE)
  model = Transformer(cfg, rngs=nnx.Rngs(9))
  assert model.blocks[2].attn.absorbed_decode
  per_token = (layers[0], dataclasses.replace(layers[1], q_block_size=1), layers[2])
  ref = with_config(model, dataclasses.replace(cfg, implementation="xla", interpret=False,
                                               layers=per_token))
  tokens = jax.random.randint(jax.random.key(10), (2, 80), 0, cfg.vocab_size)
  with jax.default_matmul_precision("highest"):
    full = nnx.jit(lambda m, t: m(t))(ref, tokens)
    model.init_cache(2, 80, jnp.float32)
    step = nnx.jit(lambda m, t: m.decode(t))
    dec = jnp.concatenate([step(model, tokens[:, :76])] +
                          [step(model, tokens[:, i:i + 1]) for i in range(76, 80)], axis=1)
  assert _rel(dec, full) < 2e-3


# MLA weight absorption: awkward sizes (latent 24, RoPE key 8, head_dim 12, GQA 4:2)
MLA = dict(kv_lora_rank=24, rope_head_dim=8)
MLA_SPECS = [(LayerSpec("global"), 8), (LayerSpec("global", rope_base=None), 0),
             (LayerSpec("local", window=5), 8)]


def _mla_layer(spec, rope_head_dim, **kw):
  return Attention(40, 4, 2, 12, spec, kv_lora_rank=24, rope_head_dim=rope_head_dim,
                   rngs=nnx.Rngs(0), **kw)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("spec,rope_head_dim", MLA_SPECS, ids=["global", "global_nope", "local"])
def test_mla_absorbed_decode_equals_expanded(spec, rope_head_dim, dtype, tol):
  """Single-token MLA decode attending the latent (absorbed w_uk / w_uv) equals expanding the
  cache into per-head keys/values, step by step after a prefill (the local ring wraps)."""
  x = jax.random.normal(jax.random.key(1), (3, 13, 40))
  outs = []
  for absorb in (True, False):
    layer = _mla_layer(spec, rope_head_dim, mla_absorb=absorb)     # same seed: same weights
    assert layer.absorbed_decode == absorb
    layer.init_cache(3, 13, dtype)
    step = nnx.jit(lambda m, t: m.decode(t))
    step(layer, x[:, :6])
    outs.append(jnp.concatenate([step(layer, x[:, i:i + 1]) for i in range(6, 13)], axis=1))
  assert _rel(outs[0], outs[1]) < tol, _rel(outs[0], outs[1])


def test_mla_absorbed_decode_equals_full_forward():
  """Transformer decode with absorbed MLA (global RoPE / NoPE and local layers) == forward."""
  layers = (LayerSpec("local", window=8), LayerSpec("global"), LayerSpec("global", rope_base=None))
  cfg = TransformerConfig(num_layers=3, layers=layers, tie_embeddings=False, **MLA,
                          **{**BASE, "head_dim": 12})
  model, _, full, dec = _decode_vs_full(cfg, seed=12)
  assert all(blk.attn.absorbed_decode for blk in model.blocks)
  assert _rel(dec, full) < 2e-3


def _out_shapes(jaxpr, primitive):
  """Output shapes of every ``primitive`` equation in a jaxpr and its sub-jaxprs (jit,
  custom_vjp, pallas_call, ...)."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == primitive:
      yield eqn.outvars[0].aval.shape
    for val in eqn.params.values():
      for sub in val if isinstance(val, (tuple, list)) else (val,):
        if hasattr(sub, "eqns"):
          yield from _out_shapes(getattr(sub, "jaxpr", sub), primitive)


@pytest.mark.parametrize("spec,rope_head_dim", MLA_SPECS[:2], ids=["global", "global_nope"])
def test_mla_absorbed_decode_does_not_expand_the_cache(spec, rope_head_dim):
  """The traced single-token step has no matmul producing per-head keys/values over the cache
  ([batch, max_len, kv_heads * head_dim]); the expanded path (mla_absorb=False, or qk_norm) has."""
  b, max_len = 2, 64

  def expands(layer):
    layer.init_cache(b, max_len, jnp.float32)
    graph, state = nnx.split(layer)
    jaxpr = jax.make_jaxpr(lambda s, x: nnx.merge(graph, s).decode(x))(
        state, jnp.ones((b, 1, 40)))
    big = b * max_len * layer.num_kv_heads * layer.head_dim
    return any(max_len in s and np.prod(s) >= big
               for s in _out_shapes(jaxpr.jaxpr, "dot_general"))

  assert not expands(_mla_layer(spec, rope_head_dim))
  assert expands(_mla_layer(spec, rope_head_dim, mla_absorb=False))
  assert expands(_mla_layer(spec, rope_head_dim, qk_norm=True))


@pytest.mark.parametrize("spec,slots", [(LayerSpec("global"), 64),
                                        (LayerSpec("local", window=7), 7)], ids=["global", "local"])
def test_mla_absorbed_decode_does_not_copy_the_cache(spec, slots):
  """RoPE MLA layers cache one [latent | k_rope] array and the absorbed single-token step passes
  it as keys and values as is: no concatenate over the cache's slots (latent ++ k_rope) in the
  traced step, which would copy the whole cache at every token."""
  b, max_len = 2, 64
  layer = _mla_layer(spec, 8, implementation="xla")
  assert layer.absorbed_decode
  layer.init_cache(b, max_len, jnp.float32)
  graph, state = nnx.split(layer)
  jaxpr = jax.make_jaxpr(lambda s, x: nnx.merge(graph, s).decode(x))(state, jnp.ones((b, 1, 40)))
  shapes = list(_out_shapes(jaxpr.jaxpr, "concatenate"))
  assert shapes                                        # (the query's [q_abs | q_rope] is one)
  assert not [s for s in shapes if slots in s[1:2]], shapes
  assert layer.cache_names == ("latent_k_rope",)


def test_mla_absorbed_decode_rules():
  """Which layers absorb: MLA without qk_norm on xla / mosaic_tpu; on triton only while the
  absorbed query tile has at most the elements of the kernel's largest tested tile (16 heads x
  256 lanes); "mosaic_gpu" decodes with the Triton kernel, so its rule."""
  mla = lambda heads, rank, rope, impl, **kw: nnx.eval_shape(lambda: Attention(   # no weights
      64, heads, 2, 16, kv_lora_rank=rank, rope_head_dim=rope, implementation=impl,
      rngs=nnx.Rngs(0), **kw)).absorbed_decode
  assert mla(4, 24, 8, "xla") and mla(4, 24, 8, "mosaic_tpu")
  assert mla(16, 192, 64, "triton")                    # 16 x 256: the largest tested tile
  assert not mla(16, 192, 72, "triton")                # 16 x 512
  assert mla(32, 96, 32, "triton")                     # 32 x 128: as many elements
  assert not mla(32, 192, 64, "triton")                # 32 x 256
  assert not mla(128, 512, 64, "triton")               # DeepSeek-V3 sizes: expansion
  assert mla(128, 512, 64, "xla")
  assert not mla(4, 24, 8, "xla", mla_absorb=False)
  assert not mla(4, 24, 8, "xla", qk_norm=True)
  assert mla(4, 24, 8, "mosaic_gpu") and not mla(16, 192, 72, "mosaic_gpu")
