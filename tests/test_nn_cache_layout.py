"""Head-major decode caches of the jattn.nn layers (``kv_cache_layout="hnd"``): decoding equals the
default "nhd" cache on the same weights and tokens, the caches really are head-major (and hold the
same entries), the kernels get ``kv_layout="hnd"``, and unsupported options raise."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jattn.nn.attention as nn_attention
from jattn import sparse
from jattn.nn import Attention, LayerSpec, Transformer, TransformerConfig, with_config

BASE = dict(vocab_size=61, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8)
# local ring of 8 < prefill chunk of 9 (the write wraps), then single steps (wrap again); a second
# chunk; two chunk sizes only, so each model's jitted decode compiles twice
CHUNKS = (9, 1, 1, 9, 1)
SEQ = sum(CHUNKS)  # 21


def _rel(a, b):
  a, b = (np.asarray(x, np.float64) for x in (a, b))   # numpy: no program per shape
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _spy(monkeypatch):
  """Record the kv_layout each decode kernel call gets (at trace time)."""
  seen = []
  dense, sp = nn_attention.decode_attention, sparse.sparse_decode_attention

  def dense_spy(*a, **k):
    seen.append(("dense", k.get("kv_layout", "nhd")))
    return dense(*a, **k)

  def sparse_spy(*a, **k):
    seen.append(("sparse", k.get("kv_layout", "nhd")))
    return sp(*a, **k)

  monkeypatch.setattr(nn_attention, "decode_attention", dense_spy)
  monkeypatch.setattr(sparse, "sparse_decode_attention", sparse_spy)
  return seen


def _decode(model, tokens, chunks):
  step = nnx.jit(lambda m, t: m.decode(t))
  outs, i = [], 0
  for c in chunks:
    outs.append(step(model, tokens[:, i:i + c]))
    i += c
  return jnp.concatenate(outs, axis=1)


def test_hnd_cache_decodes_like_nhd(monkeypatch):
  """Prefill + single steps + a chunk: "hnd" logits equal "nhd" (xla: to the bit on CPU; the
  check allows rounding), every K/V cache is [batch, kv_heads, slots, head_dim] and holds the
  "nhd" cache transposed (local ring after wrapping, full caches, sparse block sums), and the
  single steps reach the dense and sparse decode kernels with kv_layout="hnd"."""
  layers = (LayerSpec("local", window=8),
            LayerSpec("sparse", block_size=4, top_k=2, q_block_size=1, rope_base=None),
            LayerSpec("global"))
  cfg = TransformerConfig(num_layers=3, layers=layers, implementation="xla", **BASE)
  nhd = Transformer(cfg, rngs=nnx.Rngs(1))
  hnd = with_config(nhd, dataclasses.replace(cfg, kv_cache_layout="hnd"))
  tokens = jax.random.randint(jax.random.key(2), (2, SEQ), 0, cfg.vocab_size)
  seen = _spy(monkeypatch)
  outs = []
  for model in (nhd, hnd):
    model.init_cache(2, SEQ, jnp.float32)
    outs.append(_decode(model, tokens, CHUNKS))
  assert bool(jnp.all(jnp.isfinite(outs[0])))
  assert _rel(outs[1], outs[0]) < 1e-6
  half = len(seen) // 2                 # the nhd model traced first, then the hnd model
  assert set(seen[:half]) == {("dense", "nhd"), ("sparse", "nhd")}
  assert set(seen[half:]) == {("dense", "hnd"), ("sparse", "hnd")}
  for blk_n, blk_h, slots in zip(nhd.blocks, hnd.blocks, (8, SEQ, SEQ)):
    a_n, a_h = blk_n.attn, blk_h.attn
    assert a_h.kv_cache_layout == "hnd" and a_n.kv_cache_layout == "nhd"
    for name in ("k", "v"):
      c_n, c_h = getattr(a_n, f"cache_{name}")[...], getattr(a_h, f"cache_{name}")[...]
      assert c_n.shape == (2, slots, 2, 8)
      assert c_h.shape == (2, 2, slots, 8)
      np.testing.assert_allclose(jnp.swapaxes(c_h, 1, 2), c_n, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(hnd.blocks[0].attn.ring_pos_8[...],
                                nhd.blocks[0].attn.ring_pos_8[...])
  sums_n = nhd.blocks[1].attn.cache_block_sums[...]
  sums_h = hnd.blocks[1].attn.cache_block_sums[...]
  assert sums_n.shape == (2, 6, 2, 8) and sums_h.shape == (2, 2, 6, 8)   # ceil(21 / 4) blocks
  np.testing.assert_allclose(jnp.swapaxes(sums_h, 1, 2), sums_n, rtol=1e-6, atol=1e-6)
  # the incremental sums equal the sums of the whole head-major cache
  want = sparse.init_block_summaries(hnd.blocks[1].attn.cache_k[...], jnp.full((2,), SEQ),
                                     block_size=4, kv_layout="hnd").sums
  np.testing.assert_allclose(sums_h, want, rtol=1e-5, atol=1e-5)


def test_hnd_cache_single_steps_on_triton_interpret():
  """The Triton decode kernels (interpreted) on head-major caches: a local layer whose ring has
  wrapped and a global layer, stepped one token at a time from the same prefilled "hnd" cache,
  match the "xla" path (the prefill runs on "xla" and its cache is copied: the interpreted
  Triton flash forward of a chunk is slow and is not what this tests)."""
  layers = (LayerSpec("local", window=8), LayerSpec("global", rope_base=None))
  cfg = TransformerConfig(num_layers=2, layers=layers, implementation="xla",
                          kv_cache_layout="hnd", **BASE)
  ref = Transformer(cfg, rngs=nnx.Rngs(3))
  tri = with_config(ref, dataclasses.replace(cfg, implementation="triton", interpret=True))
  tokens = jax.random.randint(jax.random.key(4), (1, 12), 0, cfg.vocab_size)
  ref.init_cache(1, 12, jnp.float32)
  nnx.jit(lambda m, t: m.decode(t))(ref, tokens[:, :10])
  tri.init_cache(1, 12, jnp.float32)
  nnx.update(tri, jax.tree.map(jnp.copy, nnx.state(ref, nnx.Cache)))
  assert tri.blocks[0].attn.cache_k[...].shape == (1, 2, 8, 8)
  outs = [_decode(m, tokens[:, 10:], (1, 1)) for m in (ref, tri)]
  assert _rel(outs[1], outs[0]) < 1e-5


@pytest.mark.parametrize("kwargs,match", [
    (dict(kv_cache_layout="bhsd"), "kv_cache_layout must be"),
    (dict(kv_cache_layout="HND"), "kv_cache_layout must be"),
    (dict(kv_cache_layout=None), "kv_cache_layout must be"),
    (dict(kv_cache_layout="hnd", kv_lora_rank=12, rope_head_dim=4), "MLA"),
    (dict(kv_cache_layout="hnd", num_layers=2,
          layers=(LayerSpec("global"), LayerSpec("csa", window=8, top_k=2, compress_ratio=4))),
     "'csa' layers"),
])
def test_bad_kv_cache_layout_raises(kwargs, match):
  kw = {**BASE, "num_layers": 1, **kwargs}
  with pytest.raises(ValueError, match=match):
    TransformerConfig(**kw)
  spec = kw.get("layers", (LayerSpec("global"),))[-1]
  extra = {k: kw[k] for k in ("kv_lora_rank", "rope_head_dim") if k in kw}
  with pytest.raises(ValueError, match=match):
    Attention(32, 4, 2, 8, spec, kv_cache_layout=kw["kv_cache_layout"], rngs=nnx.Rngs(0),
              **extra)


def test_nhd_stays_the_default():
  assert TransformerConfig(**BASE, num_layers=1).kv_cache_layout == "nhd"
  layer = Attention(32, 4, 2, 8, LayerSpec("sparse", block_size=4, top_k=1), rngs=nnx.Rngs(0))
  layer.init_cache(2, 10)
  assert layer.cache_k[...].shape == (2, 10, 2, 8)
  assert layer.cache_block_sums[...].shape == (2, 3, 2, 8)
