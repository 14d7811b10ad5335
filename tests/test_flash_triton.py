"""Triton flash attention, kernel-specific: per-pass tiles (backward and dK/dV schedules),
block-mask schedules that skip tiles, launch order, the table's tiles, the backward bridge for
another forward's residuals, input checks, and lowering to Triton for the "cuda" platform.

Masks, dtypes, head dims and GQA through ``jattn.flash_attention`` are in test_conformance.py.
On the CPU the kernels run in the Pallas interpreter (``interpret=True``) at small sizes.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.block_schedule import make_schedule
from pallas_kernels.flash import triton as ft
from pallas_kernels.flash.reference import attention_reference
from tests.helpers import assert_grads_close, assert_lse_close, jit_run, packed_segments
from tests.helpers import rel_err as _rel
from tests.helpers import tol as _tol


def _tile_mask_to_elements(tile_mask, block_q, block_k, q_len, kv_len):
  m = jnp.repeat(jnp.repeat(tile_mask, block_q, axis=-2), block_k, axis=-1)
  return m[..., :q_len, :kv_len]


def _run(*, batch=1, q_len=64, kv_len=None, q_heads=2, kv_heads=None, head_dim=32,
         head_dim_v=None, dtype=jnp.float32, causal=False, window=None, segments=None,
         soft_cap=None, block_q=32, block_k=16, bwd_tiles=None, tile_mask=None, poison=None,
         seed=0, interpret=True, dkv_tiles=None, block_sizes=None):
  """Run kernel and reference (forward and VJP with random cotangents for out and LSE).

  ``bwd_tiles=(block_q, block_k)`` gives the backward its own schedule of the same mask;
  ``dkv_tiles`` the dK/dV kernel a third one.
  """
  kv_len = q_len if kv_len is None else kv_len
  kv_heads = q_heads if kv_heads is None else kv_heads
  head_dim_v = head_dim if head_dim_v is None else head_dim_v
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape, np.float32).astype(dtype)  # numpy
  q = normal(batch, q_len, q_heads, head_dim)
  k = normal(batch, kv_len, kv_heads, head_dim)
  v = normal(batch, kv_len, kv_heads, head_dim_v)
  q_seg, kv_seg = segments if segments is not None else (None, None)
  scale = head_dim ** -0.5
  make = functools.partial(make_schedule, q_len, kv_len, causal=causal, local_window_size=window)
  kern = functools.partial(ft.flash_attention, causal=causal, local_window_size=window,
                           scale=scale, logits_soft_cap=soft_cap, interpret=interpret,
                           block_sizes=block_sizes)
  ref = functools.partial(attention_reference, causal=causal, local_window_size=window,
                          q_segment_ids=q_seg, kv_segment_ids=kv_seg, scale=scale,
                          logits_soft_cap=soft_cap)
  d_out = normal(batch, q_len, q_heads, head_dim_v)
  d_lse = rng.standard_normal((batch, q_heads, q_len), np.float32)

  def kernel_run(q, k, v, q_seg, kv_seg, tile_mask):
    schedule = make(block_q, block_k, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                    block_mask=tile_mask)
    bwd_schedule = dkv_schedule = None
    if bwd_tiles is not None:
      assert tile_mask is None  # a tile mask is defined on the forward's tiles
      bwd_schedule = make(*bwd_tiles, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    if dkv_tiles is not None:
      assert tile_mask is None
      dkv_schedule = make(*dkv_tiles, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    f = lambda q, k, v: kern(q, k, v, q_seg, kv_seg, schedule, bwd_schedule=bwd_schedule,
                             dkv_schedule=dkv_schedule)
    (out, lse), vjp = jax.vjp(f, q, k, v)
    return out, lse, vjp((d_out, d_lse))

  def ref_run(q, k, v, tile_mask):
    elem_mask = None
    if tile_mask is not None:
      elem_mask = _tile_mask_to_elements(tile_mask, block_q, block_k, q_len, kv_len)
    (out, lse), vjp = jax.vjp(functools.partial(ref, block_mask=elem_mask), q, k, v)
    return out, lse, vjp((d_out, d_lse))

  # ``poison`` changes K/V only where the schedule must never look (the kernel sees it, the
  # reference does not).
  k_in, v_in = (poison(k), poison(v)) if poison is not None else (k, v)
  got = jit_run(kernel_run, q, k_in, v_in, q_seg, kv_seg, tile_mask)
  want = jit_run(ref_run, q, k, v, tile_mask)
  return got, want


def _assert_close(got, want, dtype):
  tol = _tol(dtype)
  (out, lse, grads), (r_out, r_lse, r_grads) = got, want
  assert out.dtype == dtype and out.shape == r_out.shape
  assert np.isfinite(np.asarray(out, np.float32)).all()
  assert _rel(out, r_out) < tol, ("out", _rel(out, r_out))
  assert_lse_close(lse, r_lse, tol)
  assert [g.dtype for g in grads] == [r.dtype for r in r_grads]
  assert_grads_close(grads, r_grads, tol)


@pytest.mark.parametrize("fwd_tiles,bwd_tiles", [((16, 16), (32, 16)), ((32, 16), (16, 32))])
def test_forward_and_backward_tiles_differ(fwd_tiles, bwd_tiles):
  """The backward walks its own schedule with other tiles (out/LSE are per row): causal + window
  + packed segments with padding + GQA, lengths that are multiples of no tile, random
  cotangents on out and LSE."""
  rng = np.random.default_rng(5)
  q_len, kv_len = 75, 91
  q_seg = jnp.asarray(packed_segments(rng, 2, q_len, pad_tail=6, one_token_docs=False))
  kv_seg = jnp.concatenate([jnp.full((2, kv_len - q_len), 1, jnp.int32), q_seg], axis=1)
  got, want = _run(batch=2, q_len=q_len, kv_len=kv_len, q_heads=4, kv_heads=2, causal=True,
                   window=(29, 0), segments=(q_seg, kv_seg), block_q=fwd_tiles[0],
                   block_k=fwd_tiles[1], bwd_tiles=bwd_tiles, seed=7)
  _assert_close(got, want, jnp.float32)


@pytest.mark.parametrize("case", [
    # causal GQA 6:2, lengths that are multiples of no tile, dK/dV on 16-row q tiles (= its
    # chunk) under 32x16 backward tiles; dQ chunked
    dict(batch=2, q_len=75, kv_len=91, q_heads=6, kv_heads=2, causal=True, block_q=16,
         block_k=16, bwd_tiles=(32, 16), dkv_tiles=(16, 16), dkv_q_chunk=16, dq_k_chunk=16),
    # q longer than kv (empty rows), causal window, soft cap, bf16-sized tiles
    dict(q_len=100, kv_len=70, q_heads=4, kv_heads=1, causal=True, window=(30, 0),
         soft_cap=3.0, block_q=32, block_k=32, bwd_tiles=(64, 32), dkv_tiles=(16, 32)),
    # one chunk per dK/dV tile but coarser than the backward tile is allowed too
    dict(q_len=60, causal=True, q_heads=2, block_q=16, block_k=16, bwd_tiles=(16, 16),
         dkv_tiles=(32, 16), dkv_q_chunk=16),
])
def test_dkv_block_q_matches_reference(case):
  """``BlockSizes.dkv_block_q`` (dK/dV walks a schedule with its own q tiles, e.g. its chunk, so
  the causal diagonal's all-masked chunks are skipped): forward + VJP vs the fp32 reference."""
  case = dict(case)
  bs = ft.BlockSizes(case["block_q"], case["block_k"], bwd_block_q=case["bwd_tiles"][0],
                     bwd_block_k=case["bwd_tiles"][1], dkv_block_q=case["dkv_tiles"][0],
                     dkv_q_chunk=case.pop("dkv_q_chunk", None),
                     dq_k_chunk=case.pop("dq_k_chunk", None))
  assert bs.dkv_tiles == case["dkv_tiles"]
  got, want = _run(block_sizes=bs, seed=13, **case)
  _assert_close(got, want, jnp.float32)
  # Same gradients (up to summation order) as the backward schedule's own q lists.
  base, _ = _run(block_sizes=dataclasses.replace(bs, dkv_block_q=None), seed=13,
                 **dict(case, dkv_tiles=None))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(base)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_dkv_block_q_segments_and_jattn_entry_point():
  """Packed documents with padding + GQA through ``jattn.flash_attention`` (which builds the
  third schedule), bf16 against the fp32 reference; and the tile checks."""
  import jattn
  rng = np.random.default_rng(17)
  b, n, hq, hk, d = 2, 90, 4, 2, 32
  seg = jnp.asarray(packed_segments(rng, b, n, pad_tail=9, one_token_docs=False))
  q, k, v = (jnp.asarray(rng.standard_normal((b, n, h, d), np.float32)) for h in (hq, hk, hk))
  bs = ft.BlockSizes(16, 16, bwd_block_q=32, bwd_block_k=16, dkv_block_q=16, dkv_q_chunk=16)
  ct = jnp.asarray(rng.standard_normal((b, n, hq, d), np.float32))

  def loss(f, q, k, v):
    return jnp.sum(f(q, k, v).astype(jnp.float32) * ct)

  kern = lambda q, k, v: jattn.flash_attention(
      q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), causal=True,
      segment_ids=seg, implementation="triton", interpret=True, block_sizes=bs)
  ref = lambda q, k, v: attention_reference(q, k, v, causal=True, q_segment_ids=seg,
                                            kv_segment_ids=seg)[0]
  got = jit_run(jax.value_and_grad(functools.partial(loss, kern), argnums=(0, 1, 2)), q, k, v)
  want = jax.jit(jax.value_and_grad(functools.partial(loss, ref), argnums=(0, 1, 2)))(q, k, v)
  for g, r in zip(got[1], want[1]):
    assert _rel(g, r) < _tol(jnp.bfloat16), _rel(g, r)
  s = make_schedule(32, 32, 16, 16, causal=True)
  kw = dict(causal=True, local_window_size=None, scale=0.1, logits_soft_cap=None, interpret=True)
  x = jnp.zeros((1, 32, 1, 16))
  with pytest.raises(ValueError, match="dK/dV tiles"):
    ft.flash_attention(x, x, x, None, None, s, block_sizes=ft.BlockSizes(16, 16, dkv_block_q=32),
                       **kw)
  with pytest.raises(ValueError, match="dkv_schedule block_k"):
    ft.flash_attention(x, x, x, None, None, s,
                       dkv_schedule=make_schedule(32, 32, 16, 32, causal=True), **kw)


@pytest.mark.parametrize("batch,heads", [(2, 16), (1, 6), (3, 5)])
@pytest.mark.parametrize("causal,window", [(True, None), (True, (31, 0)), (False, None)])
def test_launch_order_visits_every_program_once(batch, heads, causal, window):
  """Every launch order maps its grid one-to-one onto (tile, batch, head), tiles in heaviest-first
  order within each group of (batch, head) pairs; causal masks without a left window group the
  (batch, head) pairs (by 4, 2 or 1), other masks do not."""
  import itertools
  st = ft._Static(block_q=32, block_k=32, q_len=64, kv_len=64, causal=causal, window=window,
                  scale=1.0, soft_cap=None, num_warps=4, num_stages=2, bwd_num_warps=4,
                  bwd_num_stages=2, dkv_q_chunk=16, dq_k_chunk=16, interpret=True)
  n = 7
  grid, tile_axis, index = ft._launch_order(st, n, batch, heads)
  seen = [index(*p) for p in itertools.product(*map(range, grid))]
  assert sorted(seen) == sorted(itertools.product(range(n), range(batch), range(heads)))
  assert all(p[tile_axis] == index(*p)[0] for p in itertools.product(*map(range, grid)))
  grouped = causal and window is None and (batch * heads) % 2 == 0
  assert (grid[0] != n) == grouped, grid


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=pytest.mark.gpu)])
def test_block_mask_schedule_skips_excluded_tiles(interpret):
  """A random tile mask (as block-sparse attention uses); NaN planted in K/V of a kv tile that
  no query tile visits must not reach any output or gradient: skipped tiles are never read."""
  batch, q_heads, kv_heads, q_len, bq, bk = 2, 4, 2, 96, 32, 16
  nq, nk = 3, 6
  tile_mask = jax.random.bernoulli(jax.random.key(3), 0.5, (batch, kv_heads, nq, nk))
  tile_mask = tile_mask.at[0, 0, 1].set(False)  # a query tile that sees nothing
  tile_mask = tile_mask.at[..., 2].set(False)   # kv tile 2 (rows 32..47) never visited
  excluded = slice(2 * bk, 3 * bk)
  def poison(x):  # numpy in, numpy out
    x = np.array(x)
    x[:, excluded] = np.nan
    return x
  got, want = _run(batch=batch, q_len=q_len, q_heads=q_heads, kv_heads=kv_heads, block_q=bq,
                   block_k=bk, tile_mask=tile_mask, causal=True, poison=poison,
                   interpret=interpret)
  _assert_close(got, want, jnp.float32)  # includes: no NaN anywhere
  _, _, (_, dk, dv) = got
  np.testing.assert_array_equal(np.asarray(dk[:, excluded]), 0.0)
  np.testing.assert_array_equal(np.asarray(dv[:, excluded]), 0.0)


def test_causal_schedule_skips_tiles():
  """A causal window visits only a band of tiles; the kernel loops over exactly those."""
  s = jax.jit(lambda: make_schedule(1024, 1024, 64, 32, causal=True,
                                    local_window_size=(127, 0)))()
  fwd_rows = jax.jit(ft._pack_rows)(s.kv_indices, s.kv_counts, s.kv_partial)
  counts, n_full = np.asarray(fwd_rows[..., 0]), np.asarray(fwd_rows[..., 1])
  # 64 queries + 127 window = 191 keys: 6 tiles of 32, 4 of them partial (diagonal, edge).
  assert counts.max() == 6 and (counts - n_full).max() == 4
  # Rows list full tiles first, then partial ones, covering the same set as the schedule.
  for qi in range(16):
    c = counts[0, 0, qi]
    assert sorted(np.asarray(fwd_rows[0, 0, qi, 2:2 + c])) == sorted(
        np.asarray(s.kv_indices[0, 0, qi, :c]))
    part = np.asarray(s.kv_partial[0, 0, qi, :c])
    assert n_full[0, 0, qi] == c - part.sum()


def test_bad_inputs_raise():
  q = jnp.ones((1, 32, 4, 32))
  k = jnp.ones((1, 32, 3, 32))
  sched = lambda *a: jax.eval_shape(lambda: make_schedule(*a))  # shapes suffice to validate
  s = sched(32, 32, 16, 16)
  kw = dict(causal=False, local_window_size=None, scale=1.0, logits_soft_cap=None,
            interpret=True)
  with pytest.raises(ValueError, match="multiple of kv heads"):
    ft.flash_attention(q, k, k, None, None, s, **kw)
  with pytest.raises(ValueError, match="schedule is for lengths"):
    ft.flash_attention(q, q, q, None, None, sched(16, 32, 16, 16), **kw)
  with pytest.raises(ValueError, match="power of two"):
    ft.flash_attention(q, q, q, None, None, sched(32, 32, 24, 16), **kw)
  with pytest.raises(ValueError, match="differ from the schedule"):
    ft.flash_attention(q, q, q, None, None, s, block_sizes=ft.BlockSizes(32, 16), **kw)
  with pytest.raises(ValueError, match="differ from the backward schedule"):
    ft.flash_attention(q, q, q, None, None, s, block_sizes=ft.BlockSizes(16, 16, bwd_block_q=32),
                       **kw)
  with pytest.raises(ValueError, match="bwd_schedule is for lengths"):
    ft.flash_attention(q, q, q, None, None, s, bwd_schedule=sched(16, 32, 32, 16), **kw)
  with pytest.raises(ValueError, match="segment ids"):
    seg = jnp.ones((1, 31), jnp.int32)
    ft.flash_attention(q, q, q, seg, seg, s, **kw)


def _lower_for_gpu(batch, q_len, kv_len, q_heads, kv_heads, head_dim, dtype, **mask):
  """Lower forward + VJP for the "cuda" platform (runs the Pallas -> Triton IR lowering)."""
  bs = ft.default_block_sizes(head_dim, dtype)
  if mask.pop("dkv_block_q", None):  # the dK/dV kernel on chunk-sized q tiles
    bs = dataclasses.replace(bs, dkv_block_q=bs.dkv_q_chunk)
  seg = mask.pop("segments", False)
  cap = mask.pop("soft_cap", None)

  def f(q, k, v, q_seg, kv_seg):
    q_seg, kv_seg = (q_seg, kv_seg) if seg else (None, None)
    s = make_schedule(q_len, kv_len, bs.block_q, bs.block_k, q_segment_ids=q_seg,
                      kv_segment_ids=kv_seg, **mask)
    # The default may give the backward other tiles (its own schedule of the same mask).
    s_bwd = make_schedule(q_len, kv_len, *bs.bwd_tiles, q_segment_ids=q_seg,
                          kv_segment_ids=kv_seg, **mask)
    s_dkv = make_schedule(q_len, kv_len, *bs.dkv_tiles, q_segment_ids=q_seg,
                          kv_segment_ids=kv_seg, **mask)
    fa = lambda q, k, v: ft.flash_attention(
        q, k, v, q_seg, kv_seg, s, causal=mask.get("causal", False),
        local_window_size=mask.get("local_window_size"), scale=0.1, logits_soft_cap=cap,
        block_sizes=bs, bwd_schedule=s_bwd, dkv_schedule=s_dkv)
    (o, l), vjp = jax.vjp(fa, q, k, v)
    return vjp((o, l))

  sds = jax.ShapeDtypeStruct
  args = (sds((batch, q_len, q_heads, head_dim), dtype), sds((batch, kv_len, kv_heads, head_dim),
          dtype), sds((batch, kv_len, kv_heads, head_dim), dtype),
          sds((batch, q_len), jnp.int32), sds((batch, kv_len), jnp.int32))
  return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("case", [
    dict(batch=2, q_len=1000, kv_len=1000, q_heads=4, kv_heads=2, head_dim=128,
         dtype=jnp.bfloat16, causal=True, segments=True, soft_cap=30.0),
    dict(batch=1, q_len=300, kv_len=500, q_heads=6, kv_heads=2, head_dim=72,
         dtype=jnp.float32, causal=True, local_window_size=(64, 0)),
    dict(batch=1, q_len=256, kv_len=256, q_heads=2, kv_heads=1, head_dim=256,
         dtype=jnp.float16),
    dict(batch=1, q_len=1000, kv_len=1000, q_heads=4, kv_heads=2, head_dim=128,
         dtype=jnp.bfloat16, causal=True, dkv_block_q=True),
])
def test_lowers_to_triton(case):
  text = _lower_for_gpu(**case)
  # forward, dK/dV and dQ kernels
  n = text.count("__gpu$xla.gpu.triton") + text.count("triton_kernel_call_ffi")
  assert n == 3, n


@pytest.mark.parametrize("with_schedule", [False, True])
def test_backward_bridge_for_another_forwards_residuals(with_schedule):
  """``flash_attention_bwd`` (the Mosaic GPU forward's backward) on the reference forward's (out,
  lse): causal window, packed documents with padding, soft cap, GQA, q shorter than kv, random
  cotangents on out and LSE; without a schedule (built from the mask at the backward tiles) and
  with a block-mask schedule of its own tiles."""
  rng = np.random.default_rng(31)
  b, sq, sk, hq, hk, d = 2, 70, 90, 4, 2, 32
  q, k, v = (jnp.asarray(rng.standard_normal((b, s, h, d), np.float32))
             for s, h in ((sq, hq), (sk, hk), (sk, hk)))
  q_seg = jnp.asarray(packed_segments(rng, b, sq, pad_tail=7))
  kv_seg = jnp.concatenate([jnp.ones((b, sk - sq), jnp.int32), q_seg], axis=1)
  tile_mask = jnp.asarray(rng.random((b, hk, 3, 6)) < 0.6) if with_schedule else None
  elem = None if tile_mask is None else _tile_mask_to_elements(tile_mask, 32, 16, sq, sk)
  mask = dict(causal=True, local_window_size=(40, 0), q_segment_ids=q_seg,
              kv_segment_ids=kv_seg, logits_soft_cap=3.0)
  ref = lambda q, k, v: attention_reference(q, k, v, scale=0.2, block_mask=elem, **mask)
  out_shape, lse_shape = (x.shape for x in jax.eval_shape(ref, q, k, v))
  d_out = jnp.asarray(rng.standard_normal(out_shape, np.float32))
  d_lse = jnp.asarray(rng.standard_normal(lse_shape, np.float32))

  def ref_vjp(q, k, v, d_out, d_lse):   # the reference's residuals and VJP: one program
    (out, lse), vjp = jax.vjp(ref, q, k, v)
    return out, lse, vjp((d_out, d_lse))

  out, lse, want = jax.jit(ref_vjp)(q, k, v, d_out, d_lse)

  def bridge(q, k, v, out, lse, d_out, d_lse):
    sched = None
    if with_schedule:
      sched = make_schedule(sq, sk, 32, 16, causal=True, local_window_size=(40, 0),
                            q_segment_ids=q_seg, kv_segment_ids=kv_seg, block_mask=tile_mask)
    return ft.flash_attention_bwd(q, k, v, out, lse, d_out, d_lse, scale=0.2, schedule=sched,
                                  block_sizes=ft.BlockSizes(32, 16), interpret=True, **mask)

  got = jit_run(bridge, q, k, v, out, lse, d_out, d_lse)
  assert_grads_close(got, want, _tol(jnp.float32))
  with pytest.raises(ValueError, match="schedule tiles"):
    ft.flash_attention_bwd(q, k, v, out, lse, d_out, d_lse, scale=0.2, interpret=True,
                           schedule=make_schedule(sq, sk, 16, 16, causal=True),
                           block_sizes=ft.BlockSizes(32, 16), causal=True)


def test_h200_d256_backward_tiles_interpret():
  """The H200's tuned D256 backward (128-row dQ tiles, 32-row dK/dV and dQ steps) on
  ragged lengths with GQA, in the interpreter: the table's values, not the generic ones."""
  bs = ft.default_block_sizes(256, jnp.bfloat16, device_kind="NVIDIA H200")
  assert (bs.bwd_block_q, bs.dkv_q_chunk, bs.dq_k_chunk) == (128, 32, 32)
  got, want = _run(batch=1, q_len=150, kv_len=170, q_heads=2, kv_heads=1, head_dim=256,
                   causal=True, block_q=bs.block_q, block_k=bs.block_k, bwd_tiles=bs.bwd_tiles,
                   block_sizes=bs)
  _assert_close(got, want, jnp.float32)
