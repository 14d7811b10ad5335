"""Mosaic GPU (Hopper) sparse decode: what the CPU can check, and GPU tests.

The kernel (``pallas_kernels.sparse.decode_mosaic_gpu``) cannot run on the CPU (jax's Mosaic GPU
interpreter has no wgmma with a transposed or register operand). The CPU tests check
  * that the whole call (Triton scores + selection, the Mosaic GPU kernel, the Triton merge)
    lowers for "cuda" through ``jax.export``, at the B1 S128K bench shape and at awkward small
    shapes (ragged capacity, 128-token blocks = two kv tiles per block, D256 fp16, paged);
  * a jnp replay of the kernel's walk (``dm.split_program``'s program replayed by
    ``test_decode_mosaic_gpu.replay_program`` with the sparse module's own helpers: the split
    of each kv head's list, the tile -> (block, sub-tile) map, the copy redirect, the mask's
    key positions; 64 padded query rows; the kernel's output layout) substituted for the
    kernel call, against an fp64 numpy reference of attention restricted to the kept blocks:
    lists in any order with garbage past the counts, -1 slots (counts None), lengths 0 / 1 /
    ragged / past the capacity, a ragged capacity, 128-token blocks, more splits than slots,
    paged caches with NaN spare pages and garbage table entries; checks that fail without the
    mask or without the redirect;
  * the registered path ``sparse_decode_attention(implementation="mosaic_gpu")`` (selection
    and merge kernels interpreted, the replay for the kernel) against implementation="xla":
    indices identical, outputs within tolerance;
  * the NotImplementedError messages and that implementation=None never picks it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jattn import sparse as sp
from pallas_kernels import compat
from pallas_kernels.decode import mosaic_gpu as dm
from pallas_kernels.sparse import decode as sd
from pallas_kernels.sparse import decode_mosaic_gpu as sm
from pallas_kernels.sparse import decode_select as dsel
from test_decode_mosaic_gpu import _FAST_CPU_COMPILE, _paginate, replay_grid, replay_program

TOL = 2e-2


def _rel(x, ref):
  x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  ref = np.asarray(ref, np.float64)
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


# ------------------------------------------------------------------------------ lowering (CPU)


def _export(fn, *shapes):
  disabled = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton"),
              jax.export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2")]
  exp = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=disabled)(*shapes)
  return exp, exp.mlir_module()


LOWER_CASES = {   # name: (b, n, hq, hk, d, block_size, top_k, dtype, paged, splits)
    "bench_b1_s128k": (1, 131072, 32, 8, 128, 64, 387, jnp.bfloat16, False, 16),
    "d64_mha_ragged_capacity_bs128": (3, 1000, 4, 4, 64, 128, 2, jnp.bfloat16, False, 3),
    "d256_gqa8_fp16": (2, 512, 16, 2, 256, 64, 3, jnp.float16, False, 2),
    "paged_ps64_d128_gqa4": (2, 768, 8, 2, 128, 64, 4, jnp.bfloat16, True, 5),
}


@pytest.mark.parametrize("name", list(LOWER_CASES))
def test_whole_call_lowers_for_cuda(name):
  b, n, hq, hk, d, bs, top_k, dtype, paged, splits = LOWER_CASES[name]
  sds = jax.ShapeDtypeStruct
  nb = -(-n // bs)
  q = sds((b, hq, d), dtype)
  lens = sds((b,), jnp.int32)
  summ = sp.BlockSummaries(sums=sds((b, nb, hk, d), jnp.float32), lengths=sds((b,), jnp.int32),
                           block_size=bs)
  kw = dict(top_k=top_k, return_lse=True, return_indices=True, implementation="mosaic_gpu",
            num_splits=splits)
  if paged:
    pages = sds((b * nb + 1, bs, hk, d), dtype)
    fn = lambda q, kp, vp, t, lens, s: sp.sparse_paged_decode_attention(q, kp, vp, t, lens, s,
                                                                        **kw)
    exp, text = _export(fn, q, pages, pages, sds((b, nb), jnp.int32), lens, summ)
  else:
    kv = sds((b, n, hk, d), dtype)
    fn = lambda q, k, v, lens, s: sp.sparse_decode_attention(q, k, v, lens, s, block_size=bs,
                                                             **kw)
    exp, text = _export(fn, q, kv, kv, lens, summ)
  assert "mosaic_gpu_v2" in text and "wgmma" in text
  assert "__gpu$xla.gpu.triton" in text          # selection and merge stay on Triton
  width = sp.decode._decode_width(nb, top_k, 1, 1)
  assert [a.shape for a in exp.out_avals] == [(b, hq, d), (b, hq), (b, hk, width)]


def test_default_num_splits():
  assert sm.default_num_splits(1, 8, 389, core_count=132) == 16     # 128 CTAs: one wave
  assert sm.default_num_splits(32, 8, 389, core_count=132) == 1
  assert sm.default_num_splits(1, 8, 6, core_count=132) == 2       # >= 4 blocks per split


# ------------------------------------------------------------------------------ replay (CPU)


def _replay_call(q_p, k, v, lens, indices, counts, st: sm._Static, page_table=None):
  """The kernel's walk in jnp, same inputs and outputs as ``sm._call``."""
  bk, d = st.block_k, st.head_dim

  def program(q_t, bi, h, length, split):
    length = dm._clamp_length(length, st)
    begin, end = sm._split_slots(counts[bi, h], length, split, st)
    lo, hi = begin * st.tiles_per_block, end * st.tiles_per_block

    def block_of(t):
      slot, sub = sm._tile_block(t, st)
      return indices[bi, h, slot], sub

    def tile(x, t):
      col, row = sm._tile_copy(*block_of(t), length, st)
      start = (page_table[bi, col], row, h, 0) if page_table is not None else (
          bi, col * st.block_size + row, h, 0)
      return lax.dynamic_slice(x, start, (1, bk, 1, d)).reshape(bk, d)

    return replay_program(q_t, st, length, ((lo, hi, True),),
                          key0=lambda t: sm._tile_key0(*block_of(t), st),
                          kv_tile=lambda t: (tile(k, t), tile(v, t)))

  return replay_grid(program, q_p, lens, st)


def _reference(q, k, v, lengths, indices, counts, block_size):
  """fp64 numpy attention of each query head over its kv head's kept blocks (the first
  ``counts`` slots, ids >= 0) below the length -> (out [B, Hq, D], lse [B, Hq])."""
  q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
  b, hq, d = q.shape
  n, hk = k.shape[1], k.shape[2]
  g = hq // hk
  idx, cnt = np.asarray(indices), np.asarray(counts)
  out, lse = np.zeros((b, hq, d)), np.full((b, hq), -np.inf)
  pos = np.arange(n)
  for bi in range(b):
    length = min(max(int(lengths[bi]), 0), n)
    for h in range(hk):
      kept = [j for j in idx[bi, h, :cnt[bi, h]] if j >= 0]
      vis = np.isin(pos // block_size, kept) & (pos < length)
      if not vis.any():
        continue
      s = q[bi, h * g:(h + 1) * g] @ k[bi, vis, h].T / np.sqrt(d)       # [g, keys]
      m = s.max(1, keepdims=True)
      p = np.exp(s - m)
      out[bi, h * g:(h + 1) * g] = p @ v[bi, vis, h] / p.sum(1, keepdims=True)
      lse[bi, h * g:(h + 1) * g] = (m + np.log(p.sum(1, keepdims=True)))[:, 0]
  return out, lse


def _check(out, lse, ref):
  r_out, r_lse = ref
  assert out.shape == r_out.shape
  assert _rel(out, r_out) < TOL, _rel(out, r_out)
  lse = np.asarray(lse)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(r_lse))
  fin = np.isfinite(r_lse)
  np.testing.assert_allclose(lse[fin], r_lse[fin], rtol=1e-2, atol=1e-2)
  assert (np.asarray(out, np.float32)[~fin] == 0).all()    # no kept key: zeros


REPLAY_CASES = {
    # kept lists in any order, garbage past the counts; lengths 0, 1, ragged, past the capacity
    "d64_gqa4_mixed": dict(b=4, n=640, hq=8, hk=2, d=64, bs=64, splits=3,
                           lengths=[0, 1, 130, 9999]),
    # ragged capacity, 128-token blocks (two kv tiles each), more splits than slots
    "d128_mha_ragged_capacity_bs128": dict(b=2, n=333, hq=2, hk=2, d=128, bs=128, splits=4,
                                           lengths=[333, 150]),
    # counts None: -1 slots inside the lists are masked (and their copies redirected)
    "d64_gqa8_fp16_no_counts": dict(b=2, n=512, hq=8, hk=1, d=64, bs=64, splits=2,
                                    lengths=[400, 70], dtype=jnp.float16, no_counts=True),
}


def _lists(rng, lengths, b, hk, nb, bs, width, no_counts):
  """Random kept lists: visible blocks in any order (the query's block always, as the
  selection keeps it), then garbage past the counts (or -1 slots scattered, counts None)."""
  idx = rng.choice([-1, 10**6, nb + 3], size=(b, hk, width)).astype(np.int32)
  cnt = np.zeros((b, hk), np.int32)
  for bi in range(b):
    vis = -(-min(int(lengths[bi]), nb * bs) // bs)
    for h in range(hk):
      c = min(vis, int(rng.integers(1, width + 1))) if vis else 0
      kept = rng.permutation(np.setdiff1d(np.arange(vis), [vis - 1]))[:max(c - 1, 0)]
      kept = rng.permutation(np.append(kept, vis - 1)) if c else kept
      cnt[bi, h] = c
      idx[bi, h, :c] = kept
      if no_counts:
        idx[bi, h, c:] = -1
        idx[bi, h] = rng.permutation(idx[bi, h])
  return jnp.asarray(idx), (None if no_counts else jnp.asarray(cnt))


def _case(name):
  c = dict(REPLAY_CASES[name])
  dtype = c.pop("dtype", jnp.bfloat16)
  rng = np.random.default_rng(sum(map(ord, name)))
  b, n, hq, hk, d, bs = (c[x] for x in ("b", "n", "hq", "hk", "d", "bs"))
  q, k, v = (jnp.asarray(rng.standard_normal(s, np.float32).astype(dtype))
             for s in ((b, hq, d), (b, n, hk, d), (b, n, hk, d)))
  lengths = np.asarray(c["lengths"], np.int32)
  nb = -(-n // bs)
  idx, cnt = _lists(rng, lengths, b, hk, nb, bs, min(nb, 5), c.get("no_counts", False))
  return q, k, v, jnp.asarray(lengths), idx, cnt, bs, c["splits"]


def _run(name, page_size=None):
  """Partials (the replay for the kernel) + jattn.merge on case ``name``, contiguous or over
  a shuffled page pool -> (o_p, lse_p, out, lse, reference)."""
  q, k, v, lengths, idx, cnt, bs, splits = _case(name)
  cnt_ref = cnt if cnt is not None else jnp.full(idx.shape[:2], idx.shape[-1], jnp.int32)
  ref = _reference(q, k, v, lengths, idx, cnt_ref, bs)
  from jattn.merge import merge_partials

  def partials_and_merge(q, k, v, lengths, idx, cnt, table):
    o_p, lse_p = sm.sparse_decode_partials(q, k, v, lengths, idx, table, cnt, block_size=bs,
                                           num_splits=splits)
    out, lse = merge_partials(o_p, lse_p, axis=1)
    return o_p, lse_p, out, lse
  table = None
  if page_size:
    k, v, table = _paginate(sum(map(ord, name)), k, v, lengths, page_size)
  args = (q, k, v, lengths, idx, cnt, table)
  fn = jax.jit(partials_and_merge)
  return fn.lower(*args).compile(_FAST_CPU_COMPILE)(*args) + (ref, (idx, cnt_ref, lengths))


@pytest.fixture
def replayed(monkeypatch):
  """The replay in place of the kernel call, jit caches cleared around (a cached trace would
  hide the patch, or keep it for later tests)."""
  jax.clear_caches()
  monkeypatch.setattr(sm, "_call", _replay_call)
  yield monkeypatch
  jax.clear_caches()


@pytest.mark.parametrize("name", list(REPLAY_CASES))
def test_replayed_walk_matches_reference(name, replayed):
  o_p, lse_p, out, lse, ref, (idx, cnt, lengths) = _run(name)
  _check(out, lse, ref)
  # splits without slots (by the Triton kernel's split of the list) are empty
  splits = o_p.shape[1]
  n = np.where(np.asarray(lengths)[:, None] > 0, np.minimum(np.asarray(cnt), idx.shape[-1]), 0)
  per = -(-n // splits)
  empty = (np.minimum(np.arange(splits)[None, None] * per[..., None], n[..., None])
           >= n[..., None])                                             # [B, Hk, S]
  g = o_p.shape[2] // idx.shape[1]
  empty = np.repeat(empty.transpose(0, 2, 1), g, axis=2)                # [B, S, Hq]
  assert np.isneginf(np.asarray(lse_p)[empty]).all()
  assert (np.asarray(o_p)[empty] == 0).all()
  if "no_counts" not in name:    # every walked slot holds a visible key (-1 slots do not)
    assert np.isfinite(np.asarray(lse_p)[~empty & np.isfinite(ref[1])[:, None]]).all()


@pytest.mark.parametrize("name,page_size", [("d64_gqa4_mixed", 64)])
def test_paged_replay_matches_reference(name, page_size, replayed):
  """Blocks = pages of a shuffled pool with NaN spare pages and garbage table entries past
  the lengths (the lists' garbage past the counts is never walked)."""
  *_, out, lse, ref, _ = _run(name, page_size)
  _check(out, lse, ref)


def test_replay_check_fails_without_mask(replayed):
  """Keys past the length in the query's own block (and -1 slots) reach the output when the
  mask's key positions are dropped."""
  replayed.setattr(sm, "_tile_key0", lambda blk, sub, st: jnp.int32(-(1 << 20)))
  with pytest.raises(AssertionError):
    test_replayed_walk_matches_reference("d64_gqa8_fp16_no_counts", replayed)


def _paged_no_counts(name="d64_gqa8_fp16_no_counts"):
  """Case ``name`` over a shuffled page pool (NaN spare pages, garbage table entries past the
  lengths), counts None (-1 slots walked): partials, merged output, reference."""
  q, k, v, lengths, idx, _, bs, splits = _case(name)
  ref = _reference(q, k, v, lengths, idx, jnp.full(idx.shape[:2], idx.shape[-1]), bs)
  kp, vp, table = _paginate(3, k, v, lengths, bs)

  def run(*a):
    o_p, lse_p = sm.sparse_decode_partials(*a, block_size=bs, num_splits=splits)
    return (o_p, lse_p) + sd.merge_decode_partials(o_p, lse_p, interpret=True)
  return jax.jit(run)(q, kp, vp, lengths, idx, table) + (ref,)


def test_paged_minus_one_slots(replayed):
  """-1 slots read the sequence's first page (finite) and are masked: a split of -1 slots
  only is an empty partial (0, -inf), as the merge expects."""
  o_p, lse_p, out, lse, ref = _paged_no_counts()
  assert np.isfinite(np.asarray(o_p)).all()
  assert (np.asarray(o_p)[np.isneginf(np.asarray(lse_p))] == 0).all()
  assert np.isneginf(np.asarray(lse_p)).any()          # the case has such a split
  _check(out, lse, ref)


def test_paged_replay_fails_without_redirect(replayed):
  """-1 slots that read page_table[b, -1] (a garbage entry: a NaN spare page) instead of the
  sequence's first page break the partials (NaN output in a split the merge would drop)."""
  replayed.setattr(sm, "_tile_copy", lambda blk, sub, length, st: (blk, sub * st.block_k))
  with pytest.raises(AssertionError):
    test_paged_minus_one_slots(replayed)


# ------------------------------------------------------------- the registered path (CPU)


def _interpreted_triton(monkeypatch):
  """Selection and merge kernels in the interpreter (the registered path passes no
  ``interpret`` for "mosaic_gpu")."""
  def interpreted(f):
    return lambda *a, **kw: f(*a, **dict(kw, interpret=True))
  for mod, name in ((dsel, "decode_block_scores"), (dsel, "select_decode_slots"),
                    (dsel, "score_select_decode_slots"), (sd, "merge_decode_partials")):
    monkeypatch.setattr(mod, name, interpreted(getattr(mod, name)))


@pytest.mark.parametrize("paged", [False, True])
def test_registered_path_matches_xla(paged, replayed):
  """sparse_(paged_)decode_attention(implementation="mosaic_gpu"): the Triton selection
  (interpreted), the replay for the kernel, the merge kernel (interpreted) vs "xla"."""
  _interpreted_triton(replayed)
  b, n, hq, hk, d, bs, top_k = 2, 384, 4, 2, 64, 64, 2
  rng = np.random.default_rng(21)
  q, k, v = (jnp.asarray(rng.standard_normal(s, np.float32).astype(jnp.bfloat16))
             for s in ((b, hq, d), (b, n, hk, d), (b, n, hk, d)))
  lengths = jnp.asarray([384, 130] if paged else [300, 1], jnp.int32)
  summ = sp.init_block_summaries(k, lengths, block_size=bs)
  kw = dict(top_k=top_k, return_lse=True, return_indices=True)
  if paged:
    kp, vp, table = _paginate(4, k, v, lengths, bs)
    args = (q, kp, vp, table, lengths, summ)
    call = lambda impl, *a, **x: sp.sparse_paged_decode_attention(*a, implementation=impl,
                                                                  **kw, **x)
  else:
    args = (q, k, v, lengths, summ)
    call = lambda impl, *a, **x: sp.sparse_decode_attention(*a, block_size=bs,
                                                            implementation=impl, **kw, **x)
  both = jax.jit(lambda *a: (call("mosaic_gpu", *a, num_splits=2, fused_select=paged),
                             call("xla", *a)))            # one cheap CPU compile
  (out, lse, idx), (r_out, r_lse, r_idx) = both.lower(*args).compile(_FAST_CPU_COMPILE)(*args)
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(r_idx))
  assert out.dtype == q.dtype and out.shape == r_out.shape
  assert _rel(out, r_out) < TOL
  np.testing.assert_allclose(np.asarray(lse), np.asarray(r_lse), rtol=1e-2, atol=1e-2)


# ------------------------------------------------------------------------------- errors (CPU)


def test_unsupported_options_raise():
  """Each unsupported option raises NotImplementedError naming it (before any kernel)."""
  sds = jax.ShapeDtypeStruct
  bf16 = jnp.bfloat16

  def call(d=64, dv=64, hq=4, bs=64, dtype=bf16, **kw):
    n = 256
    summ = sp.BlockSummaries(sums=sds((1, n // bs, 1, d), jnp.float32),
                             lengths=sds((1,), jnp.int32), block_size=bs)
    jax.eval_shape(lambda q, k, v, lens, s: sp.sparse_decode_attention(
        q, k, v, lens, s, block_size=bs, top_k=1, implementation="mosaic_gpu", **kw),
        sds((1, hq, d), dtype), sds((1, n, 1, d), dtype), sds((1, n, 1, dv), dtype),
        sds((1,), jnp.int32), summ)
  call()   # supported: traces
  with pytest.raises(NotImplementedError, match="block_size 32"):
    call(bs=32)
  with pytest.raises(NotImplementedError, match="head_dim_v"):
    call(dv=32)
  with pytest.raises(NotImplementedError, match="head_dim 96"):
    call(d=96, dv=96)
  with pytest.raises(NotImplementedError, match="float32"):
    call(dtype=jnp.float32)
  with pytest.raises(NotImplementedError, match="interpret"):
    call(interpret=True)
  with pytest.raises(NotImplementedError, match="GQA group"):
    call(hq=65)
  with pytest.raises(TypeError, match="DecodeBlockSizes"):
    sm._static(sds((1, 4, 64), bf16), sds((1, 256, 1, 64), bf16), sds((1, 256, 1, 64), bf16),
               block_size=64, num_splits=1, num_slots=2, scale=None, block_sizes=(64, 2),
               capacity=256)


def test_none_never_picks_mosaic_gpu():
  for platform in ("gpu", "tpu", "cpu"):
    assert sp.decode._resolve_decode_implementation(None, platform) != "mosaic_gpu"
  assert sp.decode._resolve_decode_implementation("mosaic_gpu") == "mosaic_gpu"


# ----------------------------------------------------------------------------------- GPU


def _gpu_inputs(seed, b, n, hq, hk, d, bs, lengths):
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.standard_normal(s, np.float32).astype(jnp.bfloat16))
             for s in ((b, hq, d), (b, n, hk, d), (b, n, hk, d)))
  lengths = jnp.asarray(lengths, jnp.int32)
  return q, k, v, lengths, sp.init_block_summaries(k, lengths, block_size=bs)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["b1_s128k_bench", "b3_mixed", "b3_mixed_paged"])
def test_gpu_matches_xla(name):
  """The compiled kernel vs implementation="xla": indices identical, outputs within tolerance
  (bench shape with the default splits; mixed lengths incl. 0 and 1, 3 splits, contiguous and
  paged with NaN spare pages)."""
  if compat.gpu_compute_capability() != (9, 0):
    pytest.skip(f"needs sm90 (Hopper), got {compat.gpu_compute_capability()}")
  bs = 64
  if name == "b1_s128k_bench":
    b, n, hq, hk, d, lengths, top_k, splits = 1, 131072, 32, 8, 128, [131072], 387, None
  else:
    b, n, hq, hk, d, lengths, top_k, splits = 3, 8192, 32, 8, 128, [8192, 0, 3001], 24, 3
  q, k, v, lengths, summ = _gpu_inputs(sum(map(ord, name)), b, n, hq, hk, d, bs, lengths)
  kw = dict(top_k=top_k, return_lse=True, return_indices=True)
  if name.endswith("paged"):
    kp, vp, table = _paginate(5, k, v, lengths, bs)
    run = lambda impl, **x: jax.jit(functools.partial(
        sp.sparse_paged_decode_attention, implementation=impl, **kw, **x))(
            q, kp, vp, table, lengths, summ)
  else:
    run = lambda impl, **x: jax.jit(functools.partial(
        sp.sparse_decode_attention, block_size=bs, implementation=impl, **kw, **x))(
            q, k, v, lengths, summ)
  out, lse, idx = run("mosaic_gpu", num_splits=splits)
  r_out, r_lse, r_idx = run("xla")
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(r_idx))
  assert _rel(out, r_out) < TOL, _rel(out, r_out)
  np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(np.asarray(r_lse)))
  fin = np.isfinite(np.asarray(r_lse))
  np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(r_lse)[fin], rtol=1e-2, atol=1e-2)
