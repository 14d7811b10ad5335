"""Mosaic GPU (Hopper) flash attention, Triton backward: what the CPU can check, and GPU tests.

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
    that see no key;
  * the registration in ``jattn.flash_attention(implementation="mosaic_gpu")``: its custom_vjp
    hands the forward's out and LSE to the Triton backward kernels, run in interpret mode with
    ``_fwd_call`` replaced by the replay (monkeypatch), against the fp32 reference's VJP; that
    every unsupported option raises NotImplementedError naming it; and that forward + backward
    lower for "cuda" (``.lower(lowering_platforms=("cuda",))``: ``jax.export`` refuses the
    Triton custom call, which has no export compatibility guarantee).
Tests marked ``gpu`` run the compiled kernel on an sm90 GPU against the reference: the kernel
alone, and forward + VJP through ``jattn.flash_attention(implementation="mosaic_gpu")``.
"""
from __future__ import annotations

import dataclasses
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


def _replay_fn(q, k, v, *, causal, block_sizes=None, scale=None):
  """The kernel's forward walk in jnp, with its own helpers (see the module docstring)."""
  b, sq, hq, d = q.shape
  sk, hk = k.shape[1], k.shape[2]
  st = mg._static_config(q.shape, k.shape, q.dtype, causal=causal, scale=scale,
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


# ------------------------------------------- jattn registration, hybrid backward (CPU)


def _replayed_fwd_call(q_p, k_p, v_p, st):
  """Stand-in for ``mg._fwd_call`` on the CPU: the jnp replay of the kernel's walk (its own mask,
  online softmax and ``_finalize``, so the same out and natural-log LSE, -inf for empty rows), on
  the same padded inputs and returning the same padded shapes."""
  bs = mg.BlockSizes(st.block_q, st.block_k, st.num_stages, st.pingpong)
  out, lse = _replay_fn(q_p[:, :st.q_len], k_p[:, :st.kv_len], v_p[:, :st.kv_len],
                        causal=st.causal, block_sizes=bs, scale=st.scale)
  pad = q_p.shape[1] - st.q_len
  out = jnp.pad(out, ((0, 0), (0, pad), (0, 0), (0, 0)))
  lse = jnp.pad(lse, ((0, 0), (0, 0), (0, pad)), constant_values=-jnp.inf)
  return out, lse


def _vjp_vs_reference(q, k, v, causal, *, interpret, scale=None, block_sizes=None):
  """(kernel, reference) results: out, lse and the VJP of (out, lse) for random cotangents,
  through ``jattn.flash_attention(implementation="mosaic_gpu", return_lse=True)``; the reference
  runs in fp32 on the upcast inputs."""
  import jattn
  ks = jax.random.split(jax.random.key(99), 2)
  d_out = jax.random.normal(ks[0], q.shape, q.dtype)
  d_lse = jax.random.normal(ks[1], (q.shape[0], q.shape[2], q.shape[1]), jnp.float32)

  def kernel_run(q, k, v):
    f = lambda q, k, v: jattn.flash_attention(q, k, v, causal=causal, scale=scale,
                                              return_lse=True, implementation="mosaic_gpu",
                                              interpret=interpret, block_sizes=block_sizes)
    (out, lse), vjp = jax.vjp(f, q, k, v)
    return out, lse, vjp((d_out, d_lse))

  def ref_run(q, k, v):
    up = lambda x: x.astype(jnp.float32)
    f = functools.partial(attention_reference, causal=causal, scale=scale)
    (out, lse), vjp = jax.vjp(f, up(q), up(k), up(v))
    return out, lse, vjp((up(d_out), d_lse))

  run = lambda fn: (jax.jit(fn).lower(q, k, v).compile(_FAST_CPU_COMPILE) if interpret
                    else jax.jit(fn))(q, k, v)
  return run(kernel_run), run(ref_run)


def _assert_vjp_close(got, want, dtype):
  (out, lse, grads), (r_out, r_lse, r_grads) = got, want
  tol = TOL[dtype]
  assert out.dtype == dtype and lse.dtype == jnp.float32
  assert _rel(out, r_out) < tol, ("out", _rel(out, r_out))
  lse, r_lse = np.asarray(lse), np.asarray(r_lse)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(r_lse))
  fin = np.isfinite(r_lse)
  assert _rel(np.where(fin, lse, 0.0), np.where(fin, r_lse, 0.0)) < tol
  for name, g, r in zip(("dq", "dk", "dv"), grads, r_grads):
    assert g.shape == r.shape and g.dtype == dtype, (name, g.shape, g.dtype)
    assert np.isfinite(np.asarray(g, np.float32)).all(), name
    assert _rel(g, r) < tol, (name, _rel(g, r))
  if (~fin).any():   # rows that see no key: zero gradient for their queries
    dq = np.asarray(grads[0], np.float32).transpose(0, 2, 1, 3)[~fin]
    assert (dq == 0).all()


VJP_CASES = {
    "dense_gqa_ragged": dict(sq=200, sk=328, causal=False),
    "causal_gqa_ragged": dict(sq=200, sk=328, causal=True),
    "causal_q_longer_empty_rows": dict(sq=328, sk=200, causal=True, scale=0.1),
}


@pytest.mark.parametrize("name", list(VJP_CASES))
def test_registered_vjp_uses_triton_backward(name, monkeypatch):
  """jattn.flash_attention(implementation="mosaic_gpu"): the custom_vjp feeds the forward's out
  and LSE to the Triton backward (interpret mode). The Mosaic forward cannot run on the CPU, so
  ``_fwd_call`` is replaced by the jnp replay of its walk (same LSE convention)."""
  monkeypatch.setattr(mg, "_fwd_call", _replayed_fwd_call)
  case = dict(VJP_CASES[name])
  causal, scale = case.pop("causal"), case.pop("scale", None)
  q, k, v = _inputs(zlib.crc32(name.encode()), b=1, hq=4, hk=2, d=64, dtype=jnp.bfloat16, **case)
  got, want = _vjp_vs_reference(q, k, v, causal, interpret=True, scale=scale)
  _assert_vjp_close(got, want, jnp.bfloat16)


@pytest.mark.parametrize("name", list(VJP_CASES))
def test_registered_vjp_with_mosaic_backward(name, monkeypatch):
  """``BlockSizes(backward="mosaic")``: the custom_vjp hands the same residuals to the Mosaic GPU
  backward (``mosaic_gpu_bwd``). Neither Mosaic kernel runs on the CPU: the forward and both
  backward kernels are replaced by their jnp replays (tests/test_flash_mosaic_gpu_bwd.py)."""
  import test_flash_mosaic_gpu_bwd as tb
  from pallas_kernels.flash import mosaic_gpu_bwd as mb
  monkeypatch.setattr(mg, "_fwd_call", _replayed_fwd_call)
  monkeypatch.setattr(mb, "_dkv_call", tb._replay_dkv_call)
  monkeypatch.setattr(mb, "_dq_call", tb._replay_dq_call)
  called = []
  real_bwd = mb.flash_attention_bwd
  monkeypatch.setattr(mb, "flash_attention_bwd", lambda *a, **kw: called.append(1) or
                      real_bwd(*a, **kw))
  case = dict(VJP_CASES[name])
  causal, scale = case.pop("causal"), case.pop("scale", None)
  q, k, v = _inputs(zlib.crc32(name.encode()), b=1, hq=4, hk=2, d=64, dtype=jnp.bfloat16, **case)
  bs = mg.BlockSizes(backward="mosaic")
  got, want = _vjp_vs_reference(q, k, v, causal, interpret=True, scale=scale, block_sizes=bs)
  assert called, "the Mosaic GPU backward was not used"
  _assert_vjp_close(got, want, jnp.bfloat16)


def test_mosaic_backward_option_is_checked_at_the_call():
  """backward="mosaic" with head_dim 256 raises when the forward is called (not at grad time);
  an unknown backward name is a ValueError."""
  import jattn
  q = jnp.zeros((1, 64, 2, 256), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="head_dim 256"):
    jattn.flash_attention(q, q, q, implementation="mosaic_gpu",
                          block_sizes=mg.BlockSizes(64, 64, 2, backward="mosaic"))
  with pytest.raises(ValueError, match="backward"):
    mg.BlockSizes(backward="cudnn")


def test_vjp_check_catches_a_base2_lse(monkeypatch):
  """The VJP test can fail: a forward whose LSE is in base 2 (the kernel's internal domain)
  instead of natural log gives wrong gradients through the Triton backward."""
  def base2_lse(q_p, k_p, v_p, st):
    out, lse = _replayed_fwd_call(q_p, k_p, v_p, st)
    return out, lse * mg.LOG2E
  monkeypatch.setattr(mg, "_fwd_call", base2_lse)
  q, k, v = _inputs(5, b=1, sq=130, sk=130, hq=2, hk=1, d=64, dtype=jnp.bfloat16)
  (_, _, grads), (_, _, r_grads) = _vjp_vs_reference(q, k, v, True, interpret=True)
  assert _rel(grads[0], r_grads[0]) > 0.1


def test_registered_path_rejects_unsupported_options():
  """Every option the Hopper path lacks raises NotImplementedError naming it (no fallback)."""
  import jattn
  q = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
  call = functools.partial(jattn.flash_attention, implementation="mosaic_gpu")
  seg = jnp.ones((1, 128), jnp.int32)
  for kwargs, name in ((dict(segment_ids=seg), "segment_ids"),
                       (dict(segment_ids=seg, kv_segment_ids=seg), "segment_ids"),
                       (dict(local_window_size=(63, 0)), "local_window_size"),
                       (dict(local_window_size=64, causal=True), "local_window_size"),
                       (dict(logits_soft_cap=30.0), "logits_soft_cap"),
                       (dict(interpret=True), "interpret")):
    with pytest.raises(NotImplementedError, match=name):
      call(q, q, q, **kwargs)
  q96 = jnp.ones((1, 128, 2, 96), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="head_dim 96"):
    call(q96, q96, q96)
  with pytest.raises(NotImplementedError, match="head_dim_v 128"):
    call(q, q, jnp.ones((1, 128, 2, 128), jnp.bfloat16))
  for dt in (jnp.float32, jnp.float16):
    if dt == jnp.float16:   # mixed dtypes
      args = (q, q.astype(dt), q.astype(dt))
    else:
      args = (q.astype(dt),) * 3
    with pytest.raises(NotImplementedError, match="dtype"):
      call(*args)
  with pytest.raises(TypeError, match="BlockSizes"):
    from pallas_kernels.flash import triton as ft
    call(q, q, q, block_sizes=ft.default_block_sizes(64, jnp.bfloat16))
  # None never picks the Hopper path yet (its hybrid backward is not GPU-verified).
  assert jattn.resolve_implementation(None, platform="gpu") == "triton"
  assert jattn.resolve_implementation("mosaic_gpu", platform="gpu") == "mosaic_gpu"


@pytest.mark.parametrize("causal", [False, True])
def test_registered_fwd_bwd_lowers_for_cuda(causal):
  """jax.grad through jattn.flash_attention(implementation="mosaic_gpu") lowers for "cuda": the
  Mosaic GPU forward plus the two Triton backward kernels (dK/dV, dQ)."""
  import jattn
  q = jax.ShapeDtypeStruct((2, 1000, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 1000, 2, 128), jnp.bfloat16)
  loss = lambda q, k, v: jattn.flash_attention(
      q, k, v, causal=causal, implementation="mosaic_gpu").astype(jnp.float32).sum()
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
  n = text.count("__gpu$xla.gpu.triton") + text.count("triton_kernel_call_ffi")
  assert n == 2, n


# ----------------------------------------------------------------------------- GPU (sm90)

GPU_CASES = {
    "d64": dict(b=2, sq=1024, sk=1024, hq=4, hk=4, d=64, causal=False),
    "d64_causal": dict(b=2, sq=1024, sk=1024, hq=4, hk=4, d=64, causal=True),
    "d128": dict(b=2, sq=2048, sk=2048, hq=4, hk=4, d=128, causal=False),
    "d128_causal_gqa": dict(b=2, sq=2048, sk=2048, hq=8, hk=2, d=128, causal=True),
    "d128_ragged": dict(b=1, sq=1000, sk=1000, hq=2, hk=1, d=128, causal=True),
    "d128_q_shorter": dict(b=1, sq=300, sk=1111, hq=2, hk=2, d=128, causal=True),
    "d128_q_longer_empty_rows": dict(b=1, sq=700, sk=260, hq=2, hk=2, d=128, causal=True),
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


# Through the registered path: jattn.flash_attention(implementation="mosaic_gpu"), forward and
# VJP (Mosaic GPU forward, Triton backward on its out and LSE) against the fp32 reference.
GPU_VJP_CASES = {
    "d64": dict(b=2, sq=1024, sk=1024, hq=4, hk=4, d=64, causal=False),
    "d64_causal_gqa": dict(b=1, sq=1024, sk=1024, hq=4, hk=2, d=64, causal=True),
    "d128_causal_gqa": dict(b=2, sq=2048, sk=2048, hq=8, hk=2, d=128, causal=True),
    "d128_ragged_gqa": dict(b=1, sq=1000, sk=1000, hq=4, hk=2, d=128, causal=False),
    "d128_q_shorter_ragged": dict(b=1, sq=300, sk=1111, hq=2, hk=2, d=128, causal=True),
    "d128_q_longer_empty_rows": dict(b=1, sq=700, sk=260, hq=2, hk=1, d=128, causal=True),
    "d256": dict(b=1, sq=1024, sk=1024, hq=2, hk=2, d=256, causal=False),
    "d256_causal_gqa_ragged": dict(b=1, sq=777, sk=777, hq=4, hk=2, d=256, causal=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", [n for n in GPU_VJP_CASES if "d256" not in n])
def test_gpu_registered_forward_and_mosaic_backward(name):
  """Hopper forward + Hopper backward (``BlockSizes(backward="mosaic")``) through jattn."""
  if compat.gpu_compute_capability() != (9, 0):
    pytest.skip(f"needs sm90 (Hopper), got {compat.gpu_compute_capability()}")
  case = dict(GPU_VJP_CASES[name])
  dtype = case.pop("dtype", jnp.bfloat16)
  causal = case.pop("causal")
  q, k, v = _inputs(zlib.crc32(name.encode()), dtype=dtype, **case)
  bs = dataclasses.replace(mg.default_block_sizes(q.shape[-1]), backward="mosaic")
  got, want = _vjp_vs_reference(q, k, v, causal, interpret=False, block_sizes=bs)
  _assert_vjp_close(got, want, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_VJP_CASES))
def test_gpu_registered_forward_and_vjp(name):
  if compat.gpu_compute_capability() != (9, 0):
    pytest.skip(f"needs sm90 (Hopper), got {compat.gpu_compute_capability()}")
  case = dict(GPU_VJP_CASES[name])
  dtype = case.pop("dtype", jnp.bfloat16)
  causal = case.pop("causal")
  q, k, v = _inputs(zlib.crc32(name.encode()), dtype=dtype, **case)
  got, want = _vjp_vs_reference(q, k, v, causal, interpret=False)
  _assert_vjp_close(got, want, dtype)
