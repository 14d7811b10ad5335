"""jattn.nn layers: specs, RoPE, masks per kind, CSA pooling/causality, options that must raise,
q/k capture, post-hoc sparsity and a jitted optax training step for every layer kind."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jattn.nn import (Attention, LayerSpec, Transformer, TransformerConfig, apply_rope,
                      attention_probabilities, local_global_schedule, sparsify, sparsify_config,
                      with_config)
from jattn.nn import csa as csa_ops

BASE = dict(vocab_size=37, d_model=24, num_heads=4, num_kv_heads=2, head_dim=6)


def _rel(a, b):
  a, b = (np.asarray(x, np.float64) for x in (a, b))   # numpy: no program per shape
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ------------------------------------------------------------------ specs
@pytest.mark.parametrize("kwargs", [
    dict(kind="dense"), dict(kind="local"), dict(kind="local", window=0),
    dict(kind="global", window=8), dict(kind="global", top_k=2), dict(kind="sparse"),
    dict(kind="sparse", top_k=2, window=4), dict(kind="sparse", top_k=2, gate_grad="soft"),
    dict(kind="csa", window=8), dict(kind="csa", top_k=2),
    dict(kind="csa", top_k=2, csa_mode="two_stage", window=4),
    dict(kind="csa", top_k=2, csa_mode="two_stage", block_size=6, compress_ratio=4),
    dict(kind="csa", top_k=2, csa_mode="fancy", window=4),
    dict(kind="global", csa_sink=True), dict(kind="local", window=4, gate_grad="ste"),
    dict(kind="global", rope_base=0.0), dict(kind="sparse", top_k=2, block_size=0),
])
def test_layer_spec_rejects_bad_combinations(kwargs):
  with pytest.raises(ValueError):
    LayerSpec(**kwargs)


def test_local_global_schedule():
  s = local_global_schedule(12, local_per_global=5, window=512)
  assert [x.kind for x in s] == (["local"] * 5 + ["global"]) * 2
  assert all(x.window == 512 and x.rope_base == 10000.0 for x in s if x.kind == "local")
  assert all(x.rope_base is None and x.window is None for x in s if x.kind == "global")
  with pytest.raises(ValueError):
    TransformerConfig(num_layers=3, layers=s, **BASE)


# ------------------------------------------------------------------ RoPE
def test_rope_is_relative_and_nope_is_identity():
  ks = jax.random.split(jax.random.key(0), 2)
  q = jax.random.normal(ks[0], (1, 1, 2, 8))
  k = jax.random.normal(ks[1], (1, 1, 2, 8))
  dot = lambda a, b: jnp.sum(apply_rope(q, jnp.array([[a]]), 100.0) *
                             apply_rope(k, jnp.array([[b]]), 100.0), -1)
  np.testing.assert_allclose(dot(3, 1), dot(12, 10), rtol=1e-5, atol=1e-5)
  assert float(jnp.abs(dot(3, 1) - dot(3, 2)).max()) > 1e-3
  np.testing.assert_array_equal(apply_rope(q, jnp.array([[5]]), None), q)
  # partial rotation leaves the tail untouched
  part = apply_rope(q, jnp.array([[5]]), 100.0, rotary_dim=4)
  np.testing.assert_array_equal(part[..., 4:], q[..., 4:])


# ------------------------------------------------------------------ masks per kind
def _layer(spec, **kw):
  return Attention(24, 4, 2, 6, spec, rngs=nnx.Rngs(1), **kw)


@pytest.mark.parametrize("spec", [LayerSpec("global", rope_base=None),
                                  LayerSpec("local", window=5)], ids=["global", "local"])
def test_attention_matches_probabilities_from_captured_qk(spec):
  layer = _layer(spec)
  x = jax.random.normal(jax.random.key(2), (2, 19, 24))

  @nnx.jit
  def run(layer, x):   # the layer, and its output recomposed from the captured q/k: one program
    y, qk = layer(x, return_qk=True)
    probs = attention_probabilities(qk["q"], qk["k"], spec)          # [b, h, s, s]
    v = layer.wv(x).reshape(2, 19, 2, 6)
    o = jnp.einsum("bhqk,bkhd->bqhd", probs, jnp.repeat(v, 2, axis=2),
                   precision=jax.lax.Precision.HIGHEST)
    return y, probs, layer.wo(o.reshape(2, 19, 24))

  y, probs, recomposed = run(layer, x)
  np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
  assert _rel(recomposed, y) < 1e-5
  if spec.kind == "local":   # probability mass only inside the window
    i, j = np.tril_indices(19, -5)
    assert np.abs(np.asarray(probs)[:, :, i, j]).max() == 0.0


def _influence(layer, j, seq=24):
  """|change of each output position| when input position j is perturbed."""
  x = jax.random.normal(jax.random.key(3), (1, seq, 24))
  x2 = x.at[:, j].add(jax.random.normal(jax.random.key(4), (24,)))
  return nnx.jit(lambda m, a, b: jnp.abs(m(b) - m(a)).max(axis=(0, 2)))(layer, x, x2)


@pytest.mark.parametrize("spec", [
    LayerSpec("local", window=4),
    LayerSpec("sparse", block_size=4, top_k=1, q_block_size=1),
    LayerSpec("csa", window=2, top_k=16, compress_ratio=4, csa_sink=True),
    LayerSpec("csa", csa_mode="two_stage", block_size=4, top_k=1, compress_ratio=2),
], ids=["local", "sparse", "csa_compressed", "csa_two_stage"])
def test_causality_and_reach(spec):
  """No output before the perturbed token changes (CSA: an entry appears only once its window is
  complete, else position j would leak to earlier queries through entries that contain it)."""
  layer = _layer(spec)
  j = 10
  d = _influence(layer, j)
  assert float(d[:j].max()) == 0.0
  assert float(d[j]) > 0.0
  if spec.kind == "local":
    assert float(d[j + 3]) > 0.0 and float(d[j + 4:].max()) == 0.0
  if spec.kind == "csa" and spec.csa_mode == "compressed":
    # window 2: j reaches j+1 raw; entries holding j (c=1: 4..11, c=2: 8..15) from t=11 on
    assert float(d[j + 1]) > 0.0 and float(d[11:].max()) > 0.0


def test_pool_windows_matches_loop():
  r, n = 3, 17
  ks = jax.random.split(jax.random.key(5), 3)
  x = jax.random.normal(ks[0], (2, n, 2, 4))
  g = jax.random.normal(ks[1], (2, n, 2, 4))
  bias = jax.random.normal(ks[2], (2 * r, 2, 4))
  c = csa_ops.num_entries(n, r)
  got = csa_ops.pool_windows(x, g, bias, r, c)
  for e in range(c):
    if csa_ops.entry_end(e, r) >= n:
      continue                               # never visible
    sl = slice(e * r, e * r + 2 * r)
    w = jax.nn.softmax(g[:, sl] + bias, axis=1)
    np.testing.assert_allclose(got[:, e], jnp.sum(w * x[:, sl], 1), rtol=1e-5, atol=1e-6)


def test_compressed_partial_against_dense_topk():
  """Compressed partial == softmax over the top-K visible entries, computed one row at a time."""
  r, k_top = 2, 3
  ks = jax.random.split(jax.random.key(6), 3)
  q = jax.random.normal(ks[0], (1, 13, 2, 4))
  ck = jax.random.normal(ks[1], (1, 7, 1, 4))
  cv = jax.random.normal(ks[2], (1, 7, 1, 4))
  o, lse = csa_ops.compressed_partial(q, ck, cv, jnp.arange(13)[None], ratio=r, top_k=k_top,
                                      scale=0.5)
  o, lse, q, ck, cv = map(np.asarray, (o, lse, q, ck, cv))
  for t in range(13):
    vis = [c for c in range(7) if c * r + 2 * r - 1 <= t]
    for h in range(2):
      if not vis:
        assert lse[0, t, h] == -np.inf and np.abs(o[0, t, h]).max() == 0.0
        continue
      s = np.array([q[0, t, h] @ ck[0, c, 0] * 0.5 for c in vis])
      top = np.argsort(-s)[:k_top]
      p = np.exp(s[top] - s[top].max())
      ref = (p[:, None] * cv[0, [vis[i] for i in top], 0]).sum(0) / p.sum()
      np.testing.assert_allclose(o[0, t, h], ref, rtol=1e-4, atol=1e-5)
      np.testing.assert_allclose(lse[0, t, h], np.log(p.sum()) + s[top].max(), rtol=1e-5)


def _old_pool_windows(x, gate, bias, ratio, n_entries):
  """``pool_windows`` before the memory work: a gather, no remat."""
  need = n_entries * ratio + ratio
  pad = [(0, 0), (0, max(0, need - x.shape[1])), (0, 0), (0, 0)]
  x, gate = jnp.pad(x, pad), jnp.pad(gate, pad)
  idx = jnp.arange(n_entries)[:, None] * ratio + jnp.arange(2 * ratio)[None]
  w = jax.nn.softmax(gate[:, idx].astype(jnp.float32) + bias.astype(jnp.float32), axis=2)
  return jnp.sum(w * x[:, idx].astype(jnp.float32), axis=2)


def _old_compressed_partial(q, ck, cv, q_pos, *, ratio, top_k, scale):
  """``compressed_partial`` before the memory work: whole [b, h, t, C] logits, no remat."""
  s, _ = csa_ops._entry_scores(q, ck, q_pos, ratio, scale)
  return csa_ops._softmax_partial(jnp.where(csa_ops._top_k_mask(s, top_k), s, -jnp.inf), cv)


def test_csa_layer_matches_unchunked_implementation(monkeypatch):
  """The memory-saving CSA layer (query chunks of 4 rows, the last padded; remat with the saved
  bit-packed selection; gather-free pooling; remat merge) == the old one (whole logits, gather
  pooling, no remat) in fp32: output and every parameter's gradient, sink included."""
  layer = _layer(LayerSpec("csa", compress_ratio=2, top_k=3, window=3, csa_sink=True))
  g, params = nnx.split(layer, nnx.Param)
  rng = np.random.default_rng(0)                  # non-zero pooling biases and sink
  params = jax.tree.map(lambda p: p + 0.3 * rng.standard_normal(p.shape, np.float32), params)
  x = rng.standard_normal((2, 19, 24), np.float32)
  w = rng.standard_normal((2, 19, 24), np.float32)
  vg = jax.value_and_grad(lambda params: jnp.sum(nnx.merge(g, params)(x) * w))
  assert csa_ops.query_chunk(None, 8, 4, 8192, 2048) == 512   # the h200 preset: 16 chunks

  @jax.jit   # one compilation; the module attributes are read while tracing
  def both(params):
    monkeypatch.setattr(csa_ops, "CHUNK_ELEMENTS", 2 * 4 * 10 * 4)   # b * hq * C * 4 rows
    new = vg(params)
    monkeypatch.setattr(csa_ops, "compressed_partial", _old_compressed_partial)
    monkeypatch.setattr(csa_ops, "pool_windows", _old_pool_windows)
    old = vg(params)
    monkeypatch.undo()
    return new, old

  new, old = jax.tree.map(np.asarray, both(params))
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old), strict=True):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-5)


def test_two_stage_query_chunks_match_one_chunk():
  """CSA two-stage over query chunks (7 rows, the last padded) == one chunk: output, lse and the
  gradients of q, k, v and the compressed keys/values (the selection saved as bits)."""
  ks = jax.random.split(jax.random.key(3), 5)
  t, c = 53, csa_ops.num_entries(53, 2)
  q = jax.random.normal(ks[0], (2, t, 4, 8))
  k, v = (jax.random.normal(kk, (2, t, 2, 8)) for kk in ks[1:3])
  ck, cv = (jax.random.normal(kk, (2, c, 2, 8)) for kk in ks[3:5])
  pos = jnp.broadcast_to(jnp.arange(t), (2, t))

  def run(q_chunk):
    def f(*xs):
      o, lse = csa_ops.two_stage_attention(*xs, pos, ratio=2, block_size=4, top_k=2, scale=0.3,
                                           q_chunk=q_chunk)
      return jnp.sum(o * jnp.cos(o)), (o, lse)
    return jax.jit(jax.grad(f, argnums=range(5), has_aux=True))(q, k, v, ck, cv)
  whole, chunked = run(None), run(7)
  assert csa_ops.query_chunk(None, 2, 4, t, t) == t   # None: one chunk at this size
  for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(chunked), strict=True):
    assert np.isfinite(np.asarray(b)).all()
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ options that cannot be honoured
def test_unhonourable_options_raise():
  with pytest.raises(ValueError):
    _layer(LayerSpec("csa", window=4, top_k=2), kv_lora_rank=8, rope_head_dim=2)
  with pytest.raises(ValueError):
    _layer(LayerSpec("global"), rope_head_dim=2)
  with pytest.raises(ValueError):
    _layer(LayerSpec("global"), kv_lora_rank=8)                  # RoPE needs rope_head_dim
  with pytest.raises(ValueError):
    _layer(LayerSpec("global", rope_base=None), kv_lora_rank=8, rope_head_dim=2)
  with pytest.raises(ValueError):
    _layer(LayerSpec("csa", csa_mode="two_stage", top_k=1, block_size=4), implementation="triton")
  with pytest.raises(ValueError):
    Attention(24, 4, 2, 5, LayerSpec("global"), rngs=nnx.Rngs(0))  # odd head_dim with RoPE
  with pytest.raises(ValueError):
    Attention(24, 4, 3, 6, LayerSpec("global"), rngs=nnx.Rngs(0))
  layer = _layer(LayerSpec("csa", window=4, top_k=2))
  x = jnp.ones((1, 8, 24))
  with pytest.raises(NotImplementedError):
    layer(x, segment_ids=jnp.ones((1, 8), jnp.int32))
  with pytest.raises(ValueError):
    layer.decode(x)                                              # no cache yet
  layer.init_cache(1, 10, jnp.float32)
  nnx.jit(lambda layer, x: layer.decode(x))(layer, x)             # one program, cache updated
  with pytest.raises(ValueError):
    layer.decode(x[:, :3])                                       # 8 + 3 > max_len


@pytest.mark.parametrize("kw,name", [
    (dict(mlp_dim=0), "mlp_dim"), (dict(mlp_dim=-4), "mlp_dim"), (dict(mlp_dim=2.5), "mlp_dim"),
    (dict(kv_lora_rank=0, rope_head_dim=4), "kv_lora_rank"),
    (dict(kv_lora_rank=-3, rope_head_dim=4), "kv_lora_rank"),
    (dict(kv_lora_rank=True, rope_head_dim=4), "kv_lora_rank"),
    (dict(kv_lora_rank=8, rope_head_dim=-2), "rope_head_dim"),
    (dict(rope_head_dim=4), "rope_head_dim"),
    (dict(qk_norm="no"), "qk_norm"), (dict(mla_absorb=3), "mla_absorb"),
    (dict(tie_embeddings=None), "tie_embeddings"), (dict(interpret=1), "interpret")])
def test_config_rejects_bad_options_by_name(kw, name):
  with pytest.raises((ValueError, TypeError), match=name):
    TransformerConfig(num_layers=1, **BASE, **kw)
  if name not in ("mlp_dim", "tie_embeddings"):
    with pytest.raises((ValueError, TypeError), match=name):          # the layer checks too
      Attention(24, 4, 2, 6, rngs=nnx.Rngs(0), **kw)


def test_config_valid_options_still_build():
  for kw in (dict(mlp_dim=np.int64(16)), dict(kv_lora_rank=8, rope_head_dim=2, qk_norm=True),
             dict(tie_embeddings=np.bool_(False), mla_absorb=False), dict(rope_head_dim=0)):
    cfg = TransformerConfig(num_layers=1, **BASE, **kw)
    assert Transformer(cfg, rngs=nnx.Rngs(0))(jnp.ones((1, 4), jnp.int32)).shape == (1, 4, 37)


# ------------------------------------------------------------------ post-hoc sparsity
def test_sparsify_keeps_weights():
  cfg = TransformerConfig(num_layers=1, layers=(LayerSpec("global", rope_base=None),), **BASE)
  model = Transformer(cfg, rngs=nnx.Rngs(8))
  tokens = jax.random.randint(jax.random.key(9), (1, 32), 0, 37)
  fwd = nnx.jit(lambda m, t: m(t))
  dense = fwd(model, tokens)
  # every block kept -> identical to dense
  everything = sparsify(model, top_k=8, block_size=4, q_block_size=4)
  assert [s.kind for s in everything.config.layers] == ["sparse"]
  assert everything.config.layers[0].rope_base is None
  assert _rel(fwd(everything, tokens), dense) < 1e-5
  few = sparsify(model, top_k=1, block_size=4, q_block_size=4)
  assert _rel(fwd(few, tokens), dense) > 1e-4
  p1 = jax.tree.leaves(nnx.state(model, nnx.Param))
  p2 = jax.tree.leaves(nnx.state(few, nnx.Param))
  assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(p1, p2))
  local = TransformerConfig(num_layers=2, layers=local_global_schedule(2, 1, window=4), **BASE)
  assert [s.kind for s in sparsify_config(local, 2).layers] == ["local", "sparse"]


# ------------------------------------------------------------------ training
ALL_KINDS = (LayerSpec("global", rope_base=None), LayerSpec("local", window=6),
             LayerSpec("sparse", block_size=4, top_k=1, q_block_size=4, gate_grad="ste"),
             LayerSpec("csa", window=4, top_k=2, compress_ratio=2, csa_sink=True),
             LayerSpec("csa", csa_mode="two_stage", block_size=4, top_k=1, compress_ratio=2))


@pytest.mark.parametrize("cfg_kw", [dict(num_layers=5, layers=ALL_KINDS, qk_norm=True)],
                         ids=["all_kinds"])
def test_jit_optax_train_step(cfg_kw):
  cfg = TransformerConfig(**cfg_kw, **BASE)
  model = Transformer(cfg, rngs=nnx.Rngs(10))
  graphdef, params = nnx.split(model, nnx.Param)
  tx = optax.adamw(3e-3)
  opt_state = tx.init(params)
  tokens = jax.random.randint(jax.random.key(11), (2, 25), 0, 37)

  def loss_fn(p, tok):
    logits = nnx.merge(graphdef, p)(tok[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tok[:, 1:]).mean()

  @jax.jit
  def step(p, s, tok):
    loss, grads = jax.value_and_grad(loss_fn)(p, tok)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s, loss, grads

  losses = []
  for _ in range(2):
    params, opt_state, loss, grads = step(params, opt_state, tokens)
    losses.append(float(loss))
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
  assert losses[-1] < losses[0]
  # every attention parameter takes part (CSA pooling gates and sink included)
  for i, blk in enumerate(grads["blocks"].values() if hasattr(grads["blocks"], "values")
                          else grads["blocks"]):
    for name, g in jax.tree_util.tree_leaves_with_path(blk["attn"]):
      assert float(jnp.abs(g).max()) > 0.0, (i, name)


def test_mla_and_gumbel_gate_grads():
  """MLA layers train (finite, nonzero grads); gate_grad="gumbel" draws from the layer's rngs."""
  cfg = TransformerConfig(num_layers=2, kv_lora_rank=8, rope_head_dim=2, tie_embeddings=False,
                          **BASE, layers=(LayerSpec("local", window=6), LayerSpec(
                              "sparse", block_size=4, top_k=1, q_block_size=4, gate_grad="gumbel",
                              rope_base=None)))
  model = Transformer(cfg, rngs=nnx.Rngs(12))
  tokens = jax.random.randint(jax.random.key(13), (1, 24), 0, 37)

  @nnx.jit
  def grads(m, tok):
    return nnx.grad(lambda m: m(tok).sum())(m)

  g = grads(model, tokens)
  leaves = jax.tree.leaves(nnx.state(g, nnx.Param))
  assert all(np.isfinite(np.asarray(x)).all() for x in leaves)
  mla = nnx.state(g, nnx.Param)["blocks"][0]["attn"]
  for name in ("w_dkv", "w_uk", "w_uv", "w_kr"):
    assert np.abs(np.asarray(mla[name]["kernel"][...])).max() > 0.0, name


# ------------------------------------------------------------------ GPU: default kernels vs "xla"
GPU_KINDS = (LayerSpec("global", rope_base=None), LayerSpec("local", window=64),
             LayerSpec("sparse", block_size=32, top_k=2, q_block_size=32, gate_grad="ste"),
             LayerSpec("csa", window=64, top_k=8, compress_ratio=4, csa_sink=True),
             LayerSpec("csa", csa_mode="two_stage", block_size=32, top_k=2, compress_ratio=4))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-3), (jnp.bfloat16, 2e-2)],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("cfg_kw", [
    dict(num_layers=5, layers=GPU_KINDS, qk_norm=True),
    dict(num_layers=3, layers=GPU_KINDS[:3], kv_lora_rank=32, rope_head_dim=16),
], ids=["all_kinds", "mla"])
@pytest.mark.parametrize("part", ["model", "layers"])
def test_gpu_default_kernels_match_xla(cfg_kw, dtype, tol, part):
  """Forward, gradients and decode with the platform kernels (implementation=None) agree with
  the "xla" path on the same weights: the whole model, then (a test of its own, so that xdist
  runs the two in parallel) layer by layer."""
  # fp32 means fp32: without this, XLA runs the fp32 projections on the GPU as TF32 (~1e-3
  # relative), and prefill vs one-token decode round differently (different matmul shapes).
  precision = "highest" if dtype == jnp.float32 else "default"
  with jax.default_matmul_precision(precision):
    _check_default_kernels_match_xla(cfg_kw, dtype, tol, part)


def _check_default_kernels_match_xla(cfg_kw, dtype, tol, part):
  """Whole model: loss (and in fp32 every gradient and the decoded logits). Per layer, on the
  reference model's activations: attention output, every gradient and decode.

  Block-sparse and CSA layers select blocks/entries with top-k, which is discontinuous. In bf16
  the two paths' activations differ by rounding (each as far from an fp32 model as the other),
  which after a few layers flips near-tied selections and moves the gradients of the selection
  layers' parameters by ~0.1 relative (CPU interpret mode: CSA bias_k 0.108 kernel vs xla, 0.120
  kernel vs fp32, 0.120 xla vs fp32; 0.03 with every block selected). So gradients and decode are
  compared layer by layer on identical inputs, where both paths select the same blocks (checked:
  q and k agree to a few ulps; bit-equal in bf16 on CPU and H200), and on the whole model only
  in fp32."""
  import dataclasses
  kw = dict(vocab_size=101, d_model=128, num_heads=4, num_kv_heads=2, head_dim=32, dtype=dtype)
  cfg = TransformerConfig(**cfg_kw, **kw)
  model = Transformer(cfg, rngs=nnx.Rngs(20))
  ref = with_config(model, dataclasses.replace(cfg, implementation="xla"))
  tokens = jax.random.randint(jax.random.key(21), (2, 257), 0, 101)
  f32 = lambda a: a.astype(jnp.float32)
  leaves = lambda g: jax.tree.leaves(nnx.state(g, nnx.Param))

  def loss_and_grads(m):
    def loss(m):
      logits = m(tokens[:, :-1]).astype(jnp.float32)
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return nnx.jit(nnx.value_and_grad(loss))(m)

  # decode selects sparse blocks per token: compare with the q_block_size=1 forward
  per_token = tuple(dataclasses.replace(s, q_block_size=1) if s.kind == "sparse" else s
                    for s in cfg.layers)
  ref1 = with_config(model, dataclasses.replace(cfg, implementation="xla", layers=per_token))
  if part == "model":
    (l1, g1), (l2, g2) = loss_and_grads(model), loss_and_grads(ref)
    assert abs(float(l1) - float(l2)) < tol * abs(float(l2))
    if dtype == jnp.float32:
      for a, b in zip(leaves(g1), leaves(g2)):
        assert _rel(f32(a), f32(b)) < 5 * tol
      full = nnx.jit(lambda m, t: m(t))(ref1, tokens[:, :256]).astype(jnp.float32)
      model.init_cache(2, 256, dtype)
      step = nnx.jit(lambda m, t: m.decode(t))
      outs = [step(model, tokens[:, :250])] + [step(model, tokens[:, i:i + 1])
                                               for i in range(250, 256)]
      assert _rel(f32(jnp.concatenate(outs, 1)), full) < tol
    return

  # layer by layer on the reference model's activations
  fwd = nnx.jit(lambda a, h: a(h, return_qk=True))

  @nnx.jit
  def grads(a, h, ct):
    return nnx.grad(lambda a, h: jnp.sum(f32(a(h)) * ct), argnums=(0, 1))(a, h)

  step = nnx.jit(lambda a, h: a.decode(h))
  x = nnx.jit(lambda m, t: m.embed(t))(ref, tokens[:, :256])
  for i, (blk, rblk, rblk1) in enumerate(zip(model.blocks, ref.blocks, ref1.blocks)):
    h = nnx.jit(lambda b, x: b.attn_norm(x))(rblk, x)
    (y1, qk1), (y2, qk2) = fwd(blk.attn, h), fwd(rblk.attn, h)
    for n in ("q", "k"):  # the same q/k up to a few ulps (XLA fuses the two programs'
      # projections differently), hence the same block/entry selections in both paths
      d = float(jnp.max(jnp.abs(f32(qk1[n]) - f32(qk2[n]))))
      assert d <= 4 * float(jnp.finfo(dtype).eps) * float(jnp.max(jnp.abs(f32(qk2[n])))), (i, n, d)
    assert _rel(f32(y1), f32(y2)) < tol, (i, "out")
    ct = jax.random.normal(jax.random.key(22 + i), y2.shape, jnp.float32)
    (ga, gh), (ra, rh) = grads(blk.attn, h, ct), grads(rblk.attn, h, ct)
    assert _rel(f32(gh), f32(rh)) < 5 * tol, (i, "d input")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(nnx.state(ga, nnx.Param)),
                            leaves(ra)):
      assert _rel(f32(a), f32(b)) < 5 * tol, (i, jax.tree_util.keystr(path))
    full = fwd(rblk1.attn, h)[0]
    blk.attn.init_cache(2, 256, dtype)
    outs = [step(blk.attn, h[:, :250])] + [step(blk.attn, h[:, j:j + 1]) for j in range(250, 256)]
    assert _rel(f32(jnp.concatenate(outs, 1)), f32(full)) < tol, (i, "decode")
    x = nnx.jit(lambda b, x: b(x))(rblk, x)
