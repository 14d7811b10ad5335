"""Mosaic GPU (Hopper) flash attention backward: what the CPU can check, and GPU tests.

On the CPU nothing here runs the kernels: jax's Mosaic GPU interpret mode cannot execute them (its
wgmma takes neither transposed nor register operands). The CPU tests check
  * that both kernels lower for "cuda" (``jax.export``: the whole Pallas -> Mosaic GPU lowering in
    Python, register layouts, wgmma/TMA constraints, the shared-memory budget), and that an
    over-budget configuration fails to lower (so the lowering test can fail);
  * the tile walks against an independent element mask: in the dK/dV kernel the query tiles a
    warpgroup skips see none of its keys, the tiles it runs unmasked see all of them; in the dQ
    kernel the kv tiles skipped are invisible and the unmasked ones fully visible with only real
    keys; the memory warpgroups load exactly the union of the compute warpgroups' ranges;
  * the TMA rings' barrier protocol, simulated with random interleavings of the three
    warpgroups (mbarrier arrival counts, per-thread parity bits as Mosaic GPU keeps them): no
    deadlock, no slot refilled before both compute warpgroups freed it, each warpgroup computes
    exactly its walk's tiles (drained steps included in the waits);
  * a jnp replay of both kernels (same programs, warpgroup tiles, loop ranges, masks, padding,
    GQA walk, the kernels' own ``_probs``/``_dscores``, P and dS cast to the input dtype before
    their matmuls) substituted for ``_dkv_call``/``_dq_call`` (monkeypatch), so that the public
    ``flash_attention_bwd`` (padding, lse -> lse2, delta, slicing) runs end to end against
    ``jax.vjp`` of the fp32 reference, on ragged lengths, GQA, causal with q shorter and longer
    than kv (rows that see no key: dq exactly 0, no NaN) and a d_lse cotangent.
Tests marked ``gpu`` run the compiled kernels on an sm90 GPU against the reference's VJP.
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
from pallas_kernels.common import walk as wk
from pallas_kernels.flash import mosaic_gpu_bwd as mb
from pallas_kernels.flash.reference import attention_reference
from tests.helpers import ci_cases, normal

TOL = {jnp.bfloat16: 2e-2, jnp.float16: 2e-2}
# Options for compiling the CPU replay only (how XLA:CPU optimises the test harness).
_FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _rel(a, b):
  a = np.asarray(a, np.float32).astype(np.float64)
  b = np.asarray(b, np.float32).astype(np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _inputs(seed, b, sq, sk, hq, hk, d, dtype):
  return normal(seed, (b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, hq, d),
                 dtype=dtype)


# -------------------------------------------------------------------------------- lowering (CPU)

def _lower(b, sq, sk, hq, hk, d, causal, dtype=jnp.bfloat16, bs=None, window=None,
           soft_cap=None, seg=False, sched=None):
  """jax.export for "cuda" of the backward; sched: None or (block_q, block_k) of a causal
  schedule ([1, Hk] lists, traced as an input)."""
  q = jax.ShapeDtypeStruct((b, sq, hq, d), dtype)
  kv = jax.ShapeDtypeStruct((b, sk, hk, d), dtype)
  lse = jax.ShapeDtypeStruct((b, hq, sq), jnp.float32)
  q_seg, kv_seg = (jax.ShapeDtypeStruct((b, n), jnp.int32) for n in (sq, sk))
  schedule = None
  if sched is not None:
    from pallas_kernels.block_schedule import make_schedule
    nq, nk = -(-sq // sched[0]), -(-sk // sched[1])
    schedule = make_schedule(sq, sk, *sched, causal=causal,
                             block_mask=jnp.ones((1, hk, nq, nk), bool))
  fn = jax.jit(lambda q, k, v, o, l, do, q_seg, kv_seg, schedule: mb.flash_attention_bwd(
      q, k, v, o, l, do, causal=causal, block_sizes=bs, local_window_size=window,
      logits_soft_cap=soft_cap, q_segment_ids=q_seg if seg else None,
      kv_segment_ids=kv_seg if seg else None, schedule=schedule))
  return jax.export.export(fn, platforms=["cuda"])(q, kv, kv, q, lse, q, q_seg, kv_seg,
                                                   schedule)


LOWER_CASES = {
    "d64": dict(sq=256, sk=256, hq=2, hk=2, d=64, causal=False),
    "d128_causal_gqa_ragged": dict(sq=200, sk=328, hq=4, hk=2, d=128, causal=True),
    "d128_fp16_q_longer": dict(sq=384, sk=130, hq=2, hk=1, d=128, causal=True,
                               dtype=jnp.float16),
    "d64_causal_3_stages_bk128": dict(sq=300, sk=500, hq=2, hk=1, d=64, causal=True,
                                      bs=mb.BlockSizes(64, 128, 64, 128, 3, 3)),
    "d128_bq_dq128": dict(sq=1000, sk=1000, hq=4, hk=1, d=128, causal=True,
                          bs=mb.BlockSizes(64, 64, 128, 64, 3, 2)),
    "d128_causal_window_gqa_ragged": dict(sq=1000, sk=1000, hq=4, hk=2, d=128, causal=True,
                                          window=(511, 0)),
    "d64_two_sided_window_soft_cap": dict(sq=300, sk=500, hq=2, hk=1, d=64, causal=False,
                                          window=(33, 70), soft_cap=20.0),
    "d128_causal_soft_cap": dict(sq=256, sk=256, hq=2, hk=2, d=128, causal=True, soft_cap=30.0),
    "d128_causal_segments_window": dict(sq=1000, sk=1000, hq=4, hk=2, d=128, causal=True,
                                        window=(511, 0), seg=True),
    "d64_segments_q_shorter": dict(sq=300, sk=500, hq=2, hk=1, d=64, causal=False, seg=True),
    "d128_causal_sched_128x64_gqa": dict(sq=1000, sk=1000, hq=4, hk=2, d=128, causal=True,
                                         sched=(128, 64)),
    "d64_sched_64x128_segments_window": dict(sq=300, sk=500, hq=2, hk=1, d=64, causal=False,
                                             seg=True, window=(60, 90), sched=(64, 128)),
    "d128_sched_256x128_3_stages_soft_cap": dict(sq=512, sk=512, hq=2, hk=2, d=128, causal=True,
                                                 soft_cap=30.0, sched=(256, 128),
                                                 bs=mb.BlockSizes(64, 64, 64, 64, 3, 3)),
}


@pytest.mark.parametrize("name", ci_cases(LOWER_CASES, [
    "d64", "d128_fp16_q_longer", "d64_two_sided_window_soft_cap", "d64_segments_q_shorter"]))
def test_lowers_for_cuda(name):
  case = dict(LOWER_CASES[name])
  exported = _lower(2, **case)
  text = exported.mlir_module()
  assert text.count("custom_call @mosaic_gpu") == 2 and "wgmma" in text   # two kernels
  sq, sk, hq, hk, d = (case[n] for n in ("sq", "sk", "hq", "hk", "d"))
  assert [a.shape for a in exported.out_avals] == [(2, sq, hq, d), (2, sk, hk, d), (2, sk, hk, d)]


@pytest.mark.parametrize("bs", [mb.BlockSizes(64, 64, 64, 128, 2, 4),      # dQ kernel over
                                mb.BlockSizes(128, 64, 64, 64, 5, 2)])     # dK/dV kernel over
def test_shared_memory_overflow_fails_to_lower(bs):
  with pytest.raises(ValueError, match="shared memory"):
    _lower(1, 256, 256, 1, 1, 128, False, bs=bs)


def test_lowers_after_the_mosaic_forward_with_a_schedule():
  """The Mosaic GPU forward walking a block schedule and this backward walking the same one
  lower together (``mosaic_gpu.flash_attention(schedule=..., bwd_block_sizes=BlockSizes())``:
  three Mosaic GPU kernels, no Triton one)."""
  from pallas_kernels.block_schedule import make_schedule
  from pallas_kernels.flash import mosaic_gpu as mg
  keep = jnp.asarray(np.random.default_rng(0).random((1, 2, 8, 16)) < 0.5)
  sched = make_schedule(1000, 1000, 128, 64, causal=True, block_mask=keep)
  fwd_bs = mg.BlockSizes(block_k=64)
  f = lambda q, k, v: mg.flash_attention(q, k, v, schedule=sched, causal=True,
                                         block_sizes=fwd_bs, bwd_block_sizes=mb.BlockSizes())[0]

  def fwd_bwd(q, k, v, do):
    _, vjp = jax.vjp(f, q, k, v)
    return vjp(do)
  q = jax.ShapeDtypeStruct((1, 1000, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 1000, 2, 128), jnp.bfloat16)
  text = jax.export.export(jax.jit(fwd_bwd), platforms=["cuda"])(q, kv, kv, q).mlir_module()
  assert text.count("custom_call @mosaic_gpu") == 3 and "triton" not in text.lower()


@pytest.mark.parametrize("causal,window,soft_cap", ci_cases(
    [(False, None, None), (True, None, None), (True, (511, 0), None), (True, (511, 0), 30.0)],
    [(False, None, None), (True, (511, 0), 30.0)]))
def test_lowers_after_the_mosaic_forward(causal, window, soft_cap):
  """The Mosaic GPU forward and this backward on its out and LSE lower together (three Mosaic
  GPU kernels in one program), as the forward's custom_vjp pairs them with
  ``bwd_block_sizes`` (windows and soft cap included)."""
  from pallas_kernels.flash import mosaic_gpu as mg
  f = lambda q, k, v: mg.flash_attention(q, k, v, causal=causal, local_window_size=window,
                                         logits_soft_cap=soft_cap,
                                         bwd_block_sizes=mb.BlockSizes())[0]

  def fwd_bwd(q, k, v, do):
    _, vjp = jax.vjp(f, q, k, v)
    return vjp(do)
  q = jax.ShapeDtypeStruct((1, 1000, 4, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 1000, 2, 128), jnp.bfloat16)
  exported = jax.export.export(jax.jit(fwd_bwd), platforms=["cuda"])(q, kv, kv, q)
  assert [a.shape for a in exported.out_avals] == [q.shape, kv.shape, kv.shape]
  assert exported.mlir_module().count("custom_call @mosaic_gpu") == 3


def test_unsupported_inputs_raise():
  q = jnp.ones((1, 128, 2, 256), jnp.bfloat16)
  lse = jnp.zeros((1, 2, 128), jnp.float32)
  with pytest.raises(NotImplementedError, match="head_dim 256"):
    mb.flash_attention_bwd(q, q, q, q, lse, q)
  q96 = jnp.ones((1, 128, 2, 96), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="head_dim 96"):
    mb.flash_attention_bwd(q96, q96, q96, q96, lse, q96)
  q32 = jnp.ones((1, 128, 2, 64), jnp.float32)
  with pytest.raises(NotImplementedError, match="float32"):
    mb.flash_attention_bwd(q32, q32, q32, q32, lse, q32)
  q64 = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="lse"):
    mb.flash_attention_bwd(q64, q64, q64, q64, lse[:, :1], q64)
  with pytest.raises(ValueError, match="multiple of 64"):
    mb.BlockSizes(block_k_dkv=32)


# ---------------------------------------------------------------------------- tile walk (CPU)

WALK_SHAPES = [(128, 128), (1000, 1000), (200, 328), (328, 200), (384, 130), (64, 1000), (1, 77),
               (77, 1)]
WALK_BLOCKS = [mb.BlockSizes(), mb.BlockSizes(128, 64, 128, 128), mb.BlockSizes(64, 128, 64, 64)]
# (causal, local_window_size): dense, causal, causal windows, two-sided and one-sided windows.
WALK_MASKS = [(False, None), (True, None), (True, (100, 0)), (True, (0, 0)), (True, (511, 7)),
              (False, (37, 90)), (False, (None, 50)), (False, (60, None)), (False, (0, 0))]
MASK_IDS = [f"causal{int(c)}_w{w}" for c, w in WALK_MASKS]


def _ref_visible(q_pos, k_pos, st):
  """Independent element mask: real query and key, causal bottom-right, the window."""
  vis = (q_pos < st.q_len) & (k_pos < st.kv_len)
  p = q_pos + (st.kv_len - st.q_len)
  if st.causal:
    vis &= k_pos <= p
  if st.window is not None:
    left, right = st.window
    if left is not None:
      vis &= k_pos >= p - left
    if right is not None:
      vis &= k_pos <= p + right
  return vis


def _walk_config(sq, sk, bs, causal, window, hq=1, hk=1, d=128):
  return mb._static_config((1, sq, hq, d), (1, sk, hk, d), jnp.bfloat16, causal=causal,
                           scale=None, block_sizes=bs, local_window_size=window)


@pytest.mark.parametrize("causal,window", WALK_MASKS, ids=MASK_IDS)
def test_dkv_walk(causal, window):
  for sq, sk in WALK_SHAPES:
    for bs in WALK_BLOCKS:
      st = _walk_config(sq, sk, bs, causal, window)
      bq, bk, nq = bs.block_q_dkv, bs.block_k_dkv, st.num_q_tiles_dkv
      assert nq * bq <= st.q_pad and st.num_dkv_programs * 2 * bk <= st.kv_pad
      keys = np.arange(bk)[:, None]                       # transposed tile: rows are keys
      qs = np.arange(bq)[None, :]
      for prog in range(st.num_dkv_programs):
        k0p = prog * 2 * bk
        first_p = int(mb._dkv_q_bounds(jnp.int32(k0p), st)[0])
        last_p = int(mb._dkv_q_bounds(jnp.int32(k0p + bk), st)[3])
        for wg in range(2):
          k0 = k0p + wg * bk
          first, lo, hi, last = (int(x) for x in mb._dkv_q_bounds(jnp.int32(k0), st))
          assert first_p <= first <= lo <= hi <= last <= last_p <= nq, (sq, sk, bs, prog, wg)
          for i in range(nq):
            ref = _ref_visible(qs + i * bq, keys + k0, st)
            real = (qs + i * bq < sq) & (keys + k0 < sk)
            if i < first or i >= last:
              assert not ref.any(), (sq, sk, bs, prog, wg, i)          # safe to skip
            elif lo <= i < hi:   # unmasked: every real (key, row) pair visible
              np.testing.assert_array_equal(ref, real)
            else:
              kern = np.asarray(mb._dkv_visible(keys, qs, k0, i, st))
              np.testing.assert_array_equal(kern & real, ref)
          if first < last and k0 < sk:   # no wasted edge tile
            assert _ref_visible(qs + first * bq, keys + k0, st).any()
            assert _ref_visible(qs + (last - 1) * bq, keys + k0, st).any()


@pytest.mark.parametrize("causal,window", WALK_MASKS, ids=MASK_IDS)
def test_dq_walk(causal, window):
  for sq, sk in WALK_SHAPES:
    for bs in WALK_BLOCKS:
      st = _walk_config(sq, sk, bs, causal, window)
      bq, bk, nk = bs.block_q_dq, bs.block_k_dq, st.num_kv_tiles_dq
      assert nk * bk <= st.kv_pad and st.num_dq_programs * 2 * bq <= st.q_pad
      rows = np.arange(bq)[:, None]
      cols = np.arange(bk)[None, :]
      for prog in range(st.num_dq_programs):
        ranges = []
        for wg in range(2):
          row0 = prog * 2 * bq + wg * bq
          start, lo, hi, steps = (int(x) for x in mb._dq_kv_range(jnp.int32(row0), st))
          assert 0 <= start <= lo <= hi <= steps <= nk
          real_rows = rows + row0 < sq
          for t in range(nk):
            ref = _ref_visible(rows + row0, cols + t * bk, st)
            if lo <= t < hi:
              np.testing.assert_array_equal(ref, real_rows & np.ones_like(cols, bool))
            elif start <= t < steps:
              kern = np.asarray(mb._dq_visible(rows, cols, row0, t, st))
              np.testing.assert_array_equal(kern & real_rows, ref)
            else:
              assert not ref.any(), (sq, sk, bs, prog, wg, t)
          if start < steps and row0 < sq:   # no wasted edge tile
            assert _ref_visible(rows + row0, cols + start * bk, st).any()
            assert _ref_visible(rows + row0, cols + (steps - 1) * bk, st).any()
          ranges.append((start, steps))
        # what the memory warpgroup loads: the union of the warpgroups' ranges
        program_start = int(mb._dq_kv_range(jnp.int32(prog * 2 * bq), st)[0])
        program_steps = int(mb._dq_kv_range(jnp.int32(prog * 2 * bq + bq), st)[3])
        assert program_start == min(r[0] for r in ranges)
        assert program_steps == max(r[1] for r in ranges)


def test_window_walk_skips_tiles():
  """A causal window of 100 over 1000 tokens walks a band, not the causal triangle."""
  st = _walk_config(1000, 1000, mb.BlockSizes(), True, (100, 0))
  dq_tiles = sum(int(r[3] - r[0]) for r in (mb._dq_kv_range(jnp.int32(r0), st)
                                            for r0 in range(0, st.q_pad, 64)))
  dkv_tiles = sum(int(r[3] - r[0]) for r in (mb._dkv_q_bounds(jnp.int32(k0), st)
                                             for k0 in range(0, st.kv_pad, 64)))
  assert dq_tiles <= 16 * 3 and dkv_tiles <= 16 * 3, (dq_tiles, dkv_tiles)


def _segments(seed, b, n, kind):
  """int32 [b, n] segment ids: "packed" (documents of random lengths, ids 1, 2, ..., a padded
  tail of 0 in the last row) or "random" (ids 0..3 anywhere, 0 = padding)."""
  rng = np.random.default_rng(seed)
  if kind == "random":
    return rng.integers(0, 4, (b, n)).astype(np.int32)
  out = np.zeros((b, n), np.int32)
  for r in range(b):
    pos, doc = 0, 1
    end = n - (rng.integers(1, n // 4 + 2) if r == b - 1 else 0)
    while pos < end:
      length = int(rng.integers(1, max(2, n // 3)))
      out[r, pos:min(end, pos + length)] = doc
      pos, doc = pos + length, doc + 1
  return out


SEG_WALK = [(300, 300, "packed", False, None), (300, 300, "packed", True, None),
            (1000, 1000, "packed", True, (200, 0)), (200, 328, "random", False, None),
            (328, 200, "random", True, None), (257, 257, "packed", False, (40, 90))]


@pytest.mark.parametrize("sq,sk,kind,causal,window",
                         ci_cases(SEG_WALK, [SEG_WALK[2], SEG_WALK[5]]))
def test_segment_bounds_walks(sq, sk, kind, causal, window):
  """``_seg_bounds``: in both kernels, per batch row and warpgroup tile, tiles outside [lo, hi)
  hold no visible pair (independent mask with segment ids), tiles in [flo, fhi) only visible
  pairs (every real row and key), masked tiles get exactly the visible pairs from the kernel's
  mask (static bounds and segment ids); a program walks the union of its warpgroups' ranges."""
  b = 2
  q_seg = _segments(sq, b, sq, kind)
  kv_seg = q_seg if sq == sk else _segments(sk, b, sk, kind)
  for bs in (mb.BlockSizes(), mb.BlockSizes(128, 64, 64, 128)):
    st = mb._static_config((b, sq, 1, 64), (b, sk, 1, 64), jnp.bfloat16, causal=causal,
                           scale=None, block_sizes=bs, local_window_size=window, has_seg=True)
    qs_p = np.pad(q_seg, ((0, 0), (0, st.q_pad - sq)))
    ks_p = np.pad(kv_seg, ((0, 0), (0, st.kv_pad - sk)))
    dq_b, dkv_b = (np.asarray(x) for x in mb._seg_bounds(jnp.asarray(qs_p), jnp.asarray(ks_p),
                                                           st))
    for bounds in (dq_b, dkv_b):
      for row in bounds.reshape(-1, 10):
        plo, phi = row[:2]
        assert plo <= phi
        for lo, flo, fhi, hi in row[2:].reshape(2, 4):
          assert plo <= lo <= flo <= fhi <= hi <= phi, row
    ref = lambda qp, kp, r: (_ref_visible(qp, kp, st) & (qs_p[r][np.minimum(qp, st.q_pad - 1)]
                                                          == ks_p[r][np.minimum(kp, st.kv_pad - 1)])
                             & (ks_p[r][np.minimum(kp, st.kv_pad - 1)] != 0))
    # dQ kernel
    bq, bk = bs.block_q_dq, bs.block_k_dq
    rows, cols = np.arange(bq)[:, None], np.arange(bk)[None, :]
    for r in range(b):
      for prog in range(st.num_dq_programs):
        for wg in range(2):
          row0 = prog * 2 * bq + wg * bq
          lo, flo, fhi, hi = dq_b[r, prog, 2 + 4 * wg:6 + 4 * wg]
          for t in range(st.num_kv_tiles_dq):
            want = ref(rows + row0, cols + t * bk, r)
            real = (rows + row0 < sq) & (cols + t * bk < sk)
            if not lo <= t < hi:
              assert not want.any(), (r, prog, wg, t)
            elif flo <= t < fhi:
              np.testing.assert_array_equal(want, real)
            else:
              kern = np.asarray(mb._both(mb._dq_visible(rows, cols, row0, t, st),
                                         mb._seg_visible(qs_p[r, row0:row0 + bq],
                                                         ks_p[r, t * bk:(t + 1) * bk],
                                                         (bq, bk), 0)))
              np.testing.assert_array_equal(kern & real, want)
    # dK/dV kernel (transposed tiles: rows are keys)
    bq, bk = bs.block_q_dkv, bs.block_k_dkv
    keys, qcols = np.arange(bk)[:, None], np.arange(bq)[None, :]
    for r in range(b):
      for prog in range(st.num_dkv_programs):
        for wg in range(2):
          k0 = prog * 2 * bk + wg * bk
          lo, flo, fhi, hi = dkv_b[r, prog, 2 + 4 * wg:6 + 4 * wg]
          for i in range(st.num_q_tiles_dkv):
            want = ref(qcols + i * bq, keys + k0, r)
            real = (qcols + i * bq < sq) & (keys + k0 < sk)
            if not lo <= i < hi:
              assert not want.any(), (r, prog, wg, i)
            elif flo <= i < fhi:
              np.testing.assert_array_equal(want, real)
            else:
              static = (mb._dkv_visible(keys, qcols, k0, i, st)
                        if st.lo_reach is not None or st.hi_reach is not None else None)
              kern = np.asarray(mb._both(static, mb._seg_visible(
                  qs_p[r, i * bq:(i + 1) * bq], ks_p[r, k0:k0 + bk], (bk, bq), 1)))
              np.testing.assert_array_equal(kern & real, want & real)


SCHED_WALK = [  # (sq, sk, causal, window, segments, schedule tiles, kernel tiles)
    (600, 600, True, None, None, (128, 64), mb.BlockSizes()),
    (457, 200, False, None, None, (64, 128), mb.BlockSizes()),
    (520, 520, True, (200, 0), "packed", (128, 128), mb.BlockSizes(128, 64, 128, 64)),
    (300, 777, False, (50, 300), "random", (256, 64), mb.BlockSizes(64, 64, 64, 64)),
    (384, 384, True, None, "packed", (64, 64), mb.BlockSizes(64, 64, 64, 64)),
]


def _sched_walks_np(sched, st, q_seg=None, kv_seg=None):
  """``_sched_walks`` as numpy arrays, compiled as one program with cheap XLA:CPU codegen (op by
  op its many small ops each compile)."""
  fn = lambda s, q, k: mb._sched_walks(s, st, q, k)
  out = jax.jit(fn).lower(sched, q_seg, kv_seg).compile(_FAST_CPU_COMPILE)(sched, q_seg, kv_seg)
  return tuple(np.asarray(x) for x in out)


def _walk_entries(row):
  """[(tile, code of warpgroup 0, code of warpgroup 1)] of a walk row [count, entries...]."""
  return [(int(e) >> wk.WALK_SHIFT, int(e) & 3, (int(e) >> 2) & 3) for e in row[1:1 + row[0]]]


@pytest.mark.parametrize("sq,sk,causal,window,kind,tiles,bs",
                         ci_cases(SCHED_WALK, SCHED_WALK[1:3]))
def test_sched_walks_cover_exactly_the_selection(sq, sk, causal, window, kind, tiles, bs):
  """``_sched_walks`` against an independent element mask (static mask, segment ids, the
  schedule's tile selection), in both kernels, per batch row, kv head and warpgroup tile: every
  visible pair lies in a tile its warpgroup computes; a computed tile lies inside selected
  schedule tiles (the kernels' element mask does not know the selection); an unmasked tile
  holds only visible pairs (every real row and key); no tile is listed twice in a program."""
  b, hk = 2, 2
  segs, q_seg = {}, None
  if kind is not None:
    q_seg = _segments(sq, b, sq, kind)
    kv_seg = q_seg if sq == sk else _segments(sk, b, sk, kind)
    segs = dict(q_segment_ids=jnp.asarray(q_seg), kv_segment_ids=jnp.asarray(kv_seg))
  sched, elem = _random_schedule(sq + sk, sq, sk, b, hk, block_q=tiles[0], block_k=tiles[1],
                                 keep=0.5, per_batch=True, causal=causal, window=window,
                                 segs=segs)
  st = mb._static_config((b, sq, hk, 64), (b, sk, hk, 64), jnp.bfloat16, causal=causal,
                         scale=None, block_sizes=bs, local_window_size=window,
                         has_seg=kind is not None, schedule=sched)
  qp = kp = None
  if kind is not None:
    qp = jnp.asarray(np.pad(q_seg, ((0, 0), (0, st.q_pad - sq))))
    kp = jnp.asarray(np.pad(kv_seg, ((0, 0), (0, st.kv_pad - sk))))
  dq_walk, dkv_walk = _sched_walks_np(sched, st, qp, kp)
  qpos, kpos = np.arange(sq)[:, None], np.arange(sk)[None, :]
  static = _ref_visible(qpos, kpos, st)                    # [sq, sk]
  selected = np.broadcast_to(np.asarray(elem), (b, hk, sq, sk))
  for bi in range(b):
    seg_ok = True if kind is None else (q_seg[bi][:, None] == kv_seg[bi][None, :]) & (
        q_seg[bi][:, None] != 0)
    for h in range(hk):
      vis = static & seg_ok & selected[bi, h]              # [sq, sk]
      sel = selected[bi, h]
      # (walk, own tile, walk tile, own-axis view of the masks [own, walk])
      for walk, own_blk, walk_blk, v, sl in (
          (dq_walk, bs.block_q_dq, bs.block_k_dq, vis, sel),
          (dkv_walk, bs.block_k_dkv, bs.block_q_dkv, vis.T, sel.T)):
        w = walk[bi if walk.shape[0] > 1 else 0, h if walk.shape[1] > 1 else 0]
        n_own, n_walk = v.shape
        covered = np.zeros_like(v)
        for p, row in enumerate(w):
          entries = _walk_entries(row)
          listed = [t for t, _, _ in entries]
          assert len(listed) == len(set(listed)), (p, listed)
          for t, *codes in entries:
            for wg, code in enumerate(codes):
              o0, t0 = (2 * p + wg) * own_blk, t * walk_blk
              blk_v = v[o0:o0 + own_blk, t0:t0 + walk_blk]
              if code == wk.SKIP or blk_v.size == 0:
                continue
              assert sl[o0:o0 + own_blk, t0:t0 + walk_blk].all(), (p, wg, t)   # selected
              if code == wk.FULL:
                assert blk_v.all(), (p, wg, t)
              covered[o0:o0 + own_blk, t0:t0 + walk_blk] = True
        assert not (v & ~covered).any(), np.argwhere(v & ~covered)[:5]


def test_sched_walks_skip_unselected_tiles():
  """A schedule keeping 2 of 16 kv tiles per query tile walks 2 (or fewer) tiles per dQ program,
  and the dK/dV kernel only the query tiles that selected its keys."""
  from pallas_kernels.block_schedule import make_schedule
  keep = np.zeros((1, 1, 8, 16), bool)
  keep[..., :, [0, 5]] = True
  sched = make_schedule(1024, 1024, 128, 64, block_mask=jnp.asarray(keep))
  st = mb._static_config((1, 1024, 1, 64), (1, 1024, 1, 64), jnp.bfloat16, causal=False,
                         scale=None, block_sizes=mb.BlockSizes(), schedule=sched)
  dq_walk, dkv_walk = (x[0, 0] for x in _sched_walks_np(sched, st))
  assert [sorted(t for t, *_ in _walk_entries(r)) for r in dq_walk] == [[0, 5]] * 8
  counts = [len(_walk_entries(r)) for r in dkv_walk]      # programs of 128 keys: tiles 0, 5
  assert counts == [16, 0, 16, 0, 0, 0, 0, 0], counts


def test_schedules_take_the_block_sparse_entry(monkeypatch):
  """A call with a block schedule reads the table's "block_sparse" entry (the H200's D128: 4
  dK/dV stages), cut to the schedule's tiles; without one, its mask kind's."""
  from pallas_kernels import tuning
  from pallas_kernels.block_schedule import make_schedule
  monkeypatch.setattr(tuning, "device_kind", lambda: "NVIDIA H200")
  mb._tuned_block_sizes.cache_clear()
  try:
    sched = make_schedule(1024, 1024, 128, 64, causal=True)
    got = mb.call_block_sizes(128, jnp.bfloat16, causal=True, schedule=sched)
    plain = mb.call_block_sizes(128, jnp.bfloat16, causal=True)
    d64 = mb.call_block_sizes(64, jnp.bfloat16, causal=True, schedule=sched)
  finally:
    mb._tuned_block_sizes.cache_clear()
  assert (got.num_stages_dkv, got.num_stages_dq, plain.num_stages_dkv) == (4, 2, 3)
  assert (d64.block_k_dq, d64.num_stages_dkv) == (64, 3)   # D64: the 'all' entry, cut to 64 keys


def test_schedule_tiles_must_hold_the_kernels():
  from pallas_kernels.block_schedule import make_schedule
  sched = make_schedule(256, 256, 64, 64, causal=True)
  q = jnp.ones((1, 256, 1, 64), jnp.bfloat16)
  lse = jnp.zeros((1, 1, 256), jnp.float32)
  with pytest.raises(ValueError, match="block_q_dq=128 does not divide"):
    mb.flash_attention_bwd(q, q, q, q, lse, q, causal=True, schedule=sched,
                           block_sizes=mb.BlockSizes(64, 64, 128, 64))
  with pytest.raises(ValueError, match="lengths"):
    mb.flash_attention_bwd(q[:, :200], q, q, q[:, :200], lse[:, :, :200], q[:, :200],
                           causal=True, schedule=sched)
  assert mb.fit_block_sizes(mb.BlockSizes(128, 128, 64, 128), sched) == mb.BlockSizes()


def test_segment_bounds_skip_other_documents():
  """Packed causal documents of 256 tokens: each query tile walks its own document only."""
  seg = jnp.repeat(jnp.arange(1, 5, dtype=jnp.int32), 256)[None]
  st = mb._static_config((1, 1024, 1, 64), (1, 1024, 1, 64), jnp.bfloat16, causal=True,
                         scale=None, block_sizes=mb.BlockSizes(), has_seg=True)
  dq_b, dkv_b = (np.asarray(x) for x in mb._seg_bounds(seg, seg, st))
  walked = lambda bounds: sum(int(hi - lo) for lo, _, _, hi in bounds[0, :, 2:].reshape(-1, 4))
  assert walked(dq_b) == walked(dkv_b) == 4 * 10     # 4 docs x (1 + 2 + 3 + 4) tile pairs


# ------------------------------------------------------- barrier protocol simulation (CPU)


class _Barrier:
  """An mbarrier array: per barrier, arrivals per phase and completed phases. A wait for parity
  P returns once the barrier's current phase parity differs from P (hardware try_wait.parity);
  each thread keeps its own parity bit per barrier, flipped by every wait (as Mosaic GPU does)."""

  def __init__(self, n, arrivals=1):
    self.arrivals = arrivals
    self.pending = [arrivals] * n
    self.completed = [0] * n

  def arrive(self, i):
    self.pending[i] -= 1
    assert self.pending[i] >= 0
    if self.pending[i] == 0:
      self.completed[i] += 1
      self.pending[i] = self.arrivals


def _simulate(threads, seed):
  """Run generator threads that yield ("wait", barrier, i) or ("arrive", barrier, i) with a random
  interleaving; asserts no deadlock. Returns the number of ops run."""
  rng = np.random.default_rng(seed)
  parity = [dict() for _ in threads]
  pending = [next(t, None) for t in threads]
  ops = 0
  while any(op is not None for op in pending):
    ready = []
    for n, op in enumerate(pending):
      if op is None:
        continue
      kind, bar, i = op
      if kind == "arrive" or bar.completed[i] % 2 != parity[n].get((id(bar), i), 0):
        ready.append(n)
    assert ready, f"deadlock: {pending}"
    n = ready[rng.integers(len(ready))]
    kind, bar, i = pending[n]
    if kind == "arrive":
      bar.arrive(i)
    else:
      parity[n][(id(bar), i)] = 1 - parity[n].get((id(bar), i), 0)
    ops += 1
    pending[n] = next(threads[n], None)
  return ops


def _wg_ranges(bounds_row, wg, static):
  """A warpgroup's 4 range ints: from a ``_seg_bounds`` row, else ``static()``."""
  if bounds_row is not None:
    return tuple(int(x) for x in bounds_row[2 + 4 * wg:6 + 4 * wg])
  return tuple(int(x) for x in static())


def _dkv_protocol(st, prog, seed, bounds_row=None):
  """The dK/dV kernel's ring protocol for one program (loop bounds from the kernel's helpers,
  or a ``_seg_bounds`` row): every compute step must see the (head, query tile) it expects in
  each of the 4 buffers, from its first wait to its free arrival."""
  stages, bk = st.bs.num_stages_dkv, st.bs.block_k_dkv
  k0p = prog * 2 * bk
  if bounds_row is not None:
    first_p, last_p = int(bounds_row[0]), int(bounds_row[1])
  else:
    first_p = int(mb._dkv_q_bounds(jnp.int32(k0p), st)[0])
    last_p = int(mb._dkv_q_bounds(jnp.int32(k0p + bk), st)[3])
  per_head = last_p - first_p
  total = st.group * per_head
  loaded = [_Barrier(stages) for _ in range(4)]           # q, do, lse, delta (the waits' order)
  free = _Barrier(stages, arrivals=2)
  data = [[None] * stages for _ in range(4)]
  computed = {0: [], 1: []}

  def memory():
    def load(j, slot):
      g = j // per_head
      for buf in range(4):
        data[buf][slot] = (g, first_p + j - g * per_head)
        yield ("arrive", loaded[buf], slot)               # TMA completion
    for s in range(min(stages, total)):
      yield from load(s, s)
    for j in range(stages, max(total, stages)):
      yield ("wait", free, j % stages)
      yield from load(j, j % stages)

  def compute(wg):
    first, lo, hi, last = _wg_ranges(bounds_row, wg,
                                     lambda: mb._dkv_q_bounds(jnp.int32(k0p + wg * bk), st))
    for g in range(st.group):
      base = g * per_head - first_p
      for i in range(first_p, last_p):
        slot = (base + i) % stages
        run = first <= i < last
        for buf in range(4):
          yield ("wait", loaded[buf], slot)
          if run:
            assert data[buf][slot] == (g, i), (buf, data[buf][slot], g, i)
        if run:
          assert all(data[buf][slot] == (g, i) for buf in range(4))   # still there at the end
          computed[wg].append((g, i, not lo <= i < hi))
        yield ("arrive", free, slot)

  _simulate([memory(), compute(0), compute(1)], seed)
  return computed


def _dq_protocol(st, prog, seed, bounds_row=None):
  """The dQ kernel's K/V ring protocol for one program (see ``_dkv_protocol``)."""
  stages, bq = st.bs.num_stages_dq, st.bs.block_q_dq
  if bounds_row is not None:
    program_start, program_steps = int(bounds_row[0]), int(bounds_row[1])
  else:
    program_start = int(mb._dq_kv_range(jnp.int32(prog * 2 * bq), st)[0])
    program_steps = int(mb._dq_kv_range(jnp.int32(prog * 2 * bq + bq), st)[3])
  n = program_steps - program_start
  loaded = [_Barrier(stages) for _ in range(2)]           # k, v
  free = _Barrier(stages, arrivals=2)
  data = [[None] * stages for _ in range(2)]
  computed = {0: [], 1: []}

  def memory():
    def load(t, slot):
      for buf in range(2):
        data[buf][slot] = t
        yield ("arrive", loaded[buf], slot)
    for e in range(min(stages, n)):
      yield from load(program_start + e, e)
    for e in range(stages, max(n, stages)):
      yield ("wait", free, e % stages)
      yield from load(program_start + e, e % stages)

  def compute(wg):
    start, lo, hi, steps = _wg_ranges(bounds_row, wg, lambda: mb._dq_kv_range(
        jnp.int32(prog * 2 * bq + wg * bq), st))
    for t in range(program_start, program_steps):
      slot = (t - program_start) % stages
      for buf in range(2):
        yield ("wait", loaded[buf], slot)
        assert data[buf][slot] == t, (buf, data[buf][slot], t)
      if start <= t < steps:
        computed[wg].append((t, not lo <= t < hi))
      yield ("arrive", free, slot)

  _simulate([memory(), compute(0), compute(1)], seed)
  return computed


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, (100, 0)),
                                           (False, (37, 90)), (False, (60, None))])
def test_ring_protocols_never_deadlock_or_overwrite(causal, window):
  """Random interleavings of the memory and compute warpgroups of both kernels: no deadlock, no
  slot overwritten before both compute warpgroups freed it, every warpgroup computes exactly
  the tiles of its walk."""
  for (sq, sk, hq, hk), bs in [((200, 328, 4, 2), mb.BlockSizes()),
                               ((328, 200, 2, 1), mb.BlockSizes(64, 64, 64, 64, 3, 3)),
                               ((1000, 700, 3, 1), mb.BlockSizes(128, 64, 64, 128, 2, 4))]:
    st = _walk_config(sq, sk, bs, causal, window, hq=hq, hk=hk, d=64)
    for prog in range(st.num_dkv_programs):
      got = _dkv_protocol(st, prog, seed=prog)
      for wg in range(2):
        first, lo, hi, last = (int(x) for x in mb._dkv_q_bounds(
            jnp.int32(prog * 2 * bs.block_k_dkv + wg * bs.block_k_dkv), st))
        want = [(g, i, not lo <= i < hi) for g in range(st.group) for i in range(first, last)]
        assert got[wg] == want
    for prog in range(st.num_dq_programs):
      got = _dq_protocol(st, prog, seed=prog)
      for wg in range(2):
        start, lo, hi, steps = (int(x) for x in mb._dq_kv_range(
            jnp.int32(prog * 2 * bs.block_q_dq + wg * bs.block_q_dq), st))
        assert got[wg] == [(t, not lo <= t < hi) for t in range(start, steps)]


@pytest.mark.parametrize("sq,sk,kind,causal,window", SEG_WALK[:4])
def test_ring_protocols_with_segment_bounds(sq, sk, kind, causal, window):
  """The ring protocols on the walks of ``_seg_bounds`` (GQA 2:1, 3 stages): no deadlock, no
  early refill, each warpgroup computes exactly its [lo, hi) with [flo, fhi) unmasked."""
  b = 2
  q_seg = _segments(sq + 1, b, sq, kind)
  kv_seg = q_seg if sq == sk else _segments(sk + 1, b, sk, kind)
  st = mb._static_config((b, sq, 2, 64), (b, sk, 1, 64), jnp.bfloat16, causal=causal,
                         scale=None, block_sizes=mb.BlockSizes(64, 64, 64, 64, 3, 3),
                         local_window_size=window, has_seg=True)
  qs_p = jnp.asarray(np.pad(q_seg, ((0, 0), (0, st.q_pad - sq))))
  ks_p = jnp.asarray(np.pad(kv_seg, ((0, 0), (0, st.kv_pad - sk))))
  dq_b, dkv_b = (np.asarray(x) for x in mb._seg_bounds(qs_p, ks_p, st))
  for r in range(b):
    for prog in range(st.num_dkv_programs):
      got = _dkv_protocol(st, prog, seed=prog, bounds_row=dkv_b[r, prog])
      for wg in range(2):
        first, lo, hi, last = dkv_b[r, prog, 2 + 4 * wg:6 + 4 * wg]
        assert got[wg] == [(g, i, not lo <= i < hi) for g in range(st.group)
                           for i in range(first, last)]
    for prog in range(st.num_dq_programs):
      got = _dq_protocol(st, prog, seed=prog, bounds_row=dq_b[r, prog])
      for wg in range(2):
        start, lo, hi, steps = dq_b[r, prog, 2 + 4 * wg:6 + 4 * wg]
        assert got[wg] == [(t, not lo <= t < hi) for t in range(start, steps)]


def _walk_protocol(stages, group, row, seed, n_bufs):
  """A kernel's ring protocol on a block schedule's walk row ``[count, entries...]``: the memory
  warpgroup loads entry j of head g into slot (g * count + j) mod stages (``n_bufs`` buffers,
  each its own barrier); both compute warpgroups wait for every entry, check a non-skipped one
  holds (g, tile) from the first wait to the free arrival, and free it. Returns each warpgroup's
  computed [(g, tile, masked)]."""
  entries = _walk_entries(row)
  count = len(entries)
  total = group * count
  loaded = [_Barrier(stages) for _ in range(n_bufs)]
  free = _Barrier(stages, arrivals=2)
  data = [[None] * stages for _ in range(n_bufs)]
  computed = {0: [], 1: []}

  def memory():
    def load(j, slot):
      g, e = divmod(j, max(count, 1))
      for buf in range(n_bufs):
        data[buf][slot] = (g, entries[e][0])
        yield ("arrive", loaded[buf], slot)
    for s in range(min(stages, total)):
      yield from load(s, s)
    for j in range(stages, max(total, stages)):
      yield ("wait", free, j % stages)
      yield from load(j, j % stages)

  def compute(wg):
    for g in range(group):
      for j, (t, *codes) in enumerate(entries):
        slot = (g * count + j) % stages
        run = codes[wg] != wk.SKIP
        for buf in range(n_bufs):
          yield ("wait", loaded[buf], slot)
          if run:
            assert data[buf][slot] == (g, t), (buf, data[buf][slot], g, t)
        if run:
          assert all(data[buf][slot] == (g, t) for buf in range(n_bufs))
          computed[wg].append((g, t, codes[wg] != wk.FULL))
        yield ("arrive", free, slot)

  _simulate([memory(), compute(0), compute(1)], seed)
  return computed


@pytest.mark.parametrize("sq,sk,causal,window,kind,tiles,bs",
                         ci_cases(SCHED_WALK[:3], SCHED_WALK[2:3]))
def test_ring_protocols_on_schedule_walks(sq, sk, causal, window, kind, tiles, bs):
  """The ring protocols of both kernels on ``_sched_walks`` rows (GQA 2:1 in the dK/dV kernel:
  the list walked once per query head; 2 and 3 stages): no deadlock, no slot refilled before both
  compute warpgroups freed it, each warpgroup computes exactly its non-skipped entries."""
  b, hk = 2, 1
  segs, q_seg = {}, None
  if kind is not None:
    q_seg = _segments(sq + 3, b, sq, kind)
    kv_seg = q_seg if sq == sk else _segments(sk + 3, b, sk, kind)
    segs = dict(q_segment_ids=jnp.asarray(q_seg), kv_segment_ids=jnp.asarray(kv_seg))
  sched, _ = _random_schedule(sq * sk, sq, sk, b, hk, block_q=tiles[0], block_k=tiles[1],
                              keep=0.5, per_batch=True, causal=causal, window=window, segs=segs)
  for stages in (2, 3):
    bs_s = dataclasses.replace(bs, num_stages_dkv=stages, num_stages_dq=stages)
    st = mb._static_config((b, sq, 2 * hk, 64), (b, sk, hk, 64), jnp.bfloat16, causal=causal,
                           scale=None, block_sizes=bs_s, local_window_size=window,
                           has_seg=kind is not None, schedule=sched)
    qp = kp = None
    if kind is not None:
      qp = jnp.asarray(np.pad(q_seg, ((0, 0), (0, st.q_pad - sq))))
      kp = jnp.asarray(np.pad(kv_seg, ((0, 0), (0, st.kv_pad - sk))))
    dq_walk, dkv_walk = _sched_walks_np(sched, st, qp, kp)
    for walk, group, n_bufs in ((dq_walk, 1, 2), (dkv_walk, st.group, 4)):
      for r in range(walk.shape[0]):
        for p, row in enumerate(walk[r, 0]):
          got = _walk_protocol(stages, group, row, seed=p, n_bufs=n_bufs)
          for wg in range(2):
            assert got[wg] == [(g, t, codes[wg] != wk.FULL) for g in range(group)
                               for t, *codes in _walk_entries(row) if codes[wg] != wk.SKIP]


def test_protocol_simulation_catches_a_missing_drain():
  """The simulation can fail: in the dQ kernel, with warpgroup kv ranges more than a ring apart
  (256-row warpgroups, 64-key tiles, 2 stages, causal), a compute warpgroup that stops at its own
  last tile without draining the rest never frees the slots the memory warpgroup waits for."""
  st = mb._static_config((1, 1024, 1, 64), (1, 1024, 1, 64), jnp.bfloat16, causal=True,
                         scale=None, block_sizes=mb.BlockSizes(64, 64, 256, 64, 2, 2))
  stages, bq = st.bs.num_stages_dq, st.bs.block_q_dq
  program_steps = int(mb._dq_kv_range(jnp.int32(bq), st)[3])
  loaded, free = _Barrier(stages), _Barrier(stages, arrivals=2)

  def memory():
    for t in range(program_steps):
      if t >= stages:
        yield ("wait", free, t % stages)
      yield ("arrive", loaded, t % stages)

  def compute(wg):   # no drain
    steps = int(mb._dq_kv_range(jnp.int32(wg * bq), st)[3])
    for t in range(steps):
      yield ("wait", loaded, t % stages)
      yield ("arrive", free, t % stages)

  with pytest.raises(AssertionError, match="deadlock"):
    _simulate([memory(), compute(0), compute(1)], seed=0)


# ------------------------------------------------------------------------------- replay (CPU)


def _dot(a, b):
  return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _replay_masks(rows, cols, st, static_visible, q_seg, kv_seg, q_axis):
  """The kernels' element mask of a masked tile (static bounds where the mask has any, segment
  ids with ``seg``), or None."""
  visible = static_visible() if (st.lo_reach is not None or st.hi_reach is not None
                                 or q_axis == 0) else None
  if st.has_seg:
    visible = mb._both(visible, mb._seg_visible(q_seg, kv_seg, rows.shape, q_axis))
  return visible


def _replay_ranges(bounds, n_tiles, static_ranges, b):
  """[B, n_tiles, 4] int32 walk of every warpgroup tile: the bounds rows of ``_seg_bounds``
  with segment ids, else the static ranges (broadcast over the batch)."""
  if bounds is not None:
    return bounds[:, :, 2:].reshape(b, n_tiles, 4)
  r = jnp.stack([jnp.broadcast_to(x, (n_tiles,)) for x in static_ranges], -1)
  return jnp.broadcast_to(r, (b, n_tiles, 4))


def _replay_inputs(seg, st, b, heads, n_tiles, q_len, kv_len):
  """The kernels' extra inputs, unpacked: (q_seg [B, Sq'], kv_seg [B, Sk'] (zeros without
  segment ids), bounds or None, walk rows [B, heads, n_tiles, 1 + W] (each warpgroup tile's
  program row of the schedule's walk; zeros without one))."""
  extra = tuple(seg or ())
  q_seg, kv_seg = extra[:2] if st.has_seg else (jnp.zeros((b, q_len), jnp.int32),
                                                jnp.zeros((b, kv_len), jnp.int32))
  bounds = extra[2] if st.has_seg and not st.has_sched else None
  if st.has_sched:
    walk = extra[-1]                                      # [B', Hs, programs, 1 + W]
    walk = jnp.broadcast_to(walk, (b, heads) + walk.shape[2:])
    rows = jnp.repeat(walk, 2, axis=2)[:, :, :n_tiles]    # warpgroup tile n: program n // 2
  else:
    rows = jnp.zeros((b, heads, n_tiles, 1), jnp.int32)
  return q_seg, kv_seg, bounds, rows


def _replay_walk(wrow, wg, step, carry):
  """The kernels' walk of one warpgroup over its program's list: entry j's code picks a drain
  (nothing to compute), an unmasked or a masked ``step(tile, carry, masked=)``."""
  def body(j, carry):
    entry = wrow[1 + j]
    tile = entry >> wk.WALK_SHIFT
    code = (entry >> (2 * wg)) & 3
    return lax.switch(code, [lambda c: c, functools.partial(step, tile, masked=False),
                             functools.partial(step, tile, masked=True)], carry)
  return lax.fori_loop(0, wrow[0], body, carry)


def _replay_dkv_call(q, k, v, do, lse2, delta, st, seg=None):
  """jnp replay of ``_dkv_kernel`` on the padded inputs: every compute warpgroup's key tile, its
  query-tile range per GQA head (drained steps skipped; with segment ids the ``_seg_bounds``
  rows), masked/unmasked split, the kernel's masks and arithmetic helpers."""
  b, sq_pad, hq, d = q.shape
  hk = k.shape[2]
  bq, bk, g_n = st.bs.block_q_dkv, st.bs.block_k_dkv, st.group
  rows = lax.broadcasted_iota(jnp.int32, (bk, bq), 0)
  cols = lax.broadcasted_iota(jnp.int32, (bk, bq), 1)

  def warpgroup(k_t, v_t, q_g, do_g, lse_g, delta_g, k0, rng, kv_seg_t, q_seg_all, wrow, wg):
    first, full_lo, full_hi, last = rng[0], rng[1], rng[2], rng[3]

    def step(i, carry, *, g, masked):
      dk, dv = carry
      sl = lambda x: lax.dynamic_slice_in_dim(x[g], i * bq, bq)
      q_t, do_t, lse_t, delta_t = sl(q_g), sl(do_g), sl(lse_g), sl(delta_g)
      s_t = _dot(k_t, q_t.T)
      p_t = mb._probs(s_t, lse_t, st, axis=1)
      if masked:
        q_seg = lax.dynamic_slice_in_dim(q_seg_all, i * bq, bq)
        visible = _replay_masks(rows, cols, st, lambda: mb._dkv_visible(rows, cols, k0, i, st),
                                q_seg, kv_seg_t, 1)
        if visible is not None:
          p_t = jnp.where(visible, p_t, 0.0)
      dv = dv + _dot(p_t.astype(st.dtype), do_t)
      ds_t = mb._dscores(p_t, _dot(v_t, do_t.T), delta_t, axis=1,
                         cap_grad=mb._cap_grad(s_t, st))
      return dk + _dot(ds_t.astype(st.dtype), q_t), dv

    def head(g, carry):
      if st.has_sched:
        return _replay_walk(wrow, wg, functools.partial(step, g=g), carry)
      carry = lax.fori_loop(first, full_lo, functools.partial(step, g=g, masked=True), carry)
      carry = lax.fori_loop(full_lo, full_hi, functools.partial(step, g=g, masked=False), carry)
      return lax.fori_loop(full_hi, last, functools.partial(step, g=g, masked=True), carry)

    zeros = jnp.zeros((bk, d), jnp.float32)
    dk, dv = lax.fori_loop(0, g_n, head, (zeros, zeros))
    return (dk * st.scale).astype(st.dtype), dv.astype(st.dtype)

  n_tiles = st.num_dkv_programs * 2                       # warpgroup key tiles
  k0s = jnp.arange(n_tiles, dtype=jnp.int32) * bk
  q_seg, kv_seg, bounds, wrows = _replay_inputs(seg, st, b, hk, n_tiles, sq_pad, k.shape[1])
  rng = _replay_ranges(bounds, n_tiles, mb._dkv_q_bounds(k0s, st), b)
  wgs = jnp.arange(n_tiles, dtype=jnp.int32) % 2
  kv_seg_t = kv_seg[:, :n_tiles * bk].reshape(b, n_tiles, bk)
  kt = k[:, :n_tiles * bk].reshape(b, n_tiles, bk, hk, d).transpose(0, 3, 1, 2, 4)
  vt = v[:, :n_tiles * bk].reshape(b, n_tiles, bk, hk, d).transpose(0, 3, 1, 2, 4)
  grp = lambda x: x.transpose(0, 2, 1, 3).reshape(b, hk, g_n, x.shape[1], d)
  grp_rows = lambda x: x.reshape(b, hk, g_n, x.shape[2])
  per_tile = jax.vmap(warpgroup, in_axes=(0, 0, None, None, None, None, 0, 0, 0, None, 0, 0))
  per_head = jax.vmap(per_tile, in_axes=(0, 0, 0, 0, 0, 0, None, None, None, None, 0, None))
  dk, dv = jax.vmap(per_head, in_axes=(0, 0, 0, 0, 0, 0, None, 0, 0, 0, 0, None))(
      kt, vt, grp(q), grp(do), grp_rows(lse2), grp_rows(delta), k0s, rng, kv_seg_t, q_seg,
      wrows, wgs)
  out = lambda x: x.transpose(0, 2, 3, 1, 4).reshape(b, n_tiles * bk, hk, d)
  pad = ((0, 0), (0, k.shape[1] - n_tiles * bk), (0, 0), (0, 0))
  return jnp.pad(out(dk), pad), jnp.pad(out(dv), pad)


def _replay_dq_call(q, k, v, do, lse2, delta, st, seg=None):
  """jnp replay of ``_dq_kernel`` on the padded inputs: every compute warpgroup's rows, its kv
  range (with segment ids the ``_seg_bounds`` rows), masked/unmasked split, the kernel's masks
  and arithmetic helpers."""
  b, sq_pad, hq, d = q.shape
  bq, bk = st.bs.block_q_dq, st.bs.block_k_dq
  heads = jnp.arange(hq) // st.group
  k_h = k[:, :, heads].transpose(0, 2, 1, 3)              # [B, Hq, Sk', D] (replay only)
  v_h = v[:, :, heads].transpose(0, 2, 1, 3)
  rows = lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
  cols = lax.broadcasted_iota(jnp.int32, (bq, bk), 1)

  def warpgroup(q_t, do_t, lse_t, delta_t, k_all, v_all, row0, rng, q_seg_t, kv_seg_all, wrow,
                wg):
    start, full_lo, full_hi, steps = rng[0], rng[1], rng[2], rng[3]

    def step(t, dq, *, masked):
      k_t = lax.dynamic_slice_in_dim(k_all, t * bk, bk)
      v_t = lax.dynamic_slice_in_dim(v_all, t * bk, bk)
      s = _dot(q_t, k_t.T)
      p = mb._probs(s, lse_t, st, axis=0)
      if masked:
        kv_seg = lax.dynamic_slice_in_dim(kv_seg_all, t * bk, bk)
        visible = _replay_masks(rows, cols, st, lambda: mb._dq_visible(rows, cols, row0, t, st),
                                q_seg_t, kv_seg, 0)
        p = jnp.where(visible, p, 0.0)
      ds = mb._dscores(p, _dot(do_t, v_t.T), delta_t, axis=0, cap_grad=mb._cap_grad(s, st))
      return dq + _dot(ds.astype(st.dtype), k_t)

    dq = jnp.zeros((bq, d), jnp.float32)
    if st.has_sched:
      dq = _replay_walk(wrow, wg, step, dq)
    else:
      dq = lax.fori_loop(start, full_lo, functools.partial(step, masked=True), dq)
      dq = lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), dq)
      dq = lax.fori_loop(full_hi, steps, functools.partial(step, masked=True), dq)
    return (dq * st.scale).astype(st.dtype)

  n_tiles = st.num_dq_programs * 2
  row0s = jnp.arange(n_tiles, dtype=jnp.int32) * bq
  q_seg, kv_seg, bounds, wrows = _replay_inputs(seg, st, b, k.shape[2], n_tiles, sq_pad,
                                                k.shape[1])
  wrows = wrows[:, jnp.arange(hq) // st.group]            # per query head: its kv head's row
  rng = _replay_ranges(bounds, n_tiles, mb._dq_kv_range(row0s, st), b)
  wgs = jnp.arange(n_tiles, dtype=jnp.int32) % 2
  q_seg_t = q_seg[:, :n_tiles * bq].reshape(b, n_tiles, bq)
  tiles = lambda x: x[:, :n_tiles * bq].reshape(b, n_tiles, bq, hq, d).transpose(0, 3, 1, 2, 4)
  rows_t = lambda x: x[:, :, :n_tiles * bq].reshape(b, hq, n_tiles, bq)
  per_tile = jax.vmap(warpgroup, in_axes=(0, 0, 0, 0, None, None, 0, 0, 0, None, 0, 0))
  per_head = jax.vmap(per_tile, in_axes=(0, 0, 0, 0, 0, 0, None, None, None, None, 0, None))
  dq = jax.vmap(per_head, in_axes=(0, 0, 0, 0, 0, 0, None, 0, 0, 0, 0, None))(
      tiles(q), tiles(do), rows_t(lse2), rows_t(delta), k_h, v_h, row0s, rng, q_seg_t, kv_seg,
      wrows, wgs)
  dq = dq.transpose(0, 2, 3, 1, 4).reshape(b, n_tiles * bq, hq, d)
  return jnp.pad(dq, ((0, 0), (0, sq_pad - n_tiles * bq), (0, 0), (0, 0)))


def _reference_residuals(q, k, v, causal, scale, **mask):
  """(out in q.dtype, lse) of the fp32 reference: the forward's residuals (``mask``:
  local_window_size, logits_soft_cap)."""
  up = lambda x: x.astype(jnp.float32)
  out, lse = attention_reference(up(q), up(k), up(v), causal=causal, scale=scale, **mask)
  return out.astype(q.dtype), lse


def _reference_grads(q, k, v, do, d_lse, causal, scale, **mask):
  up = lambda x: x.astype(jnp.float32)
  f = functools.partial(attention_reference, causal=causal, scale=scale, **mask)
  (out, lse), vjp = jax.vjp(f, up(q), up(k), up(v))
  return vjp((up(do), jnp.zeros_like(lse) if d_lse is None else d_lse))


def _random_schedule(seed, q_len, kv_len, b, hk, *, block_q, block_k, keep, per_batch=False,
                     per_head=True, causal=False, window=None, segs=None):
  """(BlockSchedule, element mask [Bs, Hs, q_len, kv_len]) of a random tile selection keeping
  about ``keep`` of the (block_q x block_k) tiles, on top of the call's mask (``make_schedule``
  drops the tiles it rules out)."""
  from pallas_kernels.block_schedule import make_schedule
  nq, nk = -(-q_len // block_q), -(-kv_len // block_k)
  shape = (b if per_batch else 1, hk if per_head else 1, nq, nk)
  tiles = np.random.default_rng(seed).random(shape) < keep
  segs = segs or {}
  sched = make_schedule(q_len, kv_len, block_q, block_k, causal=causal, local_window_size=window,
                        block_mask=jnp.asarray(tiles), **segs)
  elem = np.repeat(np.repeat(tiles, block_q, 2), block_k, 3)[:, :, :q_len, :kv_len]
  return sched, jnp.asarray(elem)


def _kernel_vs_reference(q, k, v, do, causal, *, scale=None, bs=None, d_lse=None, window=None,
                         soft_cap=None, seg=None, sched=None):
  """(kernel grads, reference grads, lse) on the reference's residuals; seg: None, "packed" or
  "random" segment ids (``_segments``; separate key ids when q and kv lengths differ); sched:
  None or ``_random_schedule``'s keyword arguments (block_q, block_k, keep, ...): the kernels
  walk that schedule, the reference masks with its tiles."""
  mask = dict(local_window_size=window, logits_soft_cap=soft_cap)
  segs = {}
  b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
  if seg is not None:
    q_seg = jnp.asarray(_segments(sq, b, sq, seg))
    segs = dict(q_segment_ids=q_seg,
                kv_segment_ids=q_seg if sq == sk else jnp.asarray(_segments(sk, b, sk, seg)))
  schedule, ref_mask = None, {}
  if sched is not None:
    schedule, elem = _random_schedule(sq * 7 + sk, sq, sk, b, k.shape[2], causal=causal,
                                      window=window, segs=segs, **sched)
    ref_mask = dict(block_mask=elem)

  def both(q, k, v, do, d_lse, segs, schedule, ref_mask):
    out, lse = _reference_residuals(q, k, v, causal, scale, **mask, **segs, **ref_mask)
    got = mb.flash_attention_bwd(q, k, v, out, lse, do, causal=causal, scale=scale,
                                 block_sizes=bs, d_lse=d_lse, schedule=schedule, **mask, **segs)
    return got, _reference_grads(q, k, v, do, d_lse, causal, scale, **mask, **segs,
                                 **ref_mask), lse
  fn = jax.jit(both)
  args = (q, k, v, do, d_lse, segs, schedule, ref_mask)
  if compat.default_backend() == "cpu":
    return fn.lower(*args).compile(_FAST_CPU_COMPILE)(*args)
  return fn(*args)


def _assert_grads_close(got, want, lse, q, k, dtype):
  tol = TOL[dtype]
  for name, g, r, like in zip(("dq", "dk", "dv"), got, want, (q, k, k)):
    assert g.shape == like.shape and g.dtype == dtype, (name, g.shape, g.dtype)
    assert np.isfinite(np.asarray(g, np.float32)).all(), name
    assert _rel(g, r) < tol, (name, _rel(g, r))
  empty = np.isneginf(np.asarray(lse))                    # [B, Hq, Sq]
  if empty.any():   # rows that see no key: dq exactly 0
    dq = np.asarray(got[0], np.float32).transpose(0, 2, 1, 3)[empty]
    assert (dq == 0).all()


REPLAY_CASES = {
    "dense_gqa_ragged": dict(b=1, sq=200, sk=328, hq=4, hk=2, d=64, causal=False),
    "causal_gqa_ragged": dict(b=1, sq=200, sk=328, hq=4, hk=2, d=64, causal=True),
    "causal_q_longer_empty_rows": dict(b=1, sq=328, sk=200, hq=4, hk=2, d=64, causal=True,
                                       scale=0.1),
    "causal_blocks_128_fp16_d_lse": dict(b=2, sq=200, sk=328, hq=2, hk=1, d=64, causal=True,
                                         dtype=jnp.float16, d_lse=True,
                                         bs=mb.BlockSizes(128, 64, 128, 128)),
    "dense_bk_dkv_128": dict(b=1, sq=77, sk=130, hq=2, hk=2, d=64, causal=False,
                             bs=mb.BlockSizes(64, 128, 64, 64)),
    "causal_window_gqa_ragged": dict(b=1, sq=600, sk=600, hq=4, hk=2, d=64, causal=True,
                                     window=(100, 0)),
    "causal_window_q_shorter": dict(b=1, sq=200, sk=457, hq=2, hk=1, d=64, causal=True,
                                    window=(70, 0), bs=mb.BlockSizes(128, 64, 64, 128)),
    "window_two_sided_q_longer_empty_rows": dict(b=1, sq=400, sk=150, hq=2, hk=1, d=64,
                                                 causal=False, window=(30, 45)),
    "window_left_only_fp16_d_lse": dict(b=2, sq=300, sk=300, hq=2, hk=2, d=64, causal=False,
                                        window=(90, None), dtype=jnp.float16, d_lse=True),
    "window_right_only": dict(b=1, sq=333, sk=333, hq=2, hk=1, d=64, causal=False,
                              window=(None, 40), bs=mb.BlockSizes(64, 128, 64, 64)),
    "soft_cap_causal_gqa": dict(b=1, sq=200, sk=328, hq=4, hk=2, d=64, causal=True,
                                soft_cap=5.0, scale=0.5),
    "soft_cap_causal_window": dict(b=1, sq=500, sk=500, hq=2, hk=1, d=64, causal=True,
                                   window=(127, 0), soft_cap=3.0, scale=0.4),
    "segments_packed_causal_gqa": dict(b=2, sq=600, sk=600, hq=4, hk=2, d=64, causal=True,
                                       seg="packed"),
    "segments_random_q_shorter": dict(b=2, sq=200, sk=328, hq=2, hk=1, d=64, causal=False,
                                      seg="random", bs=mb.BlockSizes(128, 64, 64, 128)),
    "segments_window_soft_cap_fp16": dict(b=1, sq=500, sk=500, hq=2, hk=2, d=64, causal=True,
                                          seg="packed", window=(100, 0), soft_cap=5.0,
                                          dtype=jnp.float16),
    # block schedules: random tile selections (the dQ kernel walks kv lists, the dK/dV kernel
    # the transposed q lists); tiles 128 x 64 (the bench's), 64 x 128 and 256 x 64 (dK/dV
    # walks lists of other 64-row tiles), GQA, ragged lengths, per-batch lists, segment ids
    "sched_causal_128x64_gqa_ragged": dict(b=1, sq=600, sk=600, hq=4, hk=2, d=64, causal=True,
                                           sched=dict(block_q=128, block_k=64, keep=0.5)),
    "sched_dense_64x128_q_shorter": dict(b=2, sq=200, sk=457, hq=2, hk=1, d=64, causal=False,
                                         sched=dict(block_q=64, block_k=128, keep=0.4,
                                                    per_batch=True)),
    "sched_causal_256x64_blocks_128": dict(b=1, sq=520, sk=520, hq=2, hk=1, d=64, causal=True,
                                           bs=mb.BlockSizes(128, 64, 128, 64),
                                           sched=dict(block_q=256, block_k=64, keep=0.6)),
    "sched_segments_window_soft_cap": dict(b=2, sq=500, sk=500, hq=2, hk=2, d=64, causal=True,
                                           seg="packed", window=(200, 0), soft_cap=5.0,
                                           sched=dict(block_q=128, block_k=128, keep=0.7,
                                                      per_batch=True)),
    "sched_fp16_d_lse_shared_heads": dict(b=1, sq=384, sk=384, hq=4, hk=2, d=64, causal=True,
                                          dtype=jnp.float16, d_lse=True,
                                          sched=dict(block_q=64, block_k=64, keep=0.5,
                                                     per_head=False)),
}


@pytest.mark.parametrize("name", ci_cases(REPLAY_CASES, [
    "causal_q_longer_empty_rows", "causal_blocks_128_fp16_d_lse",
    "window_two_sided_q_longer_empty_rows", "soft_cap_causal_window", "segments_random_q_shorter",
    "sched_dense_64x128_q_shorter"]))
def test_replayed_kernels_match_reference_vjp(name, monkeypatch):
  monkeypatch.setattr(mb, "_dkv_call", _replay_dkv_call)
  monkeypatch.setattr(mb, "_dq_call", _replay_dq_call)
  case = dict(REPLAY_CASES[name])
  dtype, bs = case.pop("dtype", jnp.bfloat16), case.pop("bs", None)
  causal, scale, with_d_lse = case.pop("causal"), case.pop("scale", None), case.pop("d_lse", False)
  window, soft_cap = case.pop("window", None), case.pop("soft_cap", None)
  seg, sched = case.pop("seg", None), case.pop("sched", None)
  q, k, v, do = _inputs(zlib.crc32(name.encode()), dtype=dtype, **case)
  d_lse = normal(7, (case["b"], case["hq"], case["sq"]))[0] if with_d_lse else None
  got, want, lse = _kernel_vs_reference(q, k, v, do, causal, scale=scale, bs=bs, d_lse=d_lse,
                                        window=window, soft_cap=soft_cap, seg=seg, sched=sched)
  _assert_grads_close(got, want, lse, q, k, dtype)


def test_replay_check_catches_a_missing_cap_grad(monkeypatch):
  """The replay test can fail on the soft cap: dS without the cap's derivative is wrong."""
  monkeypatch.setattr(mb, "_dkv_call", _replay_dkv_call)
  monkeypatch.setattr(mb, "_dq_call", _replay_dq_call)
  monkeypatch.setattr(mb, "_cap_grad", lambda s, st: None)
  q, k, v, do = _inputs(5, b=1, sq=200, sk=200, hq=2, hk=1, d=64, dtype=jnp.bfloat16)
  got, want, _ = _kernel_vs_reference(q, k, v, do, True, scale=0.5, soft_cap=2.0)
  assert _rel(got[2], want[2]) < TOL[jnp.bfloat16]        # dv does not use dS
  assert _rel(got[0], want[0]) > 0.1 and _rel(got[1], want[1]) > 0.1


def test_replay_check_catches_a_missing_window_bound(monkeypatch):
  """The replay test can fail on the window: masks without the left bound give wrong grads."""
  monkeypatch.setattr(mb, "_dkv_call", _replay_dkv_call)
  monkeypatch.setattr(mb, "_dq_call", _replay_dq_call)
  q, k, v, do = _inputs(6, b=1, sq=300, sk=300, hq=2, hk=1, d=64, dtype=jnp.bfloat16)
  right_only = lambda q_pos, k_pos, st, visible=None: (
      k_pos <= q_pos if visible is None else jnp.logical_and(visible, k_pos <= q_pos))
  monkeypatch.setattr(mb, "_within_reach", right_only)
  got, want, _ = _kernel_vs_reference(q, k, v, do, True, window=(40, 0))
  for g, w in zip(got, want):
    assert _rel(g, w) > 0.1


def test_replay_check_catches_a_missing_segment_mask(monkeypatch):
  """The replay test can fail on segment ids: masked tiles without the segment compare give
  wrong gradients for packed documents."""
  monkeypatch.setattr(mb, "_dkv_call", _replay_dkv_call)
  monkeypatch.setattr(mb, "_dq_call", _replay_dq_call)
  monkeypatch.setattr(mb, "_seg_visible", lambda q_seg, kv_seg, shape, q_axis: None)
  q, k, v, do = _inputs(8, b=2, sq=400, sk=400, hq=2, hk=1, d=64, dtype=jnp.bfloat16)
  got, want, _ = _kernel_vs_reference(q, k, v, do, False, seg="packed")
  for g, w in zip(got, want):
    assert _rel(g, w) > 0.1


def test_replay_check_catches_a_walk_outside_the_selection(monkeypatch):
  """The replay test can fail on schedules: walks of every tile the mask allows (the
  selection dropped) give wrong gradients against the reference with the selection's mask."""
  from pallas_kernels.block_schedule import make_schedule
  monkeypatch.setattr(mb, "_dkv_call", _replay_dkv_call)
  monkeypatch.setattr(mb, "_dq_call", _replay_dq_call)
  walks = mb._sched_walks
  monkeypatch.setattr(mb, "_sched_walks", lambda s, st, q_seg=None, kv_seg=None: walks(
      make_schedule(s.q_len, s.kv_len, s.block_q, s.block_k, causal=st.causal), st))
  q, k, v, do = _inputs(9, b=1, sq=384, sk=384, hq=2, hk=1, d=64, dtype=jnp.bfloat16)
  got, want, _ = _kernel_vs_reference(q, k, v, do, True,
                                      sched=dict(block_q=128, block_k=64, keep=0.4))
  for g, w in zip(got, want):
    assert _rel(g, w) > 0.1


def test_replay_check_catches_unmasked_partial_tiles(monkeypatch):
  """... and on the walk codes: running partial tiles unmasked gives wrong gradients."""
  monkeypatch.setattr(mb, "_dkv_call", _replay_dkv_call)
  monkeypatch.setattr(mb, "_dq_call", _replay_dq_call)
  walks = mb._sched_walks

  def no_partial(s, st, q_seg=None, kv_seg=None):   # code partial -> full, both warpgroups
    def fix(w):
      e = w[..., 1:]
      c0, c1 = e & 3, (e >> 2) & 3
      c0, c1 = (jnp.where(c == wk.PARTIAL, wk.FULL, c) for c in (c0, c1))
      e = ((e >> wk.WALK_SHIFT) << wk.WALK_SHIFT) | c0 | (c1 << 2)
      return w.at[..., 1:].set(e)
    return tuple(fix(x) for x in walks(s, st, q_seg, kv_seg))
  monkeypatch.setattr(mb, "_sched_walks", no_partial)
  q, k, v, do = _inputs(10, b=1, sq=384, sk=384, hq=2, hk=1, d=64, dtype=jnp.bfloat16)
  got, want, _ = _kernel_vs_reference(q, k, v, do, True,
                                      sched=dict(block_q=128, block_k=64, keep=0.6))
  for g, w in zip(got, want):
    assert _rel(g, w) > 0.05


def test_replay_check_catches_a_wrong_mask(monkeypatch):
  """The replay test can fail: a dK/dV walk that skips its diagonal mask gives wrong dk/dv."""
  monkeypatch.setattr(mb, "_dkv_call", _replay_dkv_call)
  monkeypatch.setattr(mb, "_dq_call", _replay_dq_call)
  monkeypatch.setattr(mb, "_dkv_visible", lambda rows, cols, k0, i, st: rows >= 0)
  q, k, v, do = _inputs(3, b=1, sq=200, sk=200, hq=2, hk=1, d=64, dtype=jnp.bfloat16)
  got, want, _ = _kernel_vs_reference(q, k, v, do, True)
  assert _rel(got[0], want[0]) < TOL[jnp.bfloat16]        # dq untouched
  assert _rel(got[1], want[1]) > 0.1 and _rel(got[2], want[2]) > 0.1


# ----------------------------------------------------------------------------- GPU (sm90)

GPU_CASES = {
    "d64": dict(b=2, sq=1024, sk=1024, hq=4, hk=4, d=64, causal=False),
    "d64_causal_gqa": dict(b=1, sq=1024, sk=1024, hq=4, hk=2, d=64, causal=True),
    "d128": dict(b=2, sq=2048, sk=2048, hq=4, hk=4, d=128, causal=False),
    "d128_causal_gqa": dict(b=2, sq=2048, sk=2048, hq=8, hk=2, d=128, causal=True),
    "d128_ragged_gqa": dict(b=1, sq=1000, sk=1000, hq=4, hk=2, d=128, causal=False),
    "d128_causal_q_shorter": dict(b=1, sq=300, sk=1111, hq=2, hk=2, d=128, causal=True),
    "d128_causal_q_longer_empty_rows": dict(b=1, sq=700, sk=260, hq=2, hk=1, d=128, causal=True),
    "d128_fp16_d_lse": dict(b=1, sq=512, sk=512, hq=2, hk=1, d=128, causal=True,
                            dtype=jnp.float16, d_lse=True),
    "d128_bq_dq128_3_stages": dict(b=1, sq=1024, sk=1024, hq=2, hk=1, d=128, causal=True,
                                   bs=mb.BlockSizes(64, 64, 128, 64, 3, 2)),
    "d64_bk_dkv128": dict(b=1, sq=1000, sk=777, hq=4, hk=1, d=64, causal=True,
                          bs=mb.BlockSizes(64, 128, 64, 128, 3, 3)),
    "d128_causal_window_gqa_ragged": dict(b=1, sq=1500, sk=1500, hq=4, hk=2, d=128, causal=True,
                                          window=(511, 0)),
    "d128_causal_window_q_shorter": dict(b=1, sq=300, sk=1111, hq=2, hk=2, d=128, causal=True,
                                         window=(200, 0)),
    "d64_two_sided_window_q_longer": dict(b=1, sq=700, sk=260, hq=2, hk=1, d=64, causal=False,
                                          window=(33, 70)),
    "d128_left_window_fp16_d_lse": dict(b=1, sq=512, sk=512, hq=2, hk=1, d=128, causal=False,
                                        window=(100, None), dtype=jnp.float16, d_lse=True),
    "d128_causal_soft_cap_gqa": dict(b=1, sq=1000, sk=1000, hq=4, hk=2, d=128, causal=True,
                                     soft_cap=30.0),
    "d128_window_soft_cap_3_stages": dict(b=1, sq=1024, sk=1024, hq=2, hk=1, d=128, causal=True,
                                          window=(255, 0), soft_cap=5.0, scale=0.3,
                                          bs=mb.BlockSizes(64, 64, 64, 64, 3, 3)),
    "d128_segments_packed_causal_gqa": dict(b=2, sq=2048, sk=2048, hq=4, hk=2, d=128,
                                            causal=True, seg="packed"),
    "d128_segments_random_q_shorter": dict(b=2, sq=700, sk=1111, hq=4, hk=2, d=128,
                                           causal=False, seg="random"),
    "d64_segments_window_soft_cap": dict(b=1, sq=1000, sk=1000, hq=2, hk=1, d=64, causal=True,
                                         seg="packed", window=(200, 0), soft_cap=5.0),
    # block schedules: random tile selections walked by both kernels
    "d128_sched_causal_128x64_gqa": dict(b=1, sq=2048, sk=2048, hq=4, hk=2, d=128, causal=True,
                                         sched=dict(block_q=128, block_k=64, keep=0.3)),
    "d64_sched_64x128_segments_ragged": dict(b=2, sq=1000, sk=1000, hq=2, hk=1, d=64,
                                             causal=True, seg="packed",
                                             sched=dict(block_q=64, block_k=128, keep=0.5,
                                                        per_batch=True)),
    "d128_sched_256x64_q_shorter_3_stages": dict(b=1, sq=700, sk=1111, hq=2, hk=2, d=128,
                                                 causal=False,
                                                 bs=mb.BlockSizes(64, 64, 64, 64, 3, 3),
                                                 sched=dict(block_q=256, block_k=64, keep=0.4)),
}


def _skip_unless_sm90():
  if compat.gpu_compute_capability() != (9, 0):
    pytest.skip(f"needs sm90 (Hopper), got {compat.gpu_compute_capability()}")


# The default GPU run: per head dim, the table's tiles and ring depths, empty rows, each mask
# branch (windows on either side, soft cap, segment walks) and block-schedule walks; the rest
# of GPU_CASES is marked slow.
GPU_FAST = ("d64_causal_gqa", "d128_causal_q_longer_empty_rows", "d128_left_window_fp16_d_lse",
            "d64_two_sided_window_q_longer", "d128_window_soft_cap_3_stages",
            "d128_segments_random_q_shorter", "d128_sched_causal_128x64_gqa",
            "d64_sched_64x128_segments_ragged")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ci_cases(GPU_CASES, GPU_FAST))
def test_gpu_matches_reference_vjp(name):
  """The compiled kernels on the reference's residuals vs jax.vjp of the fp32 reference."""
  _skip_unless_sm90()
  case = dict(GPU_CASES[name])
  dtype, bs = case.pop("dtype", jnp.bfloat16), case.pop("bs", None)
  causal, with_d_lse = case.pop("causal"), case.pop("d_lse", False)
  window, soft_cap, scale = case.pop("window", None), case.pop("soft_cap", None), \
      case.pop("scale", None)
  seg, sched = case.pop("seg", None), case.pop("sched", None)
  q, k, v, do = _inputs(zlib.crc32(name.encode()), dtype=dtype, **case)
  d_lse = normal(7, (case["b"], case["hq"], case["sq"]))[0] if with_d_lse else None
  got, want, lse = _kernel_vs_reference(q, k, v, do, causal, bs=bs, d_lse=d_lse, window=window,
                                        soft_cap=soft_cap, scale=scale, seg=seg, sched=sched)
  _assert_grads_close(got, want, lse, q, k, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [pytest.param(False, marks=pytest.mark.slow), True])
def test_gpu_after_mosaic_forward(causal):
  """Forward by ``mosaic_gpu.flash_attention``, backward here on its out and LSE."""
  _skip_unless_sm90()
  from pallas_kernels.flash import mosaic_gpu as mg
  q, k, v, do = _inputs(11, b=1, sq=1000, sk=1000, hq=4, hk=2, d=128, dtype=jnp.bfloat16)

  @jax.jit
  def run(q, k, v, do):
    out, lse = mg.flash_attention(q, k, v, causal=causal)
    return mb.flash_attention_bwd(q, k, v, out, lse, do, causal=causal), lse
  got, lse = run(q, k, v, do)
  want = _reference_grads(q, k, v, do, None, causal, None)
  _assert_grads_close(got, want, lse, q, k, jnp.bfloat16)
