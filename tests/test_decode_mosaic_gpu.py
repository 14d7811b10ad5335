"""Mosaic GPU (Hopper) split-KV decode: what the CPU can check, and one GPU test.

Nothing here runs the kernel on the CPU (jax's Mosaic GPU interpreter has no wgmma with a
transposed or register operand). The CPU tests check
  * that the kernel lowers for "cuda" through ``jattn.decode_attention(implementation=
    "mosaic_gpu")`` (``.trace(...).lower(lowering_platforms=("cuda",))``: Pallas -> Mosaic GPU,
    wgmma/TMA constraints, the shared-memory budget), at D64/128/256, a ragged capacity and the
    B1 S128K bench shape, contiguous and paged (pages smaller than, equal to and larger than a
    tile);
  * the split walk (``_split_range``): splits tile each sequence's keys exactly once, only the
    last tile is masked, splits past the length are empty;
  * a jnp replay of the kernel's walk (per (batch, kv head, split): the same tiles of the padded
    cache, 64 padded query rows, unmasked/masked tiles, the module's online-softmax and finalize,
    P in the cache dtype, the kernel's output layout) against the fp32 reference, with mixed
    lengths (0, clamped, ragged), both directly and substituted for the kernel call
    (monkeypatch) under ``decode_attention``, so the wrapper's reshapes and the merge are tested;
    and the paged walk (one TMA per page, copies past the length redirected to the first page)
    under ``paged_decode_attention`` with NaN spare pages and garbage table entries;
  * the NotImplementedError messages and that ``implementation=None`` never picks it.
The ``gpu`` test runs the compiled kernel on an sm90 GPU against the reference.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jattn import decode as dec
from pallas_kernels import compat
from pallas_kernels.decode import mosaic_gpu as dm
from pallas_kernels.decode import reference as dref

TOL = 2e-2
_FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _rel(x, ref):
  x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def _inputs(seed, b, n, hq, hk, d, dtype=jnp.bfloat16):
  """q [b, hq, d], k/v [b, n, hk, d] (numpy's generator: no per-shape compiles on the CPU)."""
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal(shape, np.float32).astype(dtype))
               for shape in ((b, hq, d), (b, n, hk, d), (b, n, hk, d)))


def _reference(q, k, v, lengths):
  return dref.decode_reference(q, k, v, lengths, upcast=True)


def _check(out, lse, q, k, v, lengths, ref=None):
  """Results against the fp32 reference (``ref`` = its (out, lse) when already computed)."""
  if ref is None:
    fn = jax.jit(_reference)
    ref = fn.lower(q, k, v, lengths).compile(_FAST_CPU_COMPILE)(q, k, v, lengths)
  r_out, r_lse = ref
  assert out.shape == r_out.shape
  assert _rel(out, r_out) < TOL, _rel(out, r_out)
  lse, r_lse = np.asarray(lse), np.asarray(r_lse)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(r_lse))
  fin = np.isfinite(r_lse)
  np.testing.assert_allclose(lse[fin], r_lse[fin], rtol=1e-2, atol=1e-2)
  assert (np.asarray(out, np.float32)[~fin] == 0).all()   # empty sequences: zeros


# ------------------------------------------------------------------------------ lowering (CPU)

LOWER_CASES = {
    "d128_gqa4": dict(b=2, n=1024, hq=8, hk=2, d=128, splits=4),
    "d64_mha_ragged_capacity": dict(b=3, n=1000, hq=4, hk=4, d=64, splits=3),
    "d256_gqa8_fp16": dict(b=2, n=512, hq=16, hk=2, d=256, splits=2, dtype=jnp.float16),
    "d128_bk128_bench_b1_s128k": dict(b=1, n=131072, hq=32, hk=8, d=128, splits=32,
                                      bs=dm.DecodeBlockSizes(128, 2)),
}


@pytest.mark.parametrize("name", list(LOWER_CASES))
def test_lowers_for_cuda(name):
  c = dict(LOWER_CASES[name])
  dtype = c.pop("dtype", jnp.bfloat16)
  q = jax.ShapeDtypeStruct((c["b"], c["hq"], c["d"]), dtype)
  kv = jax.ShapeDtypeStruct((c["b"], c["n"], c["hk"], c["d"]), dtype)
  lens = jax.ShapeDtypeStruct((c["b"],), jnp.int32)
  fn = jax.jit(lambda q, k, v, lens: dec.decode_attention(
      q, k, v, lens, num_splits=c["splits"], return_lse=True, implementation="mosaic_gpu",
      block_sizes=c.get("bs")))
  lowered = fn.trace(q, kv, kv, lens).lower(lowering_platforms=("cuda",))
  text = lowered.as_text()
  assert "mosaic_gpu" in text and "wgmma" in text
  assert [a.shape for a in lowered.out_info] == [(c["b"], c["hq"], c["d"]), (c["b"], c["hq"])]


@pytest.mark.parametrize("page_size,d,hq,hk", [(16, 128, 8, 2), (64, 64, 4, 4), (128, 256, 16, 2)])
def test_paged_lowers_for_cuda(page_size, d, hq, hk):
  """4 TMA copies per tile (16-key pages), one per tile (64), two tiles per page (128)."""
  b, max_pages = 2, 6
  q = jax.ShapeDtypeStruct((b, hq, d), jnp.bfloat16)
  pages = jax.ShapeDtypeStruct((b * max_pages + 1, page_size, hk, d), jnp.bfloat16)
  table = jax.ShapeDtypeStruct((b, max_pages), jnp.int32)
  lens = jax.ShapeDtypeStruct((b,), jnp.int32)
  fn = jax.jit(lambda q, kp, vp, t, lens: dec.paged_decode_attention(
      q, kp, vp, t, lens, num_splits=2, return_lse=True, implementation="mosaic_gpu"))
  lowered = fn.trace(q, pages, pages, table, lens).lower(lowering_platforms=("cuda",))
  assert "wgmma" in lowered.as_text()
  assert [a.shape for a in lowered.out_info] == [(b, hq, d), (b, hq)]


def test_shared_memory_overflow_fails_to_lower():
  """The lowering checks the 227 KiB budget (so the lowering tests can fail): D256 with 3
  stages of 64-key tiles."""
  q = jax.ShapeDtypeStruct((1, 4, 256), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 256, 1, 256), jnp.bfloat16)
  lens = jax.ShapeDtypeStruct((1,), jnp.int32)
  fn = jax.jit(lambda q, k, v, lens: dm.decode_partials(
      q, k, v, lens, num_splits=2, block_sizes=dm.DecodeBlockSizes(64, 3)))
  with pytest.raises(ValueError, match="shared memory"):
    fn.trace(q, kv, kv, lens).lower(lowering_platforms=("cuda",))


def test_default_block_sizes_fit_shared_memory():
  for d in (64, 128, 256):
    assert dm.default_block_sizes(d).smem_bytes(d) < dm._SMEM_LIMIT


# ---------------------------------------------------------------------------- split walk (CPU)


def test_split_walk_covers_each_key_tile_once():
  for bk, splits, capacity in ((64, 1, 300), (64, 3, 1000), (128, 8, 1024), (64, 32, 4096)):
    st = dm._Static(block_k=bk, num_stages=2, num_splits=splits, capacity=capacity,
                    num_tiles=-(-capacity // bk), head_dim=64, group=1, scale=1.0,
                    dtype=jnp.dtype(jnp.bfloat16))
    lengths = np.array([0, 1, bk - 1, bk, bk + 1, capacity - 1, capacity, capacity + 50])
    s = np.arange(splits)
    t0, tf, t1 = (np.asarray(x) for x in dm._split_range(
        jnp.asarray(lengths)[:, None], jnp.asarray(s)[None, :], st))
    for i, length in enumerate(np.minimum(lengths, capacity)):
      tiles = np.concatenate([np.arange(a, c) for a, c in zip(t0[i], t1[i])])
      np.testing.assert_array_equal(tiles, np.arange(-(-length // bk)))   # each tile once
      masked = np.concatenate([np.arange(a, c) for a, c in zip(tf[i], t1[i])])
      want = [length // bk] if length % bk else []
      np.testing.assert_array_equal(masked, want)                       # only the ragged tail
      assert ((t0[i] <= tf[i]) & (tf[i] <= t1[i])).all()


# ------------------------------------------------------------------------------ replay (CPU)


def replay_program(q_t, st: dm._Static, length, runs, key0, kv_tile):
  """One program of ``dm.split_program`` in jnp: q_t [64, D] (padded group rows), the tiles of
  ``runs`` ((lo, hi, masked), ...; masked tiles hide keys at ``key0(t) + column >= length``),
  kv_tile(t) -> the (K, V) tiles [bk, D] the TMA copies put in the ring slot; the module's
  online softmax and finalize, P in the cache dtype -> (out [group, D] fp32, lse [64])."""
  d = st.head_dim

  def step(t, carry, masked):
    acc, m, l = carry
    k_t, v_t = kv_tile(t)
    s = jnp.dot(q_t, k_t.T, preferred_element_type=jnp.float32)       # [64, bk]
    if masked:
      cols = lax.broadcasted_iota(jnp.int32, s.shape, 1)
      s = jnp.where(cols + key0(t) < length, s, -jnp.inf)
    p, alpha, m, l = dm._online_softmax(s, m, l, st)
    acc = acc * alpha[:, None] + jnp.dot(p.astype(st.dtype), v_t,
                                         preferred_element_type=jnp.float32)
    return acc, m, l

  carry = (jnp.zeros((dm.ROWS, d), jnp.float32),
           jnp.full((dm.ROWS,), dm._M_INIT, jnp.float32), jnp.zeros((dm.ROWS,), jnp.float32))
  for lo, hi, masked in runs:
    carry = lax.fori_loop(lo, hi, functools.partial(step, masked=masked), carry)
  out, lse = dm._finalize(*carry)
  return out[:st.group], lse


def replay_grid(program, q_p, lens, st: dm._Static):
  """``program(q_t, b, h, length, split)`` over the kernel's grid -> the kernel's outputs
  o [B, S, Hk, group, D], lse [B, S, Hk, 64]."""
  b, hk = q_p.shape[:2]
  splits = jnp.arange(st.num_splits, dtype=jnp.int32)
  per_split = jax.vmap(program, in_axes=(None, None, None, None, 0))
  per_head = jax.vmap(per_split, in_axes=(0, None, 0, None, None))
  per_batch = jax.vmap(per_head, in_axes=(0, 0, None, 0, None))
  o, lse = per_batch(q_p, jnp.arange(b), jnp.arange(hk), lens, splits)   # [B, Hk, S, ...]
  return o.transpose(0, 2, 1, 3, 4), lse.transpose(0, 2, 1, 3)


def _replay_call(q_p, k, v, lens, st: dm._Static, page_table=None):
  """The kernel's walk in jnp, same inputs and outputs as ``dm._call``: q_p [B, Hk, 64, D],
  k/v [B, N', Hk, D] (padded to whole tiles) or pages [P, page_size, Hk, D] with page_table
  [B, max_pages] -> o [B, S, Hk, group, D], lse [B, S, Hk, 64]. Paged tiles are assembled from
  the kernel's copies (``dm._page_copy``: one per page, past the length the first page)."""
  bk, d = st.block_k, st.head_dim

  def tile(x, bi, h, t, length):                               # [bk, D] of tile t
    if page_table is None:
      return lax.dynamic_slice(x, (bi, t * bk, h, 0), (1, bk, 1, d)).reshape(bk, d)
    n = st.copy_rows
    parts = []
    for j in range(st.copies_per_tile):
      col, row = dm._page_copy(length, t, j, st)
      page = page_table[bi, col]
      parts.append(lax.dynamic_slice(x, (page, row, h, 0), (1, n, 1, d)).reshape(n, d))
    return jnp.concatenate(parts, 0)

  def program(q_t, bi, h, length, split):                      # q_t [64, D]
    length = dm._clamp_length(length, st)
    t0, tf, t1 = dm._split_range(length, split, st)
    return replay_program(q_t, st, length, ((t0, tf, False), (tf, t1, True)),
                          key0=lambda t: t * bk,
                          kv_tile=lambda t: (tile(k, bi, h, t, length),
                                             tile(v, bi, h, t, length)))

  return replay_grid(program, q_p, lens, st)


REPLAY_CASES = {
    # mixed lengths: empty, short, ragged, full, past the capacity (clamped)
    "d64_gqa4_mixed": dict(b=5, n=640, hq=8, hk=2, d=64, splits=4,
                           lengths=[0, 1, 130, 640, 9999]),
    "d128_mha_ragged_capacity": dict(b=3, n=333, hq=2, hk=2, d=128, splits=3,
                                     lengths=[333, 65, 400]),
    "d64_gqa8_fp16_more_splits_than_tiles": dict(b=2, n=256, hq=8, hk=1, d=64, splits=8,
                                                 lengths=[200, 64], dtype=jnp.float16),
    "d64_bk128_gqa64": dict(b=1, n=512, hq=64, hk=1, d=64, splits=2, lengths=[300],
                            bs=dm.DecodeBlockSizes(128, 2)),
}


def _case(name):
  c = dict(REPLAY_CASES[name])
  dtype = c.pop("dtype", jnp.bfloat16)
  q, k, v = _inputs(sum(map(ord, name)), c["b"], c["n"], c["hq"], c["hk"], c["d"], dtype)
  return q, k, v, jnp.asarray(c["lengths"], jnp.int32), c["splits"], c.get("bs")


# (fp16: in the paged test; gqa64: through decode_attention)
@pytest.mark.parametrize("name", [n for n in REPLAY_CASES if "fp16" not in n and "gqa64" not in n])
def test_replayed_walk_matches_reference(name, monkeypatch):
  q, k, v, lengths, splits, bs = _case(name)
  monkeypatch.setattr(dm, "_call", _replay_call)
  def partials_and_merge(q, k, v, lengths):
    o_p, lse_p = dm.decode_partials(q, k, v, lengths, num_splits=splits, block_sizes=bs)
    out, lse = dec._merge(o_p, lse_p)
    return o_p, lse_p, out.astype(q.dtype), lse, _reference(q, k, v, lengths)
  fn = jax.jit(partials_and_merge)
  o_p, lse_p, out, lse, ref = fn.lower(q, k, v, lengths).compile(_FAST_CPU_COMPILE)(
      q, k, v, lengths)
  assert o_p.shape == (q.shape[0], splits, q.shape[1], q.shape[2]) and o_p.dtype == jnp.float32
  # splits past a sequence's length are empty: lse -inf, output 0
  st = dm._static(q, k, v, splits, None, bs)
  t0, _, t1 = dm._split_range(lengths[:, None], jnp.arange(splits)[None, :], st)
  empty = np.asarray(t0 == t1)
  assert np.isneginf(np.asarray(lse_p)[empty]).all()
  assert np.isfinite(np.asarray(lse_p)[~empty]).all()
  assert (np.asarray(o_p)[empty] == 0).all()
  _check(out, lse, q, k, v, lengths, ref)


def test_replay_through_decode_attention(monkeypatch):
  """The registered path with the replay in place of the kernel: wiring, reshapes, merge."""
  q, k, v, lengths, splits, bs = _case("d64_bk128_gqa64")
  monkeypatch.setattr(dm, "_call", _replay_call)
  out, lse, ref = _decode_with_reference(q.astype(jnp.float32), k, v, lengths, splits, bs)
  assert out.dtype == jnp.float32
  _check(out, lse, q.astype(jnp.float32), k, v, lengths, ref)


def _decode_with_reference(q, k, v, lengths, splits, block_sizes=None):
  """decode_attention(implementation="mosaic_gpu") and the reference, one cheap CPU compile.
  The XLA merge: the GPU default (one Triton merge kernel) does not run on the CPU outside
  the interpreter; it is tested in tests/test_decode.py (interpreted and on the GPU)."""
  fn = jax.jit(lambda q, k, v, lens: dec.decode_attention(
      q, k, v, lens, num_splits=splits, return_lse=True, implementation="mosaic_gpu",
      block_sizes=block_sizes, merge="xla")
      + (_reference(q, k, v, lens),))
  return fn.lower(q, k, v, lengths).compile(_FAST_CPU_COMPILE)(q, k, v, lengths)


@pytest.fixture
def fresh_traces():
  """jit caches cleared before and after a test that monkeypatches a helper the kernels' jitted
  wrappers trace (a cached trace would hide the patch, or keep it for later tests)."""
  jax.clear_caches()
  yield
  jax.clear_caches()


def test_replay_check_can_fail(monkeypatch, fresh_traces):
  """A walk that drops the ragged tail's mask is caught."""
  q, k, v, lengths, splits, _ = _case("d128_mha_ragged_capacity")
  real = dm._split_range

  def no_tail_mask(length, split, st):
    t0, _, t1 = real(length, split, st)
    return t0, t1, t1
  monkeypatch.setattr(dm, "_call", _replay_call)
  monkeypatch.setattr(dm, "_split_range", no_tail_mask)
  out, lse, ref = _decode_with_reference(q, k, v, lengths, splits)
  with pytest.raises(AssertionError):
    _check(out, lse, q, k, v, lengths, ref)


def _paginate(seed, k, v, lengths, page_size, extra_pages=2):
  """Contiguous caches scattered into a shuffled page pool; spare pages hold 1e4 (K) and NaN
  (V), and table entries past each length point at a spare page or out of range (-7): reading
  one of them by mistake breaks the result."""
  b, n, hk, d = k.shape
  max_pages = -(-n // page_size)
  pad = max_pages * page_size - n
  kp, vp = (np.asarray(jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))).astype(jnp.float32))
            .reshape(b * max_pages, page_size, hk, d) for x in (k, v))
  num_pages = b * max_pages + extra_pages
  perm = np.random.default_rng(seed).permutation(num_pages)
  k_pages = np.full((num_pages, page_size, hk, d), 1e4, np.float32)
  v_pages = np.full((num_pages, page_size, hk, d), np.nan, np.float32)
  k_pages[perm[:b * max_pages]], v_pages[perm[:b * max_pages]] = kp, vp
  table = perm[:b * max_pages].reshape(b, max_pages).astype(np.int32)
  for i, length in enumerate(np.asarray(lengths)):
    used = -(-int(length) // page_size)
    table[i, used:] = np.where(np.arange(max_pages - used) % 2, -7, perm[b * max_pages])
  return (jnp.asarray(k_pages.astype(k.dtype)), jnp.asarray(v_pages.astype(v.dtype)),
          jnp.asarray(table))


PAGED_CASES = {   # name: (replay case, page_size, block_sizes)
    "ps16_4_copies_per_tile": ("d64_gqa4_mixed", 16, None),
    "ps32_ragged_capacity": ("d128_mha_ragged_capacity", 32, None),
    "ps128_two_tiles_per_page": ("d64_gqa8_fp16_more_splits_than_tiles", 128, None),
}


@pytest.mark.parametrize("name", list(PAGED_CASES))
def test_paged_replay_matches_reference(name, monkeypatch):
  """The paged walk (one TMA per page, copies past the length redirected to the first page)
  replayed under ``paged_decode_attention``, with NaN spare pages and garbage table entries."""
  case, page_size, bs = PAGED_CASES[name]
  q, k, v, lengths, splits, _ = _case(case)
  k_pages, v_pages, table = _paginate(sum(map(ord, name)), k, v, lengths, page_size)
  monkeypatch.setattr(dm, "_call", _replay_call)
  fn = jax.jit(lambda q, kp, vp, t, lens, k, v: (
      dec.paged_decode_attention(q, kp, vp, t, lens, num_splits=splits, return_lse=True,
                                 implementation="mosaic_gpu", block_sizes=bs, merge="xla"),
      _reference(q, k, v, lens)))
  args = (q, k_pages, v_pages, table, lengths, k, v)
  (out, lse), ref = fn.lower(*args).compile(_FAST_CPU_COMPILE)(*args)
  _check(out, lse, q, k, v, lengths, ref)


def test_paged_check_can_fail(monkeypatch, fresh_traces):
  """Without the redirect of copies past the length, the NaN spare pages reach the output."""
  def no_redirect(length, t, j, st):
    start = t * st.block_k + j * st.copy_rows
    return lax.div(start, jnp.int32(st.page_size)), lax.rem(start, jnp.int32(st.page_size))
  monkeypatch.setattr(dm, "_page_copy", no_redirect)
  with pytest.raises(AssertionError):
    test_paged_replay_matches_reference("ps16_4_copies_per_tile", monkeypatch)


# ------------------------------------------------------------------------------- errors (CPU)


def test_unsupported_options_raise():
  """Each unsupported option raises NotImplementedError naming it (traced with eval_shape:
  the checks run before any kernel is built)."""
  sds = jax.ShapeDtypeStruct
  bf16 = jnp.bfloat16
  q, kv, lens = sds((1, 4, 64), bf16), sds((1, 128, 1, 64), bf16), sds((1,), jnp.int32)

  def call(q=q, k=kv, v=kv, lens=lens, fn=dec.decode_attention, args=(), **kw):
    jax.eval_shape(lambda *a: fn(*a, implementation="mosaic_gpu", **kw), q, k, v, *args, lens)
  with pytest.raises(NotImplementedError, match="local_window_size"):
    call(local_window_size=(31, 0))
  with pytest.raises(NotImplementedError, match="logits_soft_cap"):
    call(logits_soft_cap=30.0)
  with pytest.raises(NotImplementedError, match="head_dim 96"):
    call(q=sds((1, 4, 96), bf16), k=sds((1, 128, 1, 96), bf16), v=sds((1, 128, 1, 96), bf16))
  with pytest.raises(NotImplementedError, match="head_dim_v"):
    call(v=sds((1, 128, 1, 32), bf16))
  with pytest.raises(NotImplementedError, match="float32"):
    call(k=sds((1, 128, 1, 64), jnp.float32), v=sds((1, 128, 1, 64), jnp.float32))
  with pytest.raises(NotImplementedError, match="interpret"):
    call(interpret=True)
  with pytest.raises(NotImplementedError, match="GQA group"):
    call(q=sds((1, 130, 64), bf16))
  with pytest.raises(NotImplementedError, match="page_size 48"):
    pages = sds((8, 48, 1, 64), bf16)
    call(k=pages, v=pages, fn=dec.paged_decode_attention, args=(sds((1, 8), jnp.int32),))
  with pytest.raises(NotImplementedError, match="logits_soft_cap"):
    pages = sds((8, 16, 1, 64), bf16)
    call(k=pages, v=pages, fn=dec.paged_decode_attention, args=(sds((1, 8), jnp.int32),),
         logits_soft_cap=5.0)
  from pallas_kernels.decode import triton as dt
  with pytest.raises(TypeError, match="DecodeBlockSizes"):
    call(block_sizes=dt.DecodeBlockSizes(64))


def test_none_never_picks_mosaic_gpu():
  for platform in ("gpu", "cpu", "tpu"):
    assert dec.resolve_decode_implementation(None, platform=platform) != "mosaic_gpu"
  assert dec.resolve_decode_implementation("mosaic_gpu") == "mosaic_gpu"


# ----------------------------------------------------------------------------------- GPU


GPU_CASES = {
    "d128_gqa4_mixed": dict(b=4, n=8192, hq=32, hk=8, d=128, lengths=[8192, 1, 3000, 0],
                            splits=None),
    "d64_mha_ragged": dict(b=2, n=1000, hq=4, hk=4, d=64, lengths=[999, 77], splits=3),
    "d256_gqa8_fp16": dict(b=1, n=2048, hq=16, hk=2, d=256, lengths=[1500], splits=4,
                           dtype=jnp.float16),
    "d128_b1_s128k_bk128": dict(b=1, n=131072, hq=32, hk=8, d=128, lengths=[131072],
                                splits=32, bs=dm.DecodeBlockSizes(128, 2)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES) + [f"paged_ps{ps}" for ps in (16, 128)])
def test_gpu_matches_reference(name):
  if compat.gpu_compute_capability() != (9, 0):
    pytest.skip(f"needs sm90 (Hopper), got {compat.gpu_compute_capability()}")
  page_size = int(name[len("paged_ps"):]) if name.startswith("paged_ps") else None
  c = dict(GPU_CASES["d128_gqa4_mixed" if page_size else name])
  dtype = c.pop("dtype", jnp.bfloat16)
  q, k, v = _inputs(sum(map(ord, name)), c["b"], c["n"], c["hq"], c["hk"], c["d"], dtype)
  lengths = jnp.asarray(c["lengths"], jnp.int32)
  if page_size:   # paged (NaN spare pages, garbage table entries past the lengths)
    k_pages, v_pages, table = _paginate(page_size, k, v, lengths, page_size)
    out, lse = jax.jit(lambda q, kp, vp, t, lens: dec.paged_decode_attention(
        q, kp, vp, t, lens, return_lse=True, implementation="mosaic_gpu"))(
            q, k_pages, v_pages, table, lengths)
  else:
    out, lse = jax.jit(lambda q, k, v, lens: dec.decode_attention(
        q, k, v, lens, num_splits=c["splits"], return_lse=True, implementation="mosaic_gpu",
        block_sizes=c.get("bs")))(q, k, v, lengths)
  _check(out, lse, q, k, v, lengths)
