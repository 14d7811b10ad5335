"""Head-major contiguous caches for dense decode (``decode_attention(..., kv_layout="hnd")``:
k/v [batch, kv_heads, max_len, head_dim]).

Every implementation runs "hnd" as the free reshape to batch * kv_heads sequences of one kv
head (``jattn._layout``, shared with sparse decode), so the checks are: "hnd" on the transposed
cache == "nhd" (out and lse) and == the fp32 reference, for "xla", "triton" (interpreted) and
"mosaic_tpu" (the TPU interpreter), with ragged lengths (0, 1, partial blocks), GQA 4 and 1, a
window and a soft cap, values narrower than keys; the default split count of "hnd" is the
"nhd" one (H200 core count) and the call lowers for CUDA / TPU at the bench shape; bad layouts
and shapes raise. The GPU test (``-m gpu``) compares the compiled Triton kernels.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import decode as dec
from jattn import sparse as sp
from pallas_kernels import compat
from pallas_kernels.decode import reference as dref
from test_sparse import _kernel_module_or_skip
from test_sparse_decode_layout import _hnd, _rel


_FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0,
                     "xla_llvm_disable_expensive_passes": True}


def _inputs(seed, b, n, hq, hk, d, dv, dtype=jnp.float32):
  """q [b, hq, d], k [b, n, hk, d], v [b, n, hk, dv] ("nhd"; numpy's generator)."""
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal(s, np.float32)).astype(dtype)
               for s in ((b, hq, d), (b, n, hk, d), (b, n, hk, dv)))


def _both_layouts(q, k, v, lens, **kw):
  """(nhd (out, lse), hnd (out, lse), fp32 reference (out, lse)) from one jitted program (one
  CPU compile)."""
  call = functools.partial(dec.decode_attention, return_lse=True, **kw)
  ref_kw = dict(local_window_size=kw.get("local_window_size"),
                logits_soft_cap=kw.get("logits_soft_cap"))
  up = lambda x: x.astype(jnp.float32)
  fn = jax.jit(lambda q, k, v, kh, vh, lens: (
      call(q, k, v, lens), call(q, kh, vh, lens, kv_layout="hnd"),
      dref.decode_reference(up(q), up(k), up(v), lens, upcast=True, **ref_kw)))
  args = (q, k, v, _hnd(k), _hnd(v), lens)
  return fn.lower(*args).compile(_FAST_CPU_COMPILE)(*args)


def _check(nhd, hnd, ref, lens, tol, exact_tol=1e-6):
  (out, lse), (out_h, lse_h), (r_out, r_lse) = nhd, hnd, ref
  assert out_h.shape == out.shape == r_out.shape and out_h.dtype == out.dtype
  assert lse_h.shape == lse.shape == r_lse.shape
  np.testing.assert_allclose(np.asarray(out_h, np.float32), np.asarray(out, np.float32),
                             rtol=exact_tol, atol=exact_tol)
  np.testing.assert_allclose(np.asarray(lse_h), np.asarray(lse), rtol=exact_tol, atol=exact_tol)
  assert _rel(out_h, r_out) < tol, _rel(out_h, r_out)
  empty = np.asarray(lens) == 0
  assert (np.asarray(out_h, np.float32)[empty] == 0).all()
  assert np.isneginf(np.asarray(lse_h)[empty]).all()
  np.testing.assert_allclose(np.asarray(lse_h)[~empty], np.asarray(r_lse)[~empty], rtol=tol,
                             atol=tol)


# ------------------------------------------------------------------------------ CPU

# (b, n, hq, hk, d, dv, lengths, window, cap, splits, block_k, dtype)
CASES = {
    # GQA 4, values narrower than keys, lengths 0 / 1 / mid-block / full, window + soft cap.
    "gqa4_dv_window_cap": (4, 100, 8, 2, 48, 32, [100, 0, 1, 45], (30, 0), 5.0, 3, 16,
                           jnp.float32),
    # MHA (GQA 1), bf16, lengths 1 / 0 / ragged, no window.
    "mha_bf16": (3, 64, 2, 2, 32, 32, [1, 0, 50], None, None, 2, 16, jnp.bfloat16),
}


def _impl_params():
  out = [pytest.param(impl, name, id=f"{impl}-{name}") for impl in ("xla", "triton")
         for name in CASES]
  return out + [pytest.param("mosaic_tpu", "gqa4_dv_window_cap",
                             id="mosaic_tpu-gqa4_dv_window_cap")]


@pytest.mark.parametrize("impl,name", _impl_params())
def test_hnd_equals_nhd_on_transposed_cache(impl, name):
  """Same outputs and lse as "nhd" on the transposed cache (same programs, same splits), and
  the fp32 reference; empty rows give 0 and -inf."""
  b, n, hq, hk, d, dv, lengths, window, cap, splits, block_k, dtype = CASES[name]
  kw = dict(local_window_size=window, logits_soft_cap=cap, implementation=impl, interpret=True)
  if impl != "xla":
    _kernel_module_or_skip(impl)
    mod = dec._kernel_module(impl)
    kw.update(num_splits=splits, block_sizes=mod.DecodeBlockSizes(block_k=block_k))
  q, k, v = _inputs(sum(map(ord, name)), b, n, hq, hk, d, dv, dtype)
  lens = jnp.asarray(lengths, jnp.int32)
  nhd, hnd, ref = _both_layouts(q, k, v, lens, **kw)
  assert hnd[0].shape == (b, hq, dv)
  tol = 2e-3 if dtype == jnp.float32 else 2e-2
  _check(nhd, hnd, ref, lens, tol)


def test_hnd_default_splits_equal_nhd(monkeypatch):
  """B1 S128K GQA 32:8 D128 bf16 on a 132-SM H200: "hnd" (8 sequences of one kv head inside)
  gets the split count "nhd" gets (asked for at (batch 1, kv_heads 8): one wave, 16), not the
  heuristic's answer for 8 sequences (32); the call lowers for CUDA with the documented output
  shapes."""
  monkeypatch.setattr(compat, "gpu_core_count", lambda: 132)
  b, n, hq, hk, d, dt = 1, 131072, 32, 8, 128, jnp.bfloat16
  default = functools.partial(dec.default_num_splits, "triton", head_dim=d, dtype=dt)
  assert (default(b, hk, n), default(b * hk, 1, n)) == (16, 32)
  seen = []
  real = dec._decode_jit

  def spy(*args, **kw):
    seen.append(kw["config"].num_splits)
    return real(*args, **kw)
  monkeypatch.setattr(dec, "_decode_jit", spy)
  sds = jax.ShapeDtypeStruct
  for kv in ((b, n, hk, d), (b, hk, n, d)):
    layout = "nhd" if kv[1] == n else "hnd"
    fn = jax.jit(lambda q, k, v, lens, layout=layout: dec.decode_attention(
        q, k, v, lens, return_lse=True, implementation="triton", kv_layout=layout))
    lowered = fn.trace(sds((b, hq, d), dt), sds(kv, dt), sds(kv, dt),
                       sds((b,), jnp.int32)).lower(lowering_platforms=("cuda",))
    assert [a.shape for a in lowered.out_info] == [(b, hq, d), (b, hq)]
  assert seen[0] == seen[-1] == default(b, hk, n), seen


def test_hnd_mosaic_tpu_lowers_for_tpu():
  """The bench shape (B1 S128K GQA 32:8 D128 bf16) on a head-major cache lowers for TPU."""
  _kernel_module_or_skip("mosaic_tpu")
  sds = jax.ShapeDtypeStruct
  f = functools.partial(dec.decode_attention, return_lse=True, implementation="mosaic_tpu",
                        kv_layout="hnd")
  kv = sds((1, 8, 131072, 128), jnp.bfloat16)
  exp = jax.export.export(jax.jit(f), platforms=["tpu"])(
      sds((1, 32, 128), jnp.bfloat16), kv, kv, sds((1,), jnp.int32))
  assert "tpu_custom_call" in exp.mlir_module()
  assert [a.shape for a in exp.out_avals] == [(1, 32, 128), (1, 32)]


def test_layout_errors():
  b, n, hq, hk, d = 2, 32, 4, 2, 16
  q, k, v = _inputs(3, b, n, hq, hk, d, d)
  kh, vh = _hnd(k), _hnd(v)
  lens = jnp.array([3, 4], jnp.int32)
  call = functools.partial(dec.decode_attention, implementation="xla")
  for bad in ("bhsd", "NHD", None):
    with pytest.raises(ValueError, match="kv_layout must be"):
      call(q, k, v, lens, kv_layout=bad)
  hnd = functools.partial(call, kv_layout="hnd")
  # an "nhd" cache passed as "hnd": 32 "kv heads" do not divide 4 query heads
  with pytest.raises(ValueError, match="does not match the head-major cache"):
    hnd(q, k, v, lens)
  with pytest.raises(ValueError, match="does not match the head-major cache"):
    hnd(q[..., :8], kh, vh, lens)                                  # head_dim differs
  with pytest.raises(ValueError, match="q batch"):
    hnd(q[:1], kh, vh, lens)
  with pytest.raises(ValueError, match=r"k/v must be \[batch, kv_heads, len, d\]"):
    hnd(q, kh, vh[:, :, :16], lens)                                # lengths differ
  with pytest.raises(ValueError, match=r"k/v must be \[batch, kv_heads, len, d\]"):
    hnd(q, kh[0], vh[0], lens)
  with pytest.raises(ValueError, match="q must be"):
    hnd(q[:, None], kh, vh, lens)
  with pytest.raises(ValueError, match="kv_lengths must have shape"):
    hnd(q, kh, vh, jnp.array([3, 4, 5, 6], jnp.int32))             # batch * kv_heads: no
  with pytest.raises(TypeError, match="kv_lengths"):
    hnd(q, kh, vh, jnp.array([3.0, 4.0]))
  with pytest.raises(TypeError, match="dtypes differ"):
    hnd(q, kh, vh.astype(jnp.bfloat16), lens)
  with pytest.raises(TypeError, match="floating"):
    hnd(q, kh.astype(jnp.int32), vh.astype(jnp.int32), lens)
  # head-major pages [num_pages, kv_heads, page_size, d]: the same checks on the pool
  with pytest.raises(ValueError, match=r"kv_heads \(16\)"):   # an "nhd" pool read as "hnd"
    dec.paged_decode_attention(q, k.reshape(4, 16, hk, d), v.reshape(4, 16, hk, d),
                               jnp.array([[0, 1], [2, 3]], jnp.int32), lens,
                               implementation="xla", kv_layout="hnd")


# ------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_gpu_hnd_equals_nhd():
  """The compiled kernels on a head-major bf16 cache (B3, 8K, GQA 32:8, D128, lengths 8192 / 0
  / 3001, default splits): the "nhd" call's outputs and lse within rounding, and the fp32
  reference."""
  b, n, hq, hk, d = 3, 8192, 32, 8, 128
  q, k, v = _inputs(45, b, n, hq, hk, d, d, jnp.bfloat16)
  lens = jnp.array([8192, 0, 3001], jnp.int32)
  run = lambda *a, **x: jax.jit(functools.partial(
      dec.decode_attention, return_lse=True, implementation="triton", **x))(*a)
  out, lse = run(q, k, v, lens)
  out_h, lse_h = run(q, _hnd(k), _hnd(v), lens, kv_layout="hnd")
  assert out_h.shape == (b, hq, d) and lse_h.shape == (b, hq)
  assert _rel(out_h, out) < 1e-2, _rel(out_h, out)
  np.testing.assert_array_equal(np.isneginf(np.asarray(lse_h)), np.isneginf(np.asarray(lse)))
  fin = np.isfinite(np.asarray(lse))
  np.testing.assert_allclose(np.asarray(lse_h)[fin], np.asarray(lse)[fin], rtol=1e-3, atol=1e-3)
  up = lambda x: x.astype(jnp.float32)
  r_out, _ = jax.jit(functools.partial(dref.decode_reference, upcast=True))(
      up(q), up(k), up(v), lens)
  assert _rel(out_h, r_out) < 2e-2


@pytest.mark.parametrize("kw", [dict(implementation="xla"),
                                dict(implementation="triton", interpret=True, num_splits=2),
                                dict(implementation="mosaic_tpu", interpret=True)],
                         ids=lambda kw: kw["implementation"])
def test_paged_hnd_equals_nhd(kw):
  """Head-major pages [num_pages, kv_heads, page_size, d] (the pool of one-head pages p * hk + h)
  give the "nhd" result on the transposed pool, dense and sparse (ragged lengths 0, partial,
  full; shuffled pages; GQA 2; values narrower than keys)."""
  b, hq, hk, d, dv, ps, mp = 3, 4, 2, 128, 64, 16, 4
  rng = np.random.default_rng(7)
  q = jnp.asarray(rng.standard_normal((b, hq, d), np.float32))
  kp = jnp.asarray(rng.standard_normal((b * mp + 1, ps, hk, d), np.float32))
  vp = jnp.asarray(rng.standard_normal((b * mp + 1, ps, hk, dv), np.float32))
  table = jnp.asarray(rng.permutation(b * mp + 1)[:b * mp].reshape(b, mp), jnp.int32)
  lens = jnp.array([0, 37, 64], jnp.int32)
  kh, vh = jnp.swapaxes(kp, 1, 2), jnp.swapaxes(vp, 1, 2)     # [pages, hk, ps, d]
  dense = jax.jit(functools.partial(jattn.paged_decode_attention, return_lse=True, **kw),
                  static_argnames="kv_layout")
  for x, y in zip(dense(q, kh, vh, table, lens, kv_layout="hnd"), dense(q, kp, vp, table, lens)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)
  if kw["implementation"] == "mosaic_tpu":
    return
  s_n = sp.init_block_summaries(kp, lens, block_size=ps, page_table=table)
  s_h = sp.init_block_summaries(kh, lens, block_size=ps, page_table=table, kv_layout="hnd")
  np.testing.assert_allclose(np.asarray(s_h.sums), np.asarray(jnp.swapaxes(s_n.sums, 1, 2)),
                             rtol=1e-6, atol=1e-6)
  sparse = jax.jit(functools.partial(jattn.sparse_paged_decode_attention, top_k=1,
                                     return_indices=True, **kw), static_argnames="kv_layout")
  (o_h, i_h), (o_n, i_n) = (sparse(q, kh, vh, table, lens, s_h, kv_layout="hnd"),
                            sparse(q, kp, vp, table, lens, s_n))
  np.testing.assert_array_equal(np.asarray(i_h), np.asarray(i_n))
  np.testing.assert_allclose(np.asarray(o_h), np.asarray(o_n), rtol=1e-5, atol=1e-5)
  grown = jnp.minimum(lens + 1, mp * ps)
  u_h = sp.update_block_summaries(s_h, kh, grown, page_table=table)
  u_n = sp.update_block_summaries(s_n, kp, grown, page_table=table)
  np.testing.assert_allclose(np.asarray(u_h.sums), np.asarray(jnp.swapaxes(u_n.sums, 1, 2)),
                             rtol=1e-6, atol=1e-6)
