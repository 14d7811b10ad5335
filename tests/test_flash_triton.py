"""Pallas Triton flash attention vs the fp32 reference: forward (out, LSE) and VJP.

On the CPU the kernels run in the Pallas interpreter (``interpret=True``) at small sizes, and the
Triton lowering itself is checked by lowering for the "cuda" platform (no GPU needed). Tests
marked ``gpu`` run the compiled kernels.
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

TOL = {jnp.float32: 2e-3, jnp.bfloat16: 2e-2, jnp.float16: 2e-2}
# Interpret-mode programs are big and run once: cheap CPU codegen halves the test time. The
# options change only how XLA:CPU optimises the test harness, not what is computed.
_FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _compile_and_run(fn, *args, interpret=True):
  lowered = jax.jit(fn).lower(*args)
  on_cpu = interpret and jax.default_backend() == "cpu"
  compiled = lowered.compile(_FAST_CPU_COMPILE) if on_cpu else lowered.compile()
  return compiled(*args)


def _rel(a, b):
  a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _check_lse(lse, ref_lse, tol):
  lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
  assert np.isfinite(lse[~np.isneginf(ref_lse)]).all()
  fin = np.isfinite(ref_lse)
  assert _rel(np.where(fin, lse, 0.0), np.where(fin, ref_lse, 0.0)) < tol


def _tile_mask_to_elements(tile_mask, block_q, block_k, q_len, kv_len):
  m = jnp.repeat(jnp.repeat(tile_mask, block_q, axis=-2), block_k, axis=-1)
  return m[..., :q_len, :kv_len]


def _segments(rng, batch, length, *, pad_tail=0, one_token_docs=False):
  """Random packed-document ids in 1..: documents of random lengths, 0 for the padded tail."""
  out = np.zeros((batch, length), np.int32)
  for b in range(batch):
    pos, doc = 0, 1
    while pos < length - pad_tail:
      n = 1 if one_token_docs and doc % 2 else int(rng.integers(1, max(2, length // 3)))
      out[b, pos:min(pos + n, length - pad_tail)] = doc
      pos += n
      doc += 1
  return jnp.asarray(out)


def _run(*, batch=1, q_len=64, kv_len=None, q_heads=2, kv_heads=None, head_dim=32,
         head_dim_v=None, dtype=jnp.float32, causal=False, window=None, segments=None,
         soft_cap=None, block_q=32, block_k=16, bwd_tiles=None, tile_mask=None, poison=None,
         seed=0, interpret=True, dkv_tiles=None, **kernel_kwargs):
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
                           **kernel_kwargs)
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
  got = _compile_and_run(kernel_run, q, k_in, v_in, q_seg, kv_seg, tile_mask,
                         interpret=interpret)
  want = _compile_and_run(ref_run, q, k, v, tile_mask, interpret=interpret)
  return got, want


def _assert_close(got, want, dtype):
  tol = TOL[dtype]
  (out, lse, grads), (r_out, r_lse, r_grads) = got, want
  assert out.dtype == dtype and lse.dtype == jnp.float32
  assert out.shape == r_out.shape and lse.shape == r_lse.shape
  assert np.isfinite(np.asarray(out, np.float32)).all()
  assert _rel(out, r_out) < tol, ("out", _rel(out, r_out))
  _check_lse(lse, r_lse, tol)
  for name, g, r in zip(("dq", "dk", "dv"), grads, r_grads):
    assert g.shape == r.shape and g.dtype == r.dtype, (name, g.shape, r.shape)
    assert np.isfinite(np.asarray(g, np.float32)).all(), name
    assert _rel(g, r) < tol, (name, _rel(g, r))


CASES = {
    # all tiles full (no masking code runs), MQA, batch 2, v head dim != qk head dim
    "dense_mqa_dv48": dict(batch=2, q_len=64, q_heads=4, kv_heads=1, head_dim_v=48),
    # head_dim 72 (padded to 128 inside), seq 100, GQA 4:2, soft cap
    "causal_d72_gqa_softcap": dict(q_len=100, head_dim=72, q_heads=4, kv_heads=2,
                                   causal=True, soft_cap=2.0),
    "causal_q_shorter": dict(q_len=40, kv_len=100, causal=True),
    # q_len > kv_len causal: the first 60 queries see no key (0 output, -inf LSE, 0 grads)
    "causal_q_longer_empty_rows": dict(q_len=100, kv_len=40, causal=True),
    "window_int_seq130": dict(q_len=130, window=20),
    # (left, 0) window with causal; tiles split into chunks in both backward kernels
    "window_left_causal_chunked": dict(q_len=130, window=(24, 0), causal=True, block_q=32,
                                       block_k=32, dkv_q_chunk=16, dq_k_chunk=16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference_fp32(name):
  got, want = _run(**CASES[name])
  _assert_close(got, want, jnp.float32)
  if name == "causal_q_longer_empty_rows":
    out, lse, (dq, _, _) = got
    assert np.all(np.asarray(out[:, :60]) == 0) and np.all(np.isneginf(np.asarray(lse[..., :60])))
    assert np.all(np.asarray(dq[:, :60]) == 0)


def test_segment_ids_padding_and_one_token_docs():
  rng = np.random.default_rng(1)
  q_len, kv_len = 90, 110
  q_seg = _segments(rng, 2, q_len, pad_tail=17, one_token_docs=True)
  q_seg = q_seg.at[1].set(0)  # batch row 1 fully padded: every query sees no key
  kv_seg = jnp.concatenate([jnp.full((2, kv_len - q_len), 1, jnp.int32), q_seg], axis=1)
  got, want = _run(batch=2, q_len=q_len, kv_len=kv_len, q_heads=4, kv_heads=2, causal=True,
                   window=(40, 0), segments=(q_seg, kv_seg))
  _assert_close(got, want, jnp.float32)
  out, lse, grads = got
  assert np.all(np.asarray(out[1]) == 0) and np.all(np.isneginf(np.asarray(lse[1])))
  assert np.all(np.asarray(grads[0][1]) == 0)


@pytest.mark.parametrize("causal", [True, False])
def test_segment_layouts_padding_at_either_end_and_negative_ids(causal):
  """Packed rows with the padding (id 0) at the end (the last q tile straddles a document and the
  padding: it visits only that document's kv tiles), at the start, and with negative ids (ordinary
  ids: tiles of only negative ids used to be skipped), lengths that are multiples of no tile:
  forward + VJP against the fp32 reference."""
  rng = np.random.default_rng(23)
  n = 93
  right = np.asarray(_segments(rng, 1, n, pad_tail=11))[0]
  left = np.concatenate([np.zeros(13, np.int32), np.asarray(_segments(rng, 1, n - 13))[0]])
  seg = jnp.asarray(np.stack([right, left, -right]))
  got, want = _run(batch=3, q_len=n, q_heads=4, kv_heads=2, causal=causal, segments=(seg, seg),
                   block_q=32, block_k=16, bwd_tiles=(16, 32), seed=29)
  _assert_close(got, want, jnp.float32)
  assert np.all(np.asarray(got[0])[0, n - 11:] == 0)   # padding rows: output 0


@pytest.mark.parametrize("fwd_tiles,bwd_tiles", [((16, 16), (32, 16)), ((32, 16), (16, 32))])
def test_forward_and_backward_tiles_differ(fwd_tiles, bwd_tiles):
  """The backward walks its own schedule with other tiles (out/LSE are per row): causal + window
  + packed segments with padding + GQA, lengths that are multiples of no tile, random
  cotangents on out and LSE."""
  rng = np.random.default_rng(5)
  q_len, kv_len = 75, 91
  q_seg = _segments(rng, 2, q_len, pad_tail=6)
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
  seg = _segments(rng, b, n, pad_tail=9)
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
  got = _compile_and_run(jax.value_and_grad(functools.partial(loss, kern), argnums=(0, 1, 2)),
                         q, k, v)
  want = jax.value_and_grad(functools.partial(loss, ref), argnums=(0, 1, 2))(q, k, v)
  for g, r in zip(got[1], want[1]):
    assert _rel(g, r) < TOL[jnp.bfloat16], _rel(g, r)
  s = make_schedule(32, 32, 16, 16, causal=True)
  kw = dict(causal=True, local_window_size=None, scale=0.1, logits_soft_cap=None, interpret=True)
  x = jnp.zeros((1, 32, 1, 16))
  with pytest.raises(ValueError, match="dK/dV tiles"):
    ft.flash_attention(x, x, x, None, None, s, block_sizes=ft.BlockSizes(16, 16, dkv_block_q=32),
                       **kw)
  with pytest.raises(ValueError, match="dkv_schedule block_k"):
    ft.flash_attention(x, x, x, None, None, s,
                       dkv_schedule=make_schedule(32, 32, 16, 32, causal=True), **kw)


@pytest.mark.parametrize("case", [
    # causal, q shorter than kv (bottom-right: the q spans are shifted against the kv spans),
    # GQA 6:2 (dK/dV summed over 3 heads in-kernel, dQ for 3 heads per program), lengths that
    # are multiples of no tile, soft cap; 32x16 backward tiles: two kv tiles per program
    dict(batch=2, q_len=75, kv_len=91, q_heads=6, kv_heads=2, causal=True, soft_cap=2.0,
         block_q=16, block_k=16, bwd_tiles=(32, 16)),
    # q longer than kv (60 empty rows), causal window, MQA 4:1; 16x32 backward tiles: two q
    # tiles per program, and q spans that no program's kv span reaches
    dict(q_len=100, kv_len=40, q_heads=4, kv_heads=1, causal=True, window=(30, 0), block_q=16,
         block_k=16, bwd_tiles=(16, 32)),
])
def test_fused_bwd_matches_reference(case):
  """``BlockSizes.fused_bwd`` (one backward kernel: dK/dV of kv span t, then dQ of q span
  t - shift): forward + VJP vs the fp32 reference."""
  bs = ft.BlockSizes(case["block_q"], case["block_k"], bwd_block_q=case["bwd_tiles"][0],
                     bwd_block_k=case["bwd_tiles"][1], fused_bwd=True)
  got, want = _run(block_sizes=bs, seed=13, **case)
  _assert_close(got, want, jnp.float32)
  if case["q_len"] > case["kv_len"]:
    out, lse, (dq, _, _) = got
    assert np.all(np.asarray(dq[:, :60]) == 0) and np.all(np.isneginf(np.asarray(lse[..., :60])))


def test_fused_bwd_segments_dkv_block_q_and_bridge():
  """The fused backward with packed documents + padding, GQA 4:2, awkward lengths and the dK/dV
  phase on its own 16-row q tiles: vs the reference and vs the two-kernel backward (same terms in
  the same order); the Mosaic GPU forward's bridge (``flash_attention_bwd``) with the option; and
  the timing switch it cannot honour."""
  rng = np.random.default_rng(21)
  n = 70
  seg = _segments(rng, 2, n, pad_tail=5)
  case = dict(batch=2, q_len=n, q_heads=4, kv_heads=2, causal=True, segments=(seg, seg),
              block_q=16, block_k=16, bwd_tiles=(32, 16), dkv_tiles=(16, 16), seed=5)
  bs = ft.BlockSizes(16, 16, bwd_block_q=32, bwd_block_k=16, dkv_block_q=16, dkv_q_chunk=16,
                     fused_bwd=True)
  got, want = _run(block_sizes=bs, **case)
  _assert_close(got, want, jnp.float32)
  two, _ = _run(block_sizes=dataclasses.replace(bs, fused_bwd=False), **case)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(two)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)

  q, k, v = (jnp.asarray(rng.standard_normal((1, s, h, 16), np.float32))
             for s, h in ((40, 2), (56, 1), (56, 1)))
  out, lse = attention_reference(q, k, v, causal=True)
  d_out = jnp.asarray(rng.standard_normal(out.shape, np.float32))
  got = _compile_and_run(
      lambda *a: ft.flash_attention_bwd(*a, causal=True, scale=0.25, interpret=True,
                                        block_sizes=ft.BlockSizes(16, 16, bwd_block_q=32,
                                                                  fused_bwd=True)),
      q, k, v, out, lse, d_out, jnp.zeros_like(lse))
  _, vjp = jax.vjp(lambda q, k, v: attention_reference(q, k, v, causal=True, scale=0.25)[0],
                   q, k, v)
  for a, b in zip(got, vjp(d_out)):
    assert _rel(a, b) < TOL[jnp.float32], _rel(a, b)

  s = make_schedule(32, 32, 16, 16, causal=True)
  x = jnp.zeros((1, 32, 1, 16))
  with pytest.raises(ValueError, match="fused_bwd runs dQ, dK and dV in one kernel"):
    ft.flash_attention(x, x, x, None, None, s, causal=True, local_window_size=None, scale=0.1,
                       logits_soft_cap=None, interpret=True, _bwd_parts="dkv",
                       block_sizes=ft.BlockSizes(16, 16, fused_bwd=True))


def test_bwd_parts_run_one_kernel():
  """The timing switch ``_bwd_parts``: "dkv" / "dq" give that kernel's gradients bit for bit and
  zeros for the other's; "none" gives zeros."""
  rng = np.random.default_rng(3)
  q, k, v = (jnp.asarray(rng.standard_normal((1, 40, h, 16), np.float32)) for h in (4, 2, 2))
  s = make_schedule(40, 40, 16, 16, causal=True)

  def grads(parts):
    f = lambda q, k, v: ft.flash_attention(
        q, k, v, None, None, s, causal=True, local_window_size=None, scale=0.25,
        logits_soft_cap=None, interpret=True, _bwd_parts=parts)[0]
    return _compile_and_run(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2)),
                            q, k, v)

  full = grads("all")
  for parts, keep in (("dkv", (1, 2)), ("dq", (0,)), ("none", ())):
    got = grads(parts)
    for i in range(3):
      want = full[i] if i in keep else jnp.zeros_like(full[i])
      np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(want))
  with pytest.raises(ValueError, match="_bwd_parts"):
    ft.flash_attention(q, k, v, None, None, s, causal=True, local_window_size=None, scale=0.25,
                       logits_soft_cap=None, interpret=True, _bwd_parts="dk")


@pytest.mark.parametrize("batch,heads", [(2, 16), (1, 6), (3, 5)])
@pytest.mark.parametrize("group", [None, 1, 2, 8])
def test_launch_order_visits_every_program_once(batch, heads, group):
  """Every launch order maps its grid one-to-one onto (tile, batch, head), tiles in heaviest-first
  order within each group of (batch, head) pairs."""
  import itertools
  st = ft._Static(block_q=32, block_k=32, q_len=64, kv_len=64, causal=True, window=None,
                  scale=1.0, soft_cap=None, num_warps=4, num_stages=2, bwd_num_warps=4,
                  bwd_num_stages=2, dkv_q_chunk=16, dq_k_chunk=16, interpret=True,
                  head_group=group)
  n = 7
  grid, tile_axis, index = ft._launch_order(st, n, batch, heads)
  seen = [index(*p) for p in itertools.product(*map(range, grid))]
  assert sorted(seen) == sorted(itertools.product(range(n), range(batch), range(heads)))
  assert all(p[tile_axis] == index(*p)[0] for p in itertools.product(*map(range, grid)))
  if grid[0] == n:  # per-(batch, head) order: only used when no group > 1 divides the programs
    assert group == 1 or (batch * heads) % 2


def test_launch_orders_give_identical_results():
  """The grouped heaviest-first launch order (default for causal) and the per-head order compute
  the same tiles: outputs, LSE and gradients agree bit for bit (GQA 6:3, segment ids, padding)."""
  rng = np.random.default_rng(11)
  q_seg = _segments(rng, 2, 70, pad_tail=5)
  runs = [_run(batch=2, q_len=70, q_heads=6, kv_heads=3, causal=True,
               segments=(q_seg, q_seg), block_sizes=ft.BlockSizes(32, 16, head_group=g),
               seed=3) for g in (1, None, 4)]
  for got, _ in runs[1:]:
    for a, b in zip(jax.tree.leaves(runs[0][0]), jax.tree.leaves(got)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  _assert_close(*runs[1], jnp.float32)
  with pytest.raises(ValueError, match="head_group"):
    _run(q_len=32, causal=True, block_sizes=ft.BlockSizes(32, 16, head_group=0))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision(dtype):
  got, want = _run(q_len=72, q_heads=4, kv_heads=2, head_dim=64, dtype=dtype, causal=True)
  _assert_close(got, want, dtype)


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


@pytest.mark.parametrize("seed", [11, 12])
def test_random_mask_layouts(seed):
  """Seeded random combinations of lengths, tiles, causal, window, segments and GQA."""
  rng = np.random.default_rng(seed)
  q_len, kv_len = (int(x) for x in rng.integers(17, 140, size=2))
  kv_heads = int(rng.choice([1, 2]))
  window = [None, int(rng.integers(0, 40)),
            (int(rng.integers(0, 60)), None if rng.random() < 0.3 else int(rng.integers(0, 20)))
            ][int(rng.integers(0, 3))]
  segments = None
  if rng.random() < 0.5:
    q_seg = _segments(rng, 1, q_len, pad_tail=int(rng.integers(0, 9)))
    kv_seg = _segments(rng, 1, kv_len, pad_tail=int(rng.integers(0, 9)))
    segments = (q_seg, kv_seg)
  case = dict(q_len=q_len, kv_len=kv_len, q_heads=2 * kv_heads, kv_heads=kv_heads,
              causal=bool(rng.random() < 0.5), window=window, segments=segments,
              block_q=int(rng.choice([16, 32])), block_k=int(rng.choice([16, 32])), seed=seed)
  got, want = _run(**case)
  _assert_close(got, want, jnp.float32)


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
  if mask.pop("fused_bwd", None):  # one backward kernel
    bs = dataclasses.replace(bs, fused_bwd=True)
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
    # the fused backward: bf16 D128 default tiles (two 64-row kv tiles per 128-row span) with
    # segments and soft cap, q shorter than kv; fp32 GQA 6:2 window, q longer than kv
    dict(batch=2, q_len=1000, kv_len=1100, q_heads=4, kv_heads=2, head_dim=128,
         dtype=jnp.bfloat16, causal=True, segments=True, soft_cap=30.0, fused_bwd=True),
    dict(batch=1, q_len=500, kv_len=300, q_heads=6, kv_heads=2, head_dim=72,
         dtype=jnp.float32, causal=True, local_window_size=(64, 0), dkv_block_q=True,
         fused_bwd=True),
])
def test_lowers_to_triton(case):
  fused = case.get("fused_bwd", False)
  text = _lower_for_gpu(**case)
  # forward, dK/dV and dQ kernels (forward and one fused backward kernel)
  n = text.count("__gpu$xla.gpu.triton") + text.count("triton_kernel_call_ffi")
  assert n == (2 if fused else 3), n
  assert ("jattn_flash_bwd_fused" in text) == fused


# ------------------------------------------------------------------------------------------
# GPU: the compiled kernels (run with `pytest -m gpu` on a GPU machine).
# ------------------------------------------------------------------------------------------

GPU_CASES = {
    "bf16_d128_causal_gqa": dict(batch=2, q_len=1000, q_heads=8, kv_heads=2, head_dim=128,
                                 dtype=jnp.bfloat16, causal=True),
    "fp32_d72_window": dict(batch=1, q_len=777, kv_len=900, q_heads=4, kv_heads=2, head_dim=72,
                            causal=True, window=(63, 0)),
    "fp32_d128_dense_softcap": dict(batch=1, q_len=513, head_dim=128, soft_cap=20.0),
    "fp16_d96_mqa": dict(batch=2, q_len=640, q_heads=4, kv_heads=1, head_dim=96,
                         dtype=jnp.float16, causal=True),
    "bf16_d256": dict(batch=1, q_len=384, head_dim=256, dtype=jnp.bfloat16, causal=True),
    # D256 with ragged lengths and GQA: the H200's tuned D256 backward (run 29) uses 128-row dQ
    # tiles and 32-row dK/dV steps, so neither length is a multiple of a tile.
    "bf16_d256_ragged_gqa": dict(batch=1, q_len=1000, kv_len=1111, q_heads=4, kv_heads=2,
                                 head_dim=256, dtype=jnp.bfloat16, causal=False),
    "bf16_d64_segments": dict(batch=2, q_len=1024, head_dim=64, dtype=jnp.bfloat16,
                              segments="packed"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_matches_reference(name):
  case = dict(GPU_CASES[name])
  dtype = case.get("dtype", jnp.float32)
  bs = ft.default_block_sizes(case["head_dim"], dtype)
  if case.get("segments") == "packed":
    seg = _segments(np.random.default_rng(0), case["batch"], case["q_len"], pad_tail=100)
    case["segments"] = (seg, seg)
  dkv = None if bs.dkv_tiles == bs.bwd_tiles else bs.dkv_tiles  # the default's own dK/dV tiles
  got, want = _run(block_q=bs.block_q, block_k=bs.block_k, bwd_tiles=bs.bwd_tiles, block_sizes=bs,
                   dkv_tiles=dkv, interpret=False, **case)
  _assert_close(got, want, dtype)


def test_h200_d256_backward_tiles_interpret():
  """The H200's tuned D256 backward (run 29: 128-row dQ tiles, 32-row dK/dV and dQ steps) on
  ragged lengths with GQA, in the interpreter: the table's values, not the generic ones."""
  bs = ft.default_block_sizes(256, jnp.bfloat16, device_kind="NVIDIA H200")
  assert (bs.bwd_block_q, bs.dkv_q_chunk, bs.dq_k_chunk) == (128, 32, 32)
  got, want = _run(batch=1, q_len=150, kv_len=170, q_heads=2, kv_heads=1, head_dim=256,
                   causal=True, block_q=bs.block_q, block_k=bs.block_k, bwd_tiles=bs.bwd_tiles,
                   block_sizes=bs)
  _assert_close(got, want, jnp.float32)
