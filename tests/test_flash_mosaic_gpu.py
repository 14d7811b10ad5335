"""Mosaic GPU (Hopper) flash attention forward: what can be checked without a GPU, and GPU tests.

On the CPU nothing here runs the kernel: jax's Mosaic GPU interpret mode cannot execute it (its
wgmma takes neither a transposed K nor P from registers). The CPU tests check
  * that the kernel lowers for "cuda" (``jax.export``: the whole Pallas -> Mosaic GPU lowering in
    Python, register layouts, wgmma/TMA constraints, the shared-memory budget);
  * the tile walk: for every program and warpgroup, the kv tiles it skips are fully masked, the
    tiles it runs without a mask are fully visible, and the memory warpgroup loads exactly the
    tiles that the compute warpgroups need;
  * a jnp replay of the kernel's walk (same programs, warpgroup rows, kv ranges, full/masked split
    and the kernel's own mask, online-softmax and finalize helpers, P cast to the input dtype)
    against the fp32 reference, including padded lengths, bottom-right causal alignment and rows
    that see no key.
Tests marked ``gpu`` run the compiled kernel on an sm90 GPU against the reference.
"""
from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from pallas_kernels import compat
from pallas_kernels.flash import mosaic_gpu as mg
from pallas_kernels.flash.reference import attention_reference

TOL = {jnp.bfloat16: 2e-2, jnp.float16: 2e-2}
# Options for compiling the CPU replay only (how XLA:CPU optimises the test harness).
_FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _rel(a, b):
  a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _check(out, lse, q, k, v, causal, dtype):
  ref = jax.jit(functools.partial(attention_reference, causal=causal))
  r_out, r_lse = ref.lower(q, k, v).compile(_FAST_CPU_COMPILE)(q, k, v)
  tol = TOL[dtype]
  assert out.shape == r_out.shape and out.dtype == q.dtype
  assert _rel(out, r_out) < tol, _rel(out, r_out)
  lse, r_lse = np.asarray(lse), np.asarray(r_lse)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(r_lse))
  fin = np.isfinite(r_lse)
  assert np.isfinite(lse[fin]).all()
  assert _rel(np.where(fin, lse, 0.0), np.where(fin, r_lse, 0.0)) < tol
  if (~fin).any():   # rows that see no key: output exactly 0
    rows = np.asarray(out, np.float32).transpose(0, 2, 1, 3)[~fin]
    assert (rows == 0).all()


def _inputs(seed, b, sq, sk, hq, hk, d, dtype):
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (b, sq, hq, d), dtype)
  k = jax.random.normal(ks[1], (b, sk, hk, d), dtype)
  v = jax.random.normal(ks[2], (b, sk, hk, d), dtype)
  return q, k, v


# -------------------------------------------------------------------------------- lowering (CPU)

LOWER_CASES = {
    "d64": dict(sq=256, sk=256, hq=2, hk=2, d=64, causal=False),
    "d128_causal_gqa": dict(sq=512, sk=512, hq=4, hk=2, d=128, causal=True),
    "d256_causal_ragged": dict(sq=200, sk=300, hq=2, hk=1, d=256, causal=True),
    "d128_fp16_q_longer": dict(sq=384, sk=130, hq=2, hk=1, d=128, causal=True,
                               dtype=jnp.float16),
    "d128_no_pingpong": dict(sq=256, sk=256, hq=2, hk=2, d=128, causal=False,
                             bs=mg.BlockSizes(64, 128, 2, pingpong=False)),
    "d64_3_stages": dict(sq=256, sk=256, hq=2, hk=2, d=64, causal=True,
                         bs=mg.BlockSizes(64, 128, 3)),
}


@pytest.mark.parametrize("name", list(LOWER_CASES))
def test_lowers_for_cuda(name):
  case = dict(LOWER_CASES[name])
  dtype = case.pop("dtype", jnp.bfloat16)
  bs = case.pop("bs", None)
  sq, sk, hq, hk, d = (case[n] for n in ("sq", "sk", "hq", "hk", "d"))
  q = jax.ShapeDtypeStruct((2, sq, hq, d), dtype)
  kv = jax.ShapeDtypeStruct((2, sk, hk, d), dtype)
  fn = jax.jit(lambda q, k, v: mg.flash_attention(q, k, v, causal=case["causal"],
                                                  block_sizes=bs))
  exported = jax.export.export(fn, platforms=["cuda"])(q, kv, kv)
  text = exported.mlir_module()
  assert "mosaic_gpu" in text and "wgmma" in text
  assert [a.shape for a in exported.out_avals] == [(2, sq, hq, d), (2, hq, sq)]


def test_shared_memory_overflow_fails_to_lower():
  """The lowering checks the shared-memory budget (so the lowering test can fail): 3 stages of
  128-key tiles at D128 need ~227 KiB plus barriers, over the limit."""
  q = jax.ShapeDtypeStruct((1, 256, 1, 128), jnp.bfloat16)
  fn = jax.jit(lambda q: mg.flash_attention(q, q, q, block_sizes=mg.BlockSizes(64, 128, 3)))
  with pytest.raises(ValueError, match="shared memory"):
    jax.export.export(fn, platforms=["cuda"])(q)


# ---------------------------------------------------------------------------- tile walk (CPU)


@pytest.mark.parametrize("causal", [False, True])
def test_tile_walk_skips_only_masked_tiles(causal):
  for sq, sk in [(128, 128), (1000, 1000), (200, 300), (384, 130), (64, 1000), (1, 77)]:
    for bs in [mg.BlockSizes(64, 128, 2), mg.BlockSizes(64, 64, 2), mg.BlockSizes(128, 64, 2)]:
      st = mg._static_config((1, sq, 1, 128), (1, sk, 1, 128), jnp.bfloat16, causal=causal,
                             scale=None, block_sizes=bs)
      bq, bk = st.block_q, st.block_k
      rows = np.arange(bq)[:, None] * np.ones((1, bk), np.int32)
      cols = np.ones((bq, 1), np.int32) * np.arange(bk)[None, :]
      for prog in range(st.num_q_programs):
        row0_prog = prog * 2 * bq
        program_steps = int(mg._kv_steps(jnp.int32(row0_prog + 2 * bq), st))
        wg_steps = []
        for wg in range(2):
          row0 = row0_prog + wg * bq
          steps = int(mg._kv_steps(jnp.int32(row0 + bq), st))
          full = int(mg._full_steps(jnp.int32(row0), st))
          assert 0 <= full <= steps <= st.num_kv_tiles
          real = (np.arange(bq) + row0 < sq)[:, None]          # rows that are not padding
          for t in range(st.num_kv_tiles):
            vis = np.asarray(mg._tile_visible(rows, cols, row0, t, st))
            if t < full:
              assert vis.all(), (sq, sk, bs, prog, wg, t)        # no mask needed
            if t >= steps:
              assert not (vis & real).any(), (sq, sk, bs, prog, wg, t)   # safe to skip
          if steps:   # no wasted tile: the last one visited has a visible key for a real row
            vis = np.asarray(mg._tile_visible(rows, cols, row0, steps - 1, st))
            assert (vis & real).any() or row0 >= sq, (sq, sk, bs, prog, wg)
          wg_steps.append(steps)
        assert program_steps == max(wg_steps)   # the memory warpgroup loads exactly these


def _replay(q, k, v, *, causal, block_sizes=None):
  """Compile ``_replay_fn`` with cheap XLA:CPU codegen (it is unrolled and runs once)."""
  fn = jax.jit(functools.partial(_replay_fn, causal=causal, block_sizes=block_sizes))
  return fn.lower(q, k, v).compile(_FAST_CPU_COMPILE)(q, k, v)


def _replay_fn(q, k, v, *, causal, block_sizes=None):
  """The kernel's forward walk in jnp, with its own helpers (see the module docstring)."""
  b, sq, hq, d = q.shape
  sk, hk = k.shape[1], k.shape[2]
  st = mg._static_config(q.shape, k.shape, q.dtype, causal=causal, scale=None,
                         block_sizes=block_sizes)
  bq, bk = st.block_q, st.block_k
  sq_pad, sk_pad = st.num_q_programs * 2 * bq, st.num_kv_tiles * bk
  qp = jnp.pad(q, ((0, 0), (0, sq_pad - sq), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
  heads = jnp.arange(hq) // st.group                           # kv head of each query head
  kp = jnp.pad(k, ((0, 0), (0, sk_pad - sk), (0, 0), (0, 0)))[:, :, heads].transpose(0, 2, 1, 3)
  vp = jnp.pad(v, ((0, 0), (0, sk_pad - sk), (0, 0), (0, 0)))[:, :, heads].transpose(0, 2, 1, 3)
  rows = lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
  cols = lax.broadcasted_iota(jnp.int32, (bq, bk), 1)

  def warpgroup(q_t, k_all, v_all, row0):                   # [bq, D], [Sk', D], [Sk', D]
    def step(t, carry, *, masked):
      acc, m, l = carry
      k_t = lax.dynamic_slice_in_dim(k_all, t * bk, bk)        # [bk, D]
      v_t = lax.dynamic_slice_in_dim(v_all, t * bk, bk)
      s = jnp.dot(q_t, k_t.T, preferred_element_type=jnp.float32)        # [bq, bk]
      if masked:
        s = jnp.where(mg._tile_visible(rows, cols, row0, t, st), s, -jnp.inf)
      p, alpha, m, l = mg._online_softmax(s, m, l, st)
      acc = acc * alpha[:, None] + jnp.dot(p.astype(q.dtype), v_t,
                                           preferred_element_type=jnp.float32)
      return acc, m, l

    carry = (jnp.zeros((bq, d), jnp.float32), jnp.full((bq,), mg._M_INIT, jnp.float32),
             jnp.zeros((bq,), jnp.float32))
    steps, full = mg._kv_steps(row0 + bq, st), mg._full_steps(row0, st)
    carry = lax.fori_loop(0, full, functools.partial(step, masked=False), carry)
    acc, m, l = lax.fori_loop(full, steps, functools.partial(step, masked=True), carry)
    return mg._finalize(acc, m, l)

  n_rows = sq_pad // bq
  q_tiles = qp.reshape(b, hq, n_rows, bq, d)                   # [B, Hq, tiles, bq, D]
  row0s = jnp.arange(n_rows, dtype=jnp.int32) * bq
  per_tile = jax.vmap(warpgroup, in_axes=(0, None, None, 0))
  out, lse = jax.vmap(jax.vmap(per_tile))(q_tiles, kp, vp, jnp.broadcast_to(row0s, (b, hq, n_rows)))
  out = out.reshape(b, hq, sq_pad, d).transpose(0, 2, 1, 3)[:, :sq].astype(q.dtype)
  return out, lse.reshape(b, hq, sq_pad)[:, :, :sq]


REPLAY_CASES = {
    "dense_ragged_gqa": dict(b=1, sq=200, sk=300, hq=4, hk=2, d=64, causal=False),
    "causal_square": dict(b=2, sq=256, sk=256, hq=2, hk=1, d=64, causal=True),
    "causal_q_shorter": dict(b=1, sq=100, sk=333, hq=2, hk=2, d=64, causal=True),
    "causal_q_longer_empty_rows": dict(b=1, sq=300, sk=130, hq=2, hk=1, d=64, causal=True),
    "fp16_tiles_64": dict(b=1, sq=160, sk=200, hq=2, hk=2, d=64, causal=True,
                          dtype=jnp.float16, bs=mg.BlockSizes(64, 64, 2)),
}


@pytest.mark.parametrize("name", list(REPLAY_CASES))
def test_replayed_walk_matches_reference(name):
  case = dict(REPLAY_CASES[name])
  dtype = case.pop("dtype", jnp.bfloat16)
  bs = case.pop("bs", None)
  causal = case.pop("causal")
  q, k, v = _inputs(zlib.crc32(name.encode()), dtype=dtype, **case)
  out, lse = _replay(q, k, v, causal=causal, block_sizes=bs)
  _check(out, lse, q, k, v, causal, dtype)


# -------------------------------------------------------------------------- errors (CPU)


def test_unsupported_options_raise():
  q = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
  seg = jnp.ones((1, 128), jnp.int32)
  for kwargs in (dict(q_segment_ids=seg, kv_segment_ids=seg), dict(local_window_size=(63, 0)),
                 dict(logits_soft_cap=30.0), dict(interpret=True)):
    with pytest.raises(NotImplementedError):
      mg.flash_attention(q, q, q, **kwargs)
  with pytest.raises(NotImplementedError, match="float32"):
    mg.flash_attention(q.astype(jnp.float32), q.astype(jnp.float32), q.astype(jnp.float32))
  q96 = jnp.ones((1, 128, 2, 96), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="head_dim"):
    mg.flash_attention(q96, q96, q96)


def test_backward_raises():
  q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)
  loss = lambda q, k, v: mg.flash_attention(q, k, v)[0].astype(jnp.float32).sum()
  with pytest.raises(NotImplementedError, match="backward"):
    jax.export.export(jax.jit(jax.grad(loss)), platforms=["cuda"])(q, q, q)


# ----------------------------------------------------------------------------- GPU (sm90)

GPU_CASES = {
    "d64": dict(b=2, sq=1024, sk=1024, hq=4, hk=4, d=64, causal=False),
    "d64_causal": dict(b=2, sq=1024, sk=1024, hq=4, hk=4, d=64, causal=True),
    "d128": dict(b=2, sq=2048, sk=2048, hq=4, hk=4, d=128, causal=False),
    "d128_causal_gqa": dict(b=2, sq=2048, sk=2048, hq=8, hk=2, d=128, causal=True),
    "d128_ragged": dict(b=1, sq=1000, sk=1000, hq=2, hk=1, d=128, causal=True),
    "d128_q_shorter": dict(b=1, sq=300, sk=1111, hq=2, hk=2, d=128, causal=True),
    "d128_q_longer_empty_rows": dict(b=1, sq=700, sk=260, hq=2, hk=2, d=128, causal=True),
    "d128_fp16": dict(b=1, sq=1024, sk=1024, hq=2, hk=2, d=128, causal=True, dtype=jnp.float16),
    "d128_no_pingpong": dict(b=1, sq=1024, sk=1024, hq=2, hk=2, d=128, causal=True,
                             bs=mg.BlockSizes(64, 128, 2, pingpong=False)),
    "d256": dict(b=1, sq=1024, sk=1024, hq=2, hk=2, d=256, causal=False),
    "d256_causal": dict(b=1, sq=1024, sk=1024, hq=2, hk=1, d=256, causal=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_matches_reference(name):
  if compat.gpu_compute_capability() != (9, 0):
    pytest.skip(f"needs sm90 (Hopper), got {compat.gpu_compute_capability()}")
  case = dict(GPU_CASES[name])
  dtype = case.pop("dtype", jnp.bfloat16)
  bs = case.pop("bs", None)
  causal = case.pop("causal")
  q, k, v = _inputs(zlib.crc32(name.encode()), dtype=dtype, **case)
  fn = jax.jit(lambda q, k, v: mg.flash_attention(q, k, v, causal=causal, block_sizes=bs))
  out, lse = fn(q, k, v)
  _check(out, lse, q, k, v, causal, dtype)
