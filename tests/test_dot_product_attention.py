"""``jattn.dot_product_attention`` against ``jax.nn.dot_product_attention(implementation="xla")``,
and ``jattn.nn.dot_product_attention`` inside ``flax.nnx.MultiHeadAttention``.

Random cases come from a seeded generator. A *group* shares the static configuration (rank,
lengths, heads, head dim, causal, window, which arrays exist and their broadcast shapes); its
batch elements are independent cases (each its own mask kind, sequence lengths and bias values),
so one compiled call checks several cases. Outputs and gradients (q, k, v and bias) are compared
in fp32 within 2e-3 relative error, except on the rows that see no key, where jattn returns 0
(jax.nn averages every value there): those rows are checked to be 0 and get a zero cotangent.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jattn
from pallas_kernels.block_schedule import make_schedule, mask_tile_classes
from tests.helpers import jit_run, rel_err

TOL = 2e-3   # fp32, relative


def _mask_case(rng, kind, t, s):
  """One bool [t, s] mask of a kind: dense random, block-structured, causal-like or all True."""
  if kind == "dense":
    return rng.random((t, s)) < rng.uniform(0.1, 0.9)
  if kind == "block":   # 32-row x 32-column tiles all on, all off or random inside
    bt, bs = -(-t // 32), -(-s // 32)
    tiles = rng.choice(3, size=(bt, bs), p=[0.4, 0.4, 0.2])
    up = np.repeat(np.repeat(tiles, 32, 0), 32, 1)[:t, :s]
    return (up == 1) | ((up == 2) & (rng.random((t, s)) < 0.5))
  if kind == "causal":   # a shifted lower triangle, sometimes banded
    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
    m = j <= i + rng.integers(-t // 4 - 1, s // 4 + 2)
    return m & (j > i - rng.integers(4, 80)) if rng.random() < 0.5 else m
  return np.ones((t, s), bool)


def make_group(rng, *, lengths=(1, 7, 33, 64, 100, 130), max_batch=4):
  """A random group: (kwargs for the call, arrays q, k, v, mask, bias, q/kv lengths)."""
  rank = 3 if rng.random() < 0.15 else 4
  b = 1 if rank == 3 else int(rng.integers(2, max_batch + 1))
  t, s = (int(x) for x in rng.choice(lengths, 2))
  hk = int(rng.choice([1, 2]))
  n = hk * int(rng.choice([1, 2])) if hk == 2 else int(rng.choice([1, 2, 4]))
  d = int(rng.choice([16, 32, 40]))
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape).astype(np.float32))
  q, k, v = normal(b, t, n, d), normal(b, s, hk, d), normal(b, s, hk, d)
  kw = {"is_causal": bool(rng.random() < 0.4)}
  w = rng.random()
  if w < 0.2:
    kw["local_window_size"] = int(rng.integers(0, 40))
  elif w < 0.4:
    kw["local_window_size"] = (int(rng.integers(0, 60)), int(rng.integers(0, 60)))
  if rng.random() < 0.3:
    kw["scale"] = float(rng.uniform(0.05, 0.5))
  arrays = {}
  if rng.random() < 0.3:
    arrays["query_seq_lengths"] = jnp.asarray(rng.integers(0, t + 2, b), jnp.int32)
  if rng.random() < 0.4:
    arrays["key_value_seq_lengths"] = jnp.asarray(rng.integers(1, s + 2, b), jnp.int32)
  if rng.random() < 0.7:   # per-head or shared, per-batch or shared, rows broadcast or not
    mb, mh = (b if rng.random() < 0.7 else 1), (n if rng.random() < 0.5 else 1)
    mt = t if rng.random() < 0.85 else 1
    kinds = rng.choice(["dense", "block", "causal", "all"], size=(mb, mh))
    m = np.stack([np.stack([_mask_case(rng, kd, mt, s) for kd in row]) for row in kinds])
    arrays["mask"] = jnp.asarray(m)
  if rng.random() < 0.5:
    shape = [b if rng.random() < 0.5 else 1, n if rng.random() < 0.5 else 1, t, s]
    if rng.random() < 0.3:
      shape[2] = 1
    arrays["bias"] = normal(*shape) * 2.0
  if rank == 3:
    q, k, v = q[0], k[0], v[0]
    for name in ("mask", "bias"):
      if name in arrays:
        arrays[name] = arrays[name][0]   # [N | 1, T | 1, S]
    for name in ("query_seq_lengths", "key_value_seq_lengths"):
      arrays.pop(name, None)   # jax.nn takes lengths with a batch axis only
  return kw, q, k, v, arrays


def _visible_rows(q, k, kw, arrays):
  """bool [B, N, T]: rows that see at least one key under jax.nn's semantics."""
  q4, k4 = (x if x.ndim == 4 else x[None] for x in (q, k))
  b, t, n, _ = q4.shape
  s = k4.shape[1]
  i, j = np.arange(t)[:, None], np.arange(s)[None, :]
  vis = np.ones((b, n, t, s), bool)
  if kw.get("is_causal"):
    vis &= j <= i
  if kw.get("local_window_size") is not None:
    w = kw["local_window_size"]
    left, right = (w, w) if isinstance(w, int) else w
    vis &= (j >= i - left) & (j <= i + right)
  if "mask" in arrays:
    m = np.asarray(arrays["mask"])
    vis &= m.reshape((1,) * (4 - m.ndim) + m.shape)
  if "query_seq_lengths" in arrays:
    vis &= (np.arange(t)[None, :] < np.asarray(arrays["query_seq_lengths"])[:, None])[:, None, :,
                                                                                      None]
  if "key_value_seq_lengths" in arrays:
    vis &= (np.arange(s)[None, :] < np.asarray(arrays["key_value_seq_lengths"])[:, None])[:, None,
                                                                                         None]
  return vis.any(-1)


def check_group(group, rng, *, implementation, interpret=False, tol=TOL, dtype=jnp.float32):
  """Outputs and gradients of jattn vs jax.nn ("xla", fp32 inputs) on one group."""
  kw, q, k, v, arrays = group
  rows = _visible_rows(q, k, kw, arrays)   # [B, N, T]
  rows = jnp.asarray(np.moveaxis(rows, 1, 2) if q.ndim == 4 else np.moveaxis(rows[0], 0, 1))
  ct = jnp.asarray(rng.standard_normal(q.shape).astype(np.float32)) * rows[..., None]
  diff = ("bias",) if "bias" in arrays else ()

  def loss(fn, q, k, v, *d):
    a = dict(arrays, **dict(zip(diff, d)))
    out = fn(q, k, v, a.pop("bias", None), a.pop("mask", None), **kw, **a)
    return jnp.sum(out.astype(jnp.float32) * ct), out

  ours = functools.partial(jattn.dot_product_attention, implementation=implementation,
                           interpret=interpret)
  ref = functools.partial(jax.nn.dot_product_attention, implementation="xla")
  grad = lambda fn: jax.grad(functools.partial(loss, fn), argnums=tuple(range(3 + len(diff))),
                             has_aux=True)
  args = [q, k, v] + [arrays[x] for x in diff]
  g_ref, out_ref = jax.jit(grad(ref))(*args)
  low = [x.astype(dtype) for x in args[:3]] + args[3:]
  g, out = jit_run(grad(ours), *low)
  assert out.shape == q.shape and out.dtype == dtype
  out = np.asarray(out, np.float32)
  np.testing.assert_array_equal(out[~np.asarray(rows)], 0.0)   # rows that see no key
  keep = np.asarray(rows)[..., None]
  assert rel_err(np.where(keep, out, 0), np.where(keep, out_ref, 0)) < tol, "out"
  # A gradient that is 0 in exact arithmetic (dq, dk and dbias where every row sees one key)
  # holds only the rounding of cancelling terms: a reference below 1% of the largest gradient's
  # RMS is measured against that 1% instead of its own norm.
  refs = [np.asarray(r, np.float64) for r in g_ref]
  rms = max(np.sqrt(np.mean(np.square(r))) for r in refs)
  for name, a, r in zip(("dq", "dk", "dv", "dbias"), g, refs):
    assert a.shape == r.shape, name
    floor = max(1e-2 * rms * np.sqrt(r.size), np.finfo(np.float64).tiny)   # tiny: all zero
    err = np.linalg.norm(np.ravel(np.asarray(a, np.float64) - r)) / max(np.linalg.norm(r), floor)
    assert err < tol, (name, err)


def _groups(seed, count, **kw):
  rng = np.random.default_rng(seed)
  return [make_group(rng, **kw) for _ in range(count)], rng


def _cases(groups):
  return sum(g[1].shape[0] if g[1].ndim == 4 else 1 for g in groups)


@pytest.mark.parametrize("seed", [0, 1])
def test_matches_jax_nn_xla(seed):
  groups, rng = _groups(seed, 6)
  for group in groups:
    check_group(group, rng, implementation="xla")


def test_matches_jax_nn_triton_interpret():
  groups, rng = _groups(11, 3, lengths=(7, 64, 100))   # GQA, causal, window, mask, bias, lengths
  for group in groups:
    check_group(group, rng, implementation="triton", interpret=True)


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_matches_jax_nn_sweep(implementation):
  groups, rng = _groups(100, 80)
  assert _cases(groups) >= 200
  for group in groups:
    check_group(group, rng, implementation=implementation, interpret=implementation != "xla")


@pytest.mark.gpu
@pytest.mark.parametrize("num_groups,min_cases,shard,shards",
                         [pytest.param(80, 200, 0, 1, marks=pytest.mark.slow),
                          *[(16, 36, i, 4) for i in range(4)]])
def test_matches_jax_nn_gpu(num_groups, min_cases, shard, shards):
  """The GPU paths against jax.nn: 16 case groups (39 cases) in the lean GPU suite, in 4 shards
  that xdist spreads over its workers; 80 (208) with --run-slow."""
  groups, rng = _groups(200, num_groups, lengths=(1, 100, 257, 1000))
  assert _cases(groups) >= min_cases
  for group in groups[shard::shards]:   # fp32: Triton on every GPU
    check_group(group, rng, implementation=None)
  for group in groups[:20][shard::shards]:   # bf16 (Mosaic GPU on Hopper where it covers the call)
    kw, q, k, v, arrays = group
    if q.shape[-1] in (16, 32):   # head_dim 64: the Hopper kernels' sizes
      q, k, v = (jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, 32)]) for x in (q, k, v))
    check_group((kw, q, k, v, arrays), rng, implementation=None, tol=2e-2, dtype=jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,causal,d", [(1, False, 128), (4, True, 64)])
def test_tile_uniform_mask_gpu(heads, causal, d):
  """Masks uniform on 128 x 128 tiles (the Mosaic GPU branch on Hopper) and the same mask with
  one mixed tile (the Triton fallback), bf16, against the fp32 xla path: out and gradients."""
  rng = np.random.default_rng(heads)
  b, t, hq, hk = 2, 1000, 4, 2
  tiles = rng.random((b, heads, 8, 8)) < 0.4
  aligned = np.repeat(np.repeat(tiles, 128, 2), 128, 3)[..., :t, :t]
  mixed = aligned.copy()
  mixed[:, :, 200:260, 300:310] = ~mixed[:, :, 200:260, 300:310]
  q, k, v, ct = (jnp.asarray(rng.standard_normal(s).astype(np.float32)).astype(jnp.bfloat16)
                 for s in ((b, t, hq, d), (b, t, hk, d), (b, t, hk, d), (b, t, hq, d)))
  f32 = lambda x: x.astype(jnp.float32)

  def run(m, impl, q, k, v):
    out, vjp = jax.vjp(lambda *x: jattn.flash_attention(*x, causal=causal, mask=m,
                                                        implementation=impl), q, k, v)
    return (out,) + vjp(ct.astype(out.dtype))
  for m in (aligned, mixed):
    got = jax.jit(functools.partial(run, jnp.asarray(m), None))(q, k, v)
    want = jax.jit(functools.partial(run, jnp.asarray(m), "xla"))(*map(f32, (q, k, v)))
    for name, x, y in zip(("out", "dq", "dk", "dv"), got, want):
      assert rel_err(f32(x), y) < 2e-2, (name, rel_err(f32(x), y))


def test_mask_schedule_skips_false_tiles_and_unmasks_true_tiles():
  rng = np.random.default_rng(3)
  m = _mask_case(rng, "block", 100, 130)[None, None]
  any_, all_ = (np.asarray(x)[0, 0] for x in mask_tile_classes(jnp.asarray(m), 32, 32))
  for i in range(4):
    for j in range(5):
      tile = m[0, 0, 32 * i:32 * i + 32, 32 * j:32 * j + 32]
      assert any_[i, j] == tile.any() and all_[i, j] == tile.all()
  s = jax.jit(lambda m: make_schedule(100, 130, 32, 32, mask=m))(jnp.asarray(m))
  np.testing.assert_array_equal(s.kv_counts[0, 0], any_.sum(1))
  # partial: tiles with both values, and the last kv tile's padding (130 = 4 x 32 + 2)
  partial = any_ & ~(all_ & (np.arange(5) < 4))
  np.testing.assert_array_equal(np.asarray(s.kv_partial[0, 0]).sum(1), partial.sum(1))
  g = jnp.asarray(np.stack([m[0, 0], ~m[0, 0]])[None, None])   # [1, 1, 2, T, S]: a GQA group
  s2 = make_schedule(100, 130, 32, 32, mask=g)
  np.testing.assert_array_equal(s2.kv_counts[0, 0], 5)


def test_differences_and_errors():
  q = jnp.ones((1, 8, 2, 16))
  out = jattn.dot_product_attention(q, q, q, mask=jnp.zeros((8, 8), bool))
  np.testing.assert_array_equal(out, 0.0)   # jax.nn: the mean of v
  with pytest.raises(ValueError, match="mask must be 4-D and broadcastable"):
    jattn.dot_product_attention(q, q, q, mask=jnp.ones((1, 3, 8, 8), bool))
  with pytest.raises(TypeError, match="mask must be a bool array"):
    jattn.dot_product_attention(q, q, q, mask=jnp.ones((8, 8)))
  with pytest.raises(ValueError, match="query_seq_lengths must be an integer array"):
    jattn.dot_product_attention(q, q, q, query_seq_lengths=jnp.ones((2,), jnp.int32))
  with pytest.raises(ValueError, match="all be rank 4"):
    jattn.dot_product_attention(q, q[0], q)
  with pytest.raises(ValueError, match="does not support mask or bias"):
    jattn.dot_product_attention(q, q, q, bias=jnp.ones((8, 8)), implementation="mosaic_tpu")


# ---------------------------------------------------------------------------------- Flax adapter


def _mha(attention_fn, seed=0):
  return nnx.MultiHeadAttention(num_heads=4, in_features=32, qkv_features=64, decode=False,
                                attention_fn=attention_fn, rngs=nnx.Rngs(seed))


@pytest.mark.parametrize("mask_kind", ["causal", "padding", "arbitrary"])
def test_nnx_multi_head_attention_matches_default(mask_kind):
  rng = np.random.default_rng(5)
  b, t = 3, 40
  x = jnp.asarray(rng.standard_normal((b, t, 32)).astype(np.float32))
  if mask_kind == "causal":
    mask = nnx.make_causal_mask(jnp.ones((b, t)))
  elif mask_kind == "padding":
    valid = jnp.arange(t)[None] < jnp.asarray([[t], [17], [1]])
    mask = nnx.make_attention_mask(valid, valid)
  else:
    mask = jnp.asarray(rng.random((b, 4, t, t)) < 0.3)
  rows = np.asarray(jnp.broadcast_to(mask, (b, 4, t, t)).astype(bool)).any(-1).all(1)  # [b, t]
  ct = jnp.asarray(rng.standard_normal((b, t, 32)).astype(np.float32)) * rows[..., None]
  ours, ref = _mha(jattn.nn.dot_product_attention), _mha(nnx.dot_product_attention)

  def loss(model, x):
    out = model(x, mask=mask, decode=False)
    return jnp.sum(out * ct), out

  grad = nnx.jit(nnx.grad(loss, argnums=(0, 1), has_aux=True))
  (gm, gx), out = grad(ours, x)
  (gm_ref, gx_ref), out_ref = grad(ref, x)
  keep = rows[..., None]
  assert rel_err(np.where(keep, out, 0), np.where(keep, out_ref, 0)) < TOL
  assert rel_err(gx, gx_ref) < TOL
  # per parameter, relative to the whole gradient's norm (the key bias's gradient is 0 in exact
  # arithmetic: a softmax does not change when every logit of a row shifts by the same amount)
  leaves, ref_leaves = jax.tree.leaves(nnx.state(gm)), jax.tree.leaves(nnx.state(gm_ref))
  total = np.sqrt(sum(np.sum(np.square(r)) for r in ref_leaves))
  for a, r in zip(leaves, ref_leaves):
    assert np.linalg.norm(np.ravel(a - r)) < TOL * total


def test_nn_adapter_options():
  q = jnp.ones((2, 8, 2, 16))
  with pytest.raises(ValueError, match="dropout"):
    jattn.nn.dot_product_attention(q, q, q, dropout_rate=0.1, deterministic=False)
  out = jattn.nn.dot_product_attention(q, q, q, dropout_rate=0.1, deterministic=True,
                                       dtype=jnp.bfloat16, is_causal=True)
  assert out.dtype == jnp.bfloat16 and out.shape == q.shape
  with pytest.raises(ValueError, match="module"):
    jattn.nn.dot_product_attention(q, q, q, module=object())
