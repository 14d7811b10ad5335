"""Mosaic TPU flash attention, kernel-specific: non-default tiles, block-mask schedules (tiles
outside them are never read), tile validation, and lowering for TPU with ``jax.export``.

Masks, dtypes, head dims and GQA through ``jattn.flash_attention`` (default tiles) are in
test_conformance.py. The kernels run in TPU interpret mode on the CPU.
"""
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.block_schedule import make_schedule
from pallas_kernels.flash import mosaic_tpu
from pallas_kernels.flash.reference import attention_reference
from tests.helpers import rel_err as _rel

TOL_FP32 = 2e-3
BLOCKS = mosaic_tpu.BlockSizes(block_q=128, block_k=128)


def _run_both(q, k, v, *, causal=False, window=None, q_seg=None, kv_seg=None, soft_cap=None,
              block_mask=None, elem_block_mask=None, blocks=BLOCKS, seed=0):
  """Forward + VJP (random cotangents for out and lse) of the kernel and of the reference."""
  b, sq, hq, _ = q.shape
  sk = k.shape[1]

  def kern(q, k, v):
    # Built inside the jitted function, as jattn does (eager jnp ops would compile one by one).
    sched = make_schedule(sq, sk, blocks.block_q, blocks.block_k, causal=causal,
                          local_window_size=window, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                          block_mask=block_mask)
    return mosaic_tpu.flash_attention(q, k, v, q_seg, kv_seg, sched, causal=causal,
                                      local_window_size=window, scale=None,
                                      logits_soft_cap=soft_cap, interpret=True)

  def ref(q, k, v):
    return attention_reference(q, k, v, causal=causal, local_window_size=window,
                               q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                               logits_soft_cap=soft_cap, block_mask=elem_block_mask)

  rng = np.random.default_rng(seed + 1000)
  dout = jnp.asarray(rng.standard_normal(q.shape[:3] + v.shape[3:]), q.dtype)
  dlse = jnp.asarray(rng.standard_normal((b, hq, sq)), jnp.float32)
  return _fwd_vjp(kern, q, k, v, dout, dlse), _fwd_vjp(ref, q, k, v, dout, dlse)


def _fwd_vjp(f, q, k, v, dout, dlse):
  """(out, lse, (dq, dk, dv)) of f under one jit (one compilation: interpret mode compiles slowly)."""
  @jax.jit
  def run(q, k, v, dout, dlse):
    (out, lse), vjp = jax.vjp(f, q, k, v)
    return out, lse, vjp((dout, dlse))
  return run(q, k, v, dout, dlse)


def _check(got, want, tol=TOL_FP32):
  out, lse, grads = got
  rout, rlse, rgrads = want
  for x in (out, lse, *grads):
    assert not np.any(np.isnan(np.asarray(x))), "NaN in kernel result"
  assert _rel(out, rout) < tol, _rel(out, rout)
  lse, rlse = np.asarray(lse), np.asarray(rlse)
  np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(rlse))
  assert np.all(np.isneginf(lse[~np.isfinite(lse)]))
  fin = np.isfinite(rlse)
  assert _rel(lse[fin], rlse[fin]) < tol, _rel(lse[fin], rlse[fin])
  for name, g, rg in zip(("dq", "dk", "dv"), grads, rgrads):
    assert g.shape == rg.shape and g.dtype == rg.dtype, (name, g.shape, rg.shape)
    assert _rel(g, rg) < tol, (name, _rel(g, rg))


def _qkv(seed, b, sq, sk, hq, hk, d, dv=None, dtype=jnp.float32):
  rng = np.random.default_rng(seed)  # numpy: jax.random would compile once per shape
  q = jnp.asarray(rng.standard_normal((b, sq, hq, d)), dtype)
  k = jnp.asarray(rng.standard_normal((b, sk, hk, d)), dtype)
  v = jnp.asarray(rng.standard_normal((b, sk, hk, dv or d)), dtype)
  return q, k, v


# (name, b, sq, sk, hq, hk, d, options); non-square tiles catch block_q/block_k mix-ups.
CASES = [
    ("window_softcap_mqa_tiles128x256", 1, 300, 300, 3, 1, 96,
     dict(window=(100, 30), soft_cap=5.0, blocks=mosaic_tpu.BlockSizes(128, 256))),
    ("causal_window_qlen_gt_kvlen_tiles256x128", 1, 270, 140, 2, 2, 32,
     dict(causal=True, window=(60, 0), blocks=mosaic_tpu.BlockSizes(256, 128))),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_non_default_tiles_match_reference(case):
  name, b, sq, sk, hq, hk, d, opts = case
  q, k, v = _qkv(zlib.crc32(name.encode()) % 1000, b, sq, sk, hq, hk, d)
  got, want = _run_both(q, k, v, **opts)
  _check(got, want)


def _expand_block_mask(bm, sq, sk):
  """Tile mask [Bs, Hs, nq, nk] -> element mask [Bs, Hs, sq, sk]."""
  bm = np.repeat(np.repeat(np.asarray(bm), BLOCKS.block_q, axis=2), BLOCKS.block_k, axis=3)
  return jnp.asarray(bm[:, :, :sq, :sk])


def test_random_block_mask_schedule_gqa():
  b, sq, sk, hq, hk = 2, 300, 380, 4, 2
  nq, nk = -(-sq // 128), -(-sk // 128)
  rng = np.random.default_rng(5)
  bm = rng.random((b, hk, nq, nk)) < 0.5
  bm[0, 0, 1, :] = False              # a query tile with nothing to visit
  q, k, v = _qkv(6, b, sq, sk, hq, hk, 64)
  got, want = _run_both(q, k, v, causal=True, block_mask=jnp.asarray(bm),
                        elem_block_mask=_expand_block_mask(bm, sq, sk))
  _check(got, want)


def test_nan_in_skipped_tiles_never_reaches_results():
  """Tiles outside the schedule hold NaN; results must equal the reference on finite data."""
  b, s, h, d = 1, 384, 2, 64
  bm = np.array([[[[1, 0, 1], [1, 0, 1], [0, 0, 0]]]], bool)  # kv tile 1 and q tile 2 unused
  q, k, v = _qkv(7, b, s, s, h, h, d)
  nan_k = k.at[:, 128:256].set(jnp.nan)
  nan_v = v.at[:, 128:256].set(jnp.nan)
  nan_q = q.at[:, 256:].set(jnp.nan)

  def kern(q, k, v):
    sched = make_schedule(s, s, 128, 128, block_mask=jnp.asarray(bm))
    return mosaic_tpu.flash_attention(q, k, v, None, None, sched, causal=False,
                                      local_window_size=None, scale=None, logits_soft_cap=None,
                                      interpret=True)

  def ref(q, k, v):
    return attention_reference(q, k, v, block_mask=_expand_block_mask(bm, s, s))

  rng = np.random.default_rng(8)
  dout = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  dlse = jnp.asarray(rng.standard_normal((b, h, s)), jnp.float32)
  got = _fwd_vjp(kern, nan_q, nan_k, nan_v, dout, dlse)
  _check(got, _fwd_vjp(ref, q, k, v, dout, dlse))
  out, _, (dq, dk, dv) = got
  assert np.all(np.asarray(out)[:, 256:] == 0.0) and np.all(np.asarray(dq)[:, 256:] == 0.0)
  assert np.all(np.asarray(dk)[:, 128:256] == 0.0) and np.all(np.asarray(dv)[:, 128:256] == 0.0)


def test_default_block_sizes_and_validation():
  for d in (32, 72, 96, 128, 256):
    for dt in (jnp.float32, jnp.bfloat16, jnp.float16):
      bs = mosaic_tpu.default_block_sizes(d, dt)
      assert bs.block_q % 128 == 0 and bs.block_k % 128 == 0
  with pytest.raises(ValueError, match="multiple of 128"):
    mosaic_tpu.BlockSizes(block_q=64, block_k=128)
  q, k, v = _qkv(10, 1, 64, 64, 3, 2, 32)
  sched = make_schedule(64, 64, 128, 128)
  kw = dict(causal=False, local_window_size=None, scale=None, logits_soft_cap=None)
  with pytest.raises(ValueError, match="multiple of kv_heads"):
    mosaic_tpu.flash_attention(q, k, v, None, None, sched, **kw)
  q, k, v = _qkv(10, 1, 64, 64, 2, 2, 32)
  with pytest.raises(ValueError, match="q_segment_ids must be"):
    seg = jnp.ones((1, 63), jnp.int32)
    mosaic_tpu.flash_attention(q, k, v, seg, jnp.ones((1, 64), jnp.int32), sched, **kw)
  with pytest.raises(ValueError, match="schedule is for"):
    mosaic_tpu.flash_attention(q, k, v, None, None, make_schedule(65, 64, 128, 128), **kw)
  with pytest.raises(ValueError, match="multiple of 128"):
    mosaic_tpu.flash_attention(q, k, v, None, None, make_schedule(64, 64, 64, 128), **kw)


@pytest.mark.parametrize("dtype,d,segmented", [(jnp.bfloat16, 128, True),
                                               (jnp.float32, 72, False),
                                               (jnp.float16, 256, False)])
def test_lowers_for_tpu(dtype, d, segmented):
  """Forward and VJP lower to Mosaic TPU custom calls (jax.export for platform "tpu")."""
  b, s, hq, hk = 2, 1000, 4, 2
  bs = mosaic_tpu.default_block_sizes(d, dtype)
  q = jax.ShapeDtypeStruct((b, s, hq, d), dtype)
  kv = jax.ShapeDtypeStruct((b, s, hk, d), dtype)
  seg = jax.ShapeDtypeStruct((b, s), jnp.int32)
  lse = jax.ShapeDtypeStruct((b, hq, s), jnp.float32)

  def fwd(q, k, v, qs, ks):
    if not segmented:
      qs = ks = None
    sched = make_schedule(s, s, bs.block_q, bs.block_k, causal=True, q_segment_ids=qs,
                          kv_segment_ids=ks)
    return mosaic_tpu.flash_attention(q, k, v, qs, ks, sched, causal=True,
                                      local_window_size=None, scale=None,
                                      logits_soft_cap=None if segmented else 30.0)

  def fwd_bwd(q, k, v, qs, ks, dout, dlse):
    _, vjp = jax.vjp(lambda q, k, v: fwd(q, k, v, qs, ks), q, k, v)
    return vjp((dout, dlse))

  exp = jax.export.export(jax.jit(fwd), platforms=["tpu"])(q, kv, kv, seg, seg)
  assert exp.mlir_module().count("tpu_custom_call") == 1
  exp = jax.export.export(jax.jit(fwd_bwd), platforms=["tpu"])(q, kv, kv, seg, seg, q, lse)
  assert exp.mlir_module().count("tpu_custom_call") == 3  # forward (residuals), dQ, dK/dV
