"""jattn.merge: exact log-sum-exp merge vs attention over the whole key set, forward and VJP."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn.merge import merge, merge_partials
from pallas_kernels.flash.reference import attention_reference
from tests.helpers import normal

HI = jax.lax.Precision.HIGHEST


def _rel(x, ref):
  x, ref = (np.asarray(a, np.float64) for a in (x, ref))   # numpy: no program per shape
  return float(np.linalg.norm((x - ref).ravel()) / np.linalg.norm(ref.ravel()))


def _qkv(seed, b=2, sq=5, sk=37, hq=4, hk=2, d=24):
  return normal(seed, (b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, d))


# Chunk boundaries over 37 keys; the chunk [9, 9) is empty on purpose (lse -inf, out 0).
BOUNDS = (0, 9, 9, 20, 37)


def _full(q, k, v, mask):
  out, lse = attention_reference(q, k, v, block_mask=mask)
  return jnp.moveaxis(out, 1, 2), lse                      # [b, h, sq, d], [b, h, sq]


def _chunked(q, k, v, mask, merge_fn):
  outs, lses = [], []
  for lo, hi in zip(BOUNDS[:-1], BOUNDS[1:]):
    if hi == lo:  # an empty key set: what a split past the end of a sequence returns
      outs.append(jnp.zeros(q.shape[:1] + (q.shape[2], q.shape[1], v.shape[-1]), jnp.float32))
      lses.append(jnp.full(q.shape[:1] + (q.shape[2], q.shape[1]), -jnp.inf))
      continue
    o, l = attention_reference(q, k[:, lo:hi], v[:, lo:hi], block_mask=mask[..., lo:hi])
    outs.append(jnp.moveaxis(o, 1, 2))
    lses.append(l)
  return merge_fn(outs, lses)


def _stack_merge(outs, lses):
  return merge_partials(jnp.stack(outs, axis=2), jnp.stack(lses, axis=2), axis=2)


def _pairwise_merge(outs, lses):
  o, l = outs[0], lses[0]
  for o2, l2 in zip(outs[1:], lses[1:]):
    o, l = merge(o, l, o2, l2)
  return o, l


def _mask(seed, b, sq, sk):
  """Random key mask; row (0, :, 1) sees nothing at all, row (1, :, 2) only keys in [9, 20)."""
  m = np.random.default_rng(seed).random((b, 1, sq, sk)) < 0.7
  m[0, :, 1] = False
  m[1, :, 2] = False
  m[1, :, 2, 9:20] = True
  return jnp.asarray(m)


@pytest.mark.parametrize("merge_fn", [_stack_merge, _pairwise_merge], ids=["partials", "pairwise"])
def test_merge_matches_whole_attention_forward_and_vjp(merge_fn):
  q, k, v = _qkv(0)
  mask = _mask(1, q.shape[0], q.shape[1], k.shape[1])
  ref_out, ref_lse = jax.jit(_full)(q, k, v, mask)
  out, lse = jax.jit(lambda *a: _chunked(*a, merge_fn))(q, k, v, mask)
  assert _rel(out, ref_out) < 1e-5
  # Empty rows: 0 output, -inf lse, and no NaN anywhere.
  assert bool(jnp.all(out[0, :, 1] == 0)) and bool(jnp.all(jnp.isneginf(lse[0, :, 1])))
  assert not bool(jnp.any(jnp.isnan(out)))
  fin = jnp.isfinite(ref_lse)
  assert bool(jnp.all(fin == jnp.isfinite(lse)))
  np.testing.assert_allclose(np.asarray(lse)[np.asarray(fin)], np.asarray(ref_lse)[np.asarray(fin)],
                             rtol=1e-5, atol=1e-5)

  g_out, g_lse = normal(2, out.shape, lse.shape)
  g_lse = jnp.where(fin, g_lse, 0.0)

  def loss(fn, q, k, v):
    o, l = fn(q, k, v)
    return jnp.sum(o * g_out) + jnp.sum(jnp.where(fin, l, 0.0) * g_lse)

  ref_grads = jax.jit(jax.grad(lambda *a: loss(lambda q, k, v: _full(q, k, v, mask), *a),
                               argnums=(0, 1, 2)))(q, k, v)
  grads = jax.jit(jax.grad(lambda *a: loss(lambda q, k, v: _chunked(q, k, v, mask, merge_fn), *a),
                           argnums=(0, 1, 2)))(q, k, v)
  for g, rg in zip(grads, ref_grads):
    assert bool(jnp.all(jnp.isfinite(g)))
    assert _rel(g, rg) < 1e-5


def test_all_empty_partials_give_zero_output_and_finite_grads():
  outs, = normal(3, (3, 2, 5, 8))
  lses = jnp.full((3, 2, 5), -jnp.inf).at[1, 0, 0].set(0.3)   # only one non-empty entry
  out, lse = jax.jit(merge_partials)(outs, lses)
  assert bool(jnp.all(out[1:] == 0)) and bool(jnp.all(out[0, 1:] == 0))
  np.testing.assert_allclose(np.asarray(out[0, 0]), np.asarray(outs[1, 0, 0]), rtol=1e-6)
  assert float(lse[0, 0]) == pytest.approx(0.3)
  assert bool(jnp.all(jnp.isneginf(lse.ravel()[1:])))

  def loss(outs, lses):
    o, l = merge_partials(outs, lses, axis=0)
    return jnp.sum(o * 1.7) + jnp.sum(jnp.where(jnp.isfinite(l), l, 0.0))

  g_out, g_lse = jax.jit(jax.grad(loss, argnums=(0, 1)))(outs, lses)
  assert bool(jnp.all(jnp.isfinite(g_out))) and bool(jnp.all(jnp.isfinite(g_lse)))
  # Only the one live partial gets gradient: d out / d out_live = 1, d lse / d lse_live = 1.
  np.testing.assert_allclose(np.asarray(g_out[1, 0, 0]), 1.7, rtol=1e-6)
  assert float(g_lse[1, 0, 0]) == pytest.approx(1.0)
  assert float(jnp.abs(g_out).sum()) == pytest.approx(1.7 * 8, rel=1e-6)


def test_empty_partials_ignore_garbage_and_two_input_matches_partials():
  o1, o2, l1, l2 = normal(4, (3, 6, 16), (3, 6, 16), (3, 6), (3, 6))
  l1, l2 = l1 * 3, l2 * 3
  l2 = l2.at[0].set(-jnp.inf)
  o2 = o2.at[0].set(jnp.nan)                         # never read where lse is -inf
  out, lse = merge(o1, l1, o2, l2)
  out_p, lse_p = merge_partials(jnp.stack([o1, o2], -2), jnp.stack([l1, l2], -1), axis=-1)
  assert not bool(jnp.any(jnp.isnan(out)))
  np.testing.assert_allclose(np.asarray(out[0]), np.asarray(o1[0]), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(out), np.asarray(out_p), rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_p), rtol=1e-6)
  w1 = jax.nn.sigmoid(l1[1:] - l2[1:])[..., None]
  np.testing.assert_allclose(np.asarray(out[1:]), np.asarray(w1 * o1[1:] + (1 - w1) * o2[1:]),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(lse[1:]), np.asarray(jnp.logaddexp(l1[1:], l2[1:])),
                             rtol=1e-6)


def test_merge_dtype_and_errors():
  o = jnp.ones((2, 3, 8), jnp.bfloat16)
  out, lse = merge_partials(o, jnp.zeros((2, 3)), axis=0)
  assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
  with pytest.raises(ValueError, match="lses.shape"):
    merge_partials(jnp.ones((2, 3, 8)), jnp.zeros((2, 4)))
  with pytest.raises(ValueError, match="axis"):
    merge_partials(jnp.ones((2, 3, 8)), jnp.zeros((2, 3)), axis=2)
  with pytest.raises(ValueError, match="equal shapes"):
    merge(jnp.ones((2, 8)), jnp.zeros(2), jnp.ones((3, 8)), jnp.zeros(3))


def test_merge_zero_size_and_0d_inputs():
  with pytest.raises(ValueError, match=r"axis 0 \(the partials\) must have length >= 1"):
    merge_partials(jnp.zeros((0, 3, 4)), jnp.zeros((0, 3)))
  with pytest.raises(ValueError, match="axis -1"):
    merge_partials(jnp.zeros((3, 0, 4)), jnp.zeros((3, 0)), axis=-1)
  with pytest.raises(ValueError, match="lses"):
    merge_partials(jnp.ones((4,)), jnp.array(0.0))
  out, lse = merge_partials(jnp.zeros((2, 0, 4)), jnp.zeros((2, 0)))   # no heads: empty results
  assert out.shape == (0, 4) and lse.shape == (0,)
  out, lse = merge_partials(jnp.ones((1, 4)), jnp.zeros((1,)))         # one partial: itself
  assert out.tolist() == [1.0] * 4 and float(lse) == 0.0
