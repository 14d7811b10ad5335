"""Head-major contiguous caches for sparse decode (``kv_layout="hnd"``: [batch, kv_heads, len,
head_dim]).

Every implementation runs "hnd" as a reshape to batch * kv_heads sequences of one kv head, so
the checks are: "hnd" on the transposed cache == "nhd" (indices, outputs, lse) and == the fp32
reference over the kept blocks, for "xla", "triton" (interpreted) and "mosaic_tpu" (the TPU
interpreter); "mosaic_gpu" through the CPU replay of its kernel and lowered for CUDA; the
default split counts of "hnd" equal those of "nhd"; ``init_block_summaries`` /
``update_block_summaries`` in "hnd" equal the transposed "nhd" summaries; mismatched layouts
raise. GPU tests (``-m gpu``) compare the compiled Triton and Mosaic GPU kernels.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn import sparse as sp
from pallas_kernels import compat
from pallas_kernels.flash.reference import attention_reference
from pallas_kernels.sparse import decode as sd
from pallas_kernels.sparse import decode_mosaic_gpu as sm
from test_decode_mosaic_gpu import _FAST_CPU_COMPILE
from test_sparse import _kernel_module_or_skip
from test_sparse_decode_mosaic_gpu import _interpreted_triton, replayed  # noqa: F401 (fixture)


def _hnd(x):
  """[b, n, hk, d] -> head-major [b, hk, n, d] (a copy, as a head-major cache would hold)."""
  return jnp.swapaxes(x, 1, 2)


def _rel(x, ref):
  x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def _inputs(seed, b, n, hq, hk, d, dv, dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(ks[0], (b, hq, d), dtype),
          jax.random.normal(ks[1], (b, n, hk, d), dtype),
          jax.random.normal(ks[2], (b, n, hk, dv), dtype))


def _reference(q, kc, vc, lens, idx, bs):
  """fp32 attention over the kept blocks' positions < lens ("nhd" cache): out, lse, mask."""
  b, n, hk, _ = kc.shape
  idx = np.asarray(idx)
  mask = np.zeros((b, hk, 1, n), bool)
  for bi in range(b):
    for h in range(hk):
      for j in idx[bi, h][idx[bi, h] >= 0]:
        mask[bi, h, 0, j * bs:min((j + 1) * bs, int(lens[bi]))] = True
  up = lambda x: jnp.asarray(x, jnp.float32)
  out, lse = attention_reference(up(q)[:, None], up(kc), up(vc), block_mask=jnp.asarray(mask))
  return out[:, 0], lse[:, :, 0], mask


def _both_layouts(q, kc, vc, lens, bs, **kw):
  """(nhd results, hnd results) of one jitted program (one CPU compile)."""
  summ = sp.init_block_summaries(kc, lens, block_size=bs)
  kh, vh = _hnd(kc), _hnd(vc)
  summ_h = sp.init_block_summaries(kh, lens, block_size=bs, kv_layout="hnd")
  call = functools.partial(sp.sparse_decode_attention, block_size=bs, return_lse=True,
                           return_indices=True, **kw)
  fn = jax.jit(lambda q, kc, vc, kh, vh, lens, s, sh: (
      call(q, kc, vc, lens, s), call(q, kh, vh, lens, sh, kv_layout="hnd")))
  args = (q, kc, vc, kh, vh, lens, summ, summ_h)
  return fn.lower(*args).compile(_FAST_CPU_COMPILE)(*args)


# ------------------------------------------------------------------------------ CPU


@pytest.mark.parametrize("impl", ["xla", "triton", "mosaic_tpu"])
def test_hnd_equals_nhd_on_transposed_cache(impl, monkeypatch):
  """GQA 6:2, head_dim 48 with values 32 wide, a 100-token cache in 16-token blocks (a partial
  last block); lengths 100, 0, 1 and 45 (mid-block, fewer candidates than top_k); Triton with 3
  splits and the "nhd" path's launch (``_HND_TRITON_LAUNCH`` emptied; the head-major default's
  own launch: ``test_hnd_triton_default_launch``). Same kept blocks, same outputs and lse,
  equal to the fp32 reference; the empty row gives 0 and -inf."""
  if impl != "xla":
    _kernel_module_or_skip(impl)
  monkeypatch.setattr(sp.decode, "_HND_TRITON_LAUNCH", ())
  b, n, hq, hk, d, dv, bs, top_k = 4, 100, 6, 2, 48, 32, 16, 2
  q, kc, vc = _inputs(40, b, n, hq, hk, d, dv)
  lens = jnp.array([100, 0, 1, 45], jnp.int32)
  kw = dict(top_k=top_k, implementation=impl, interpret=True)
  if impl == "triton":
    kw["num_splits"] = 3
  (out, lse, idx), (out_h, lse_h, idx_h) = _both_layouts(q, kc, vc, lens, bs, **kw)
  assert out_h.shape == (b, hq, dv) and lse_h.shape == (b, hq) and idx_h.shape == idx.shape
  assert idx.shape[:2] == (b, hk)
  np.testing.assert_array_equal(np.asarray(idx_h), np.asarray(idx))
  np.testing.assert_allclose(np.asarray(out_h), np.asarray(out), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(lse_h), np.asarray(lse), rtol=1e-6, atol=1e-6)
  ref, ref_lse, mask = _reference(q, kc, vc, lens, idx, bs)
  assert mask[0].sum() < hk * n                                   # sparse: blocks were skipped
  assert _rel(out_h, ref) < 2e-3
  assert np.all(np.asarray(out_h)[1] == 0) and np.all(np.isneginf(np.asarray(lse_h)[1]))
  live = np.asarray(lens) > 0
  np.testing.assert_allclose(np.asarray(lse_h)[live], np.asarray(ref_lse)[live], rtol=1e-4,
                             atol=1e-4)


@pytest.mark.parametrize("fused", [False, True])
def test_hnd_triton_kernels_read_unrepeated_lengths(fused):
  """On a head-major cache the Triton path passes the [batch] lengths to its kernels
  (``lengths_group`` = kv_heads: sequence b * kv_heads + h reads entry b) instead of repeating
  them per kv head in XLA; the kernels reject lengths of another shape."""
  _kernel_module_or_skip("triton")
  from pallas_kernels.sparse import decode as sd
  from pallas_kernels.sparse import decode_select as ds
  b, n, hq, hk, d, bs = 2, 96, 8, 4, 16, 16
  q, kc, vc = _inputs(42, b, n, hq, hk, d, d)
  lens = jnp.array([96, 40], jnp.int32)
  kh, vh = _hnd(kc), _hnd(vc)
  summ_h = sp.init_block_summaries(kh, lens, block_size=bs, kv_layout="hnd")
  jaxpr = jax.make_jaxpr(lambda q, kh, vh, lens, s: sp.sparse_decode_attention(
      q, kh, vh, lens, s, block_size=bs, top_k=2, implementation="triton", interpret=True,
      kv_layout="hnd", num_splits=2, fused_select=fused))(q, kh, vh, lens, summ_h)

  def pallas_calls(jx):
    for e in jx.eqns:
      if e.primitive.name == "pallas_call":
        yield e
      for v in e.params.values():                 # pjit's jaxpr, cond branches, ...
        for sub in (v if isinstance(v, (tuple, list)) else (v,)):
          sub = getattr(sub, "jaxpr", sub)
          if hasattr(sub, "eqns"):
            yield from pallas_calls(sub)
  calls = list(pallas_calls(jaxpr.jaxpr))
  assert len(calls) == (2 if fused else 3)        # (scores +) selection, attention
  for e in calls:                                 # every kernel's first operand: lengths [b]
    assert e.invars[0].aval.shape == (b,), (e.params["name_and_src_info"], e.invars[0].aval)
  scores = jnp.zeros((b * hk, 1, n // bs), jnp.float32)
  with pytest.raises(ValueError, match="kv_lengths must have shape"):
    ds.select_decode_slots(scores, lens, block_size=bs, top_k=1, num_init_blocks=1,
                           num_local_blocks=1, max_selected=3, interpret=True, lengths_group=2)
  with pytest.raises(ValueError, match="lengths_group must be >= 1 and divide"):
    ds.decode_block_scores(q.reshape(b * hk, 2, d), jnp.zeros((b * hk, n // bs, 1, d)), lens,
                           block_size=bs, interpret=True, lengths_group=3)
  with pytest.raises(ValueError, match="kv_lengths must have shape"):
    sd.sparse_decode(q.reshape(b * hk, 2, d), kh.reshape(b * hk, n, 1, d),
                     vh.reshape(b * hk, n, 1, d), lens,
                     jnp.zeros((b * hk, 1, 2), jnp.int32), block_size=bs, num_splits=1,
                     interpret=True, lengths_group=2)


def test_hnd_triton_fused_select_bf16(monkeypatch):
  """The fused score + select kernel on a head-major bf16 cache (GQA 8:2, lengths not multiples
  of the block): with the "nhd" path's launch, that fused call's indices and outputs to the
  bit, and the fp32 reference."""
  _kernel_module_or_skip("triton")
  monkeypatch.setattr(sp.decode, "_HND_TRITON_LAUNCH", ())
  b, n, hq, hk, d, bs, top_k = 2, 200, 8, 2, 32, 16, 3
  q, kc, vc = _inputs(41, b, n, hq, hk, d, d, jnp.bfloat16)
  lens = jnp.array([187, 70], jnp.int32)
  kw = dict(top_k=top_k, implementation="triton", interpret=True, fused_select=True,
            num_splits=2)
  (out, lse, idx), (out_h, lse_h, idx_h) = _both_layouts(q, kc, vc, lens, bs, **kw)
  np.testing.assert_array_equal(np.asarray(idx_h), np.asarray(idx))
  assert out_h.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out_h, np.float32), np.asarray(out, np.float32))
  np.testing.assert_allclose(np.asarray(lse_h), np.asarray(lse), rtol=1e-6, atol=1e-6)
  ref, _, _ = _reference(q, kc, vc, lens, idx, bs)
  assert _rel(out_h, ref) < 2e-2


@pytest.mark.parametrize("fused", [False, True])
def test_hnd_triton_default_launch(fused):
  """The head-major path's own Triton attention launch (``_HND_TRITON_LAUNCH``: 3 stages of 1
  block per step, block ids loaded once per split; runs 90-93) on a bf16 cache, GQA 8:2, lengths not multiples of the block, an
  odd block count per split: the attention kernel is launched with it, the kept blocks are the
  "nhd" call's, and the output matches the fp32 reference and the "nhd" output to bf16
  rounding."""
  _kernel_module_or_skip("triton")
  assert dict(sp.decode._HND_TRITON_LAUNCH) == dict(num_stages=3, blocks_per_step=1,
                                              prefetch_ids=True)
  b, n, hq, hk, d, bs, top_k = 2, 200, 8, 2, 32, 16, 4
  q, kc, vc = _inputs(43, b, n, hq, hk, d, d, jnp.bfloat16)
  lens = jnp.array([187, 70], jnp.int32)
  kw = dict(top_k=top_k, implementation="triton", interpret=True, fused_select=fused,
            num_splits=3)
  (out, lse, idx), (out_h, lse_h, idx_h) = _both_layouts(q, kc, vc, lens, bs, **kw)
  np.testing.assert_array_equal(np.asarray(idx_h), np.asarray(idx))
  ref, ref_lse, _ = _reference(q, kc, vc, lens, idx, bs)
  assert _rel(out_h, ref) < 2e-2
  np.testing.assert_allclose(np.asarray(out_h, np.float32), np.asarray(out, np.float32),
                             atol=2e-2, rtol=2e-2)
  np.testing.assert_allclose(np.asarray(lse_h), np.asarray(ref_lse), rtol=2e-3, atol=2e-3)
  summ_h = sp.init_block_summaries(_hnd(kc), lens, block_size=bs, kv_layout="hnd")
  jaxpr = jax.make_jaxpr(lambda q, kh, vh, s: sp.sparse_decode_attention(
      q, kh, vh, lens, s, block_size=bs, kv_layout="hnd", **kw))(q, _hnd(kc), _hnd(vc), summ_h)
  text = str(jaxpr)
  assert "num_stages=3" in text and "num_stages=2" not in text, "attention launch options"


def test_hnd_triton_sm90_launch_merges_in_a_second_kernel(monkeypatch):
  """On sm90 (compute capability faked) the head-major launch is ``_HND_TRITON_LAUNCH_SM90``:
  3 stages of 2 blocks per step, prefetched ids, and (session 25) the splits merged by the
  merge kernel (``sparse_decode(..., merge_kernel=True)``, no arrival counters) instead of the
  last split: the same indices, and output and lse equal to the in-kernel merge's up to fp32
  rounding (the same partials, merged by the same log-sum-exp); the jaxpr has the merge
  kernel and the partials kernel, not the merged one."""
  _kernel_module_or_skip("triton")
  monkeypatch.setattr(compat, "gpu_compute_capability", lambda: (9, 0))
  b, n, hq, hk, d, bs, top_k = 2, 200, 8, 2, 32, 16, 5
  q, kc, vc = _inputs(48, b, n, hq, hk, d, d, jnp.float32)
  lens = jnp.array([187, 70], jnp.int32)
  kh, vh = _hnd(kc), _hnd(vc)
  summ_h = sp.init_block_summaries(kh, lens, block_size=bs, kv_layout="hnd")
  launch = sp.decode._hnd_triton_launch(kh, vh, bs)
  assert dict(launch) == dict(num_stages=3, blocks_per_step=2, prefetch_ids=True,
                              merge_kernel=True)
  call = lambda launch: sp.decode._hnd_decode(
      q, kh, vh, lens, summ_h, block_size=bs, top_k=top_k, num_init_blocks=1,
      num_local_blocks=1, scale=None, return_lse=True, return_indices=True,
      implementation="triton", interpret=True, num_splits=3, fused_select=True,
      score_splits=None, _launch=launch)
  out, lse, idx = call(launch)
  inline = tuple(x for x in launch if x[0] != "merge_kernel")
  out_i, lse_i, idx_i = call(inline)
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(idx_i))
  np.testing.assert_allclose(np.asarray(out), np.asarray(out_i), atol=1e-6, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_i), atol=1e-6, rtol=1e-6)
  ref, _, _ = _reference(q, kc, vc, lens, idx_i, bs)
  assert _rel(out, ref) < 2e-3
  text = str(jax.make_jaxpr(lambda q: sp.sparse_decode_attention(
      q, kh, vh, lens, summ_h, block_size=bs, top_k=top_k, kv_layout="hnd",
      implementation="triton", interpret=True, num_splits=3))(q))
  assert "jattn_sparse_decode_merge" in text and "jattn_sparse_decode_merged" not in text


@pytest.mark.parametrize("fused", [True, False])
def test_hnd_triton_select_options_reach_the_kernel(fused):
  """``_hnd_decode(..., _select=(("search_loop", "unrolled"),))`` (the probes' A/B against
  the default early bit search): the selection kernel gets the option (its jaxpr differs: no
  while loop), and indices and output are the default call's to the bit; other
  implementations refuse it."""
  _kernel_module_or_skip("triton")
  b, n, hq, hk, d, bs, top_k = 2, 200, 8, 2, 32, 16, 4
  q, kc, vc = _inputs(44, b, n, hq, hk, d, d, jnp.bfloat16)
  lens = jnp.array([187, 70], jnp.int32)
  kh, vh = _hnd(kc), _hnd(vc)
  summ_h = sp.init_block_summaries(kh, lens, block_size=bs, kv_layout="hnd")
  call = lambda select, impl="triton": functools.partial(
      sp.decode._hnd_decode, block_size=bs, return_lse=True, return_indices=True, top_k=top_k,
      num_init_blocks=1, num_local_blocks=1, scale=None, implementation=impl, interpret=True,
      num_splits=3, fused_select=fused, score_splits=None, _launch=sp.decode._HND_TRITON_LAUNCH,
      _select=select)
  unrolled = (("search_loop", "unrolled"),)
  base = call(())(q, kh, vh, lens, summ_h)
  got = call(unrolled)(q, kh, vh, lens, summ_h)
  for x, y in zip(got, base):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  loops = lambda sel: str(jax.make_jaxpr(call(sel))(q, kh, vh, lens, summ_h)).count("while[")
  assert loops(()) == loops(unrolled) + 1           # the early search's loop
  with pytest.raises(ValueError, match="_select is for the Triton"):
    sp.decode._sparse_decode(q, kc, vc, lens, sp.init_block_summaries(kc, lens, block_size=bs), None,
                      block_size=bs, top_k=top_k, num_init_blocks=1, num_local_blocks=1,
                      scale=None, return_lse=False, return_indices=False, implementation="xla",
                      interpret=True, num_splits=None, _select=unrolled)


def test_hnd_mosaic_gpu_replayed(replayed):
  """"mosaic_gpu" on a head-major cache with the CPU replay of its kernel (selection and merge
  kernels interpreted): the "nhd" call's indices, outputs and lse."""
  _interpreted_triton(replayed)
  b, n, hq, hk, d, bs = 2, 320, 4, 2, 64, 64
  q, kc, vc = _inputs(42, b, n, hq, hk, d, d, jnp.bfloat16)
  lens = jnp.array([300, 130], jnp.int32)
  (out, lse, idx), (out_h, lse_h, idx_h) = _both_layouts(
      q, kc, vc, lens, bs, top_k=1, implementation="mosaic_gpu", num_splits=2)
  np.testing.assert_array_equal(np.asarray(idx_h), np.asarray(idx))
  assert out_h.shape == (b, hq, d) and lse_h.shape == (b, hq)
  np.testing.assert_array_equal(np.asarray(out_h, np.float32), np.asarray(out, np.float32))
  np.testing.assert_allclose(np.asarray(lse_h), np.asarray(lse), rtol=1e-6, atol=1e-6)
  ref, _, _ = _reference(q, kc, vc, lens, idx, bs)
  assert _rel(out_h, ref) < 2e-2


def test_hnd_triton_default_splits(monkeypatch):
  """At B1 S128K GQA 32:8, top 387 of 2048 blocks, with the H200's 132 multiprocessors: the
  head-major Triton attention runs one program per multiprocessor (16 splits of 8 sequences)
  with 3 stages of 1 block and prefetched ids; the "nhd" call keeps ``default_num_splits``
  (33) and its own launch."""
  b, n, hq, hk, d, bs, top_k = 1, 131072, 32, 8, 128, 64, 387
  monkeypatch.setattr(compat, "gpu_core_count", lambda: 132)
  seen = []
  orig = sd.sparse_decode

  def record(*a, **kw):
    seen.append({k: kw.get(k) for k in ("num_splits", "num_stages", "blocks_per_step",
                                        "prefetch_ids")})
    return orig(*a, **kw)
  monkeypatch.setattr(sd, "sparse_decode", record)
  sds = jax.ShapeDtypeStruct
  nb = n // bs
  for layout, kv, sums in (("nhd", (b, n, hk, d), (b, nb, hk, d)),
                           ("hnd", (b, hk, n, d), (b, hk, nb, d))):
    summ = sp.BlockSummaries(sums=sds(sums, jnp.float32), lengths=sds((b,), jnp.int32),
                             block_size=bs, layout=layout)
    jax.eval_shape(lambda q, k, v, lens, s, layout=layout: sp.sparse_decode_attention(
        q, k, v, lens, s, block_size=bs, top_k=top_k, implementation="triton",
        kv_layout=layout), sds((b, hq, d), jnp.bfloat16), sds(kv, jnp.bfloat16),
        sds(kv, jnp.bfloat16), sds((b,), jnp.int32), summ)
  assert seen == [dict(num_splits=33, num_stages=None, blocks_per_step=None,
                       prefetch_ids=None),
                  dict(num_splits=16, num_stages=3, blocks_per_step=1, prefetch_ids=True)]
  assert sp.decode._hnd_triton_num_splits(8, 26, core_count=132) == 7      # >= 4 blocks per split
  # Hopper: two blocks per step where 3 x 2 stages of K and V fit in 200 KB
  kv = lambda d, dt=jnp.bfloat16: jax.ShapeDtypeStruct((1, 8, 64, d), dt)
  for cc, d, bs_, want in (((9, 0), 128, 64, sp.decode._HND_TRITON_LAUNCH_SM90),
                           ((9, 0), 256, 64, sp.decode._HND_TRITON_LAUNCH),
                           ((9, 0), 128, 128, sp.decode._HND_TRITON_LAUNCH),
                           ((8, 0), 128, 64, sp.decode._HND_TRITON_LAUNCH),
                           (None, 128, 64, sp.decode._HND_TRITON_LAUNCH)):
    monkeypatch.setattr(compat, "gpu_compute_capability", lambda cc=cc: cc)
    assert sp.decode._hnd_triton_launch(kv(d), kv(d), bs_) == want, (cc, d, bs_)
  assert dict(sp.decode._HND_TRITON_LAUNCH_SM90) == dict(num_stages=3, blocks_per_step=2,
                                                  prefetch_ids=True, merge_kernel=True)
  assert sp.decode._hnd_triton_num_splits(64, 389, core_count=132) == sd.default_num_splits(
      64, 1, 389, core_count=132) == 5                                # outside: the default


@pytest.mark.parametrize("impl", ["mosaic_gpu"])
def test_hnd_default_splits_equal_nhd(impl, monkeypatch):
  """At B1 S8K GQA 32:8 (H200 core count): the "hnd" call (8 sequences of one kv head) gets
  the same default split count as "nhd" (one sequence of 8 kv heads), > 1, and lowers for
  CUDA with the documented output shapes ("triton" has its own head-major rule, above)."""
  b, n, hq, hk, d, bs, top_k = 1, 8192, 32, 8, 128, 64, 24
  mod = sd if impl == "triton" else sm
  seen = []
  orig = mod.default_num_splits

  def record(batch, kv_heads, max_selected, **kw):
    splits = orig(batch, kv_heads, max_selected, core_count=132)
    seen.append((batch * kv_heads, max_selected, splits))
    return splits
  monkeypatch.setattr(mod, "default_num_splits", record)
  sds = jax.ShapeDtypeStruct
  nb = n // bs
  disabled = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton"),
              jax.export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2")]
  for layout, kv, sums in (("nhd", (b, n, hk, d), (b, nb, hk, d)),
                           ("hnd", (b, hk, n, d), (b, hk, nb, d))):
    summ = sp.BlockSummaries(sums=sds(sums, jnp.float32), lengths=sds((b,), jnp.int32),
                             block_size=bs, layout=layout)
    fn = lambda q, k, v, lens, s, layout=layout: sp.sparse_decode_attention(
        q, k, v, lens, s, block_size=bs, top_k=top_k, return_lse=True, return_indices=True,
        implementation=impl, kv_layout=layout)
    exp = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=disabled)(
        sds((b, hq, d), jnp.bfloat16), sds(kv, jnp.bfloat16), sds(kv, jnp.bfloat16),
        sds((b,), jnp.int32), summ)
    width = sp.decode._decode_width(nb, top_k, 1, 1)
    assert [a.shape for a in exp.out_avals] == [(b, hq, d), (b, hq), (b, hk, width)]
  assert len(seen) == 2 and seen[0] == seen[1] and seen[0][2] > 1, seen


def test_hnd_mosaic_tpu_lowers_for_tpu():
  """The bench's decode case (B1, 128K cache, GQA 32:8, D128, 64-token blocks, bf16) on a
  head-major cache lowers for TPU with the documented output shapes."""
  _kernel_module_or_skip("mosaic_tpu")
  sds = jax.ShapeDtypeStruct
  n, bs, hq, hk, d, top_k = 131072, 64, 32, 8, 128, 387
  nb = n // bs
  summ = sp.BlockSummaries(sums=sds((1, hk, nb, d), jnp.float32), lengths=sds((1,), jnp.int32),
                           block_size=bs, layout="hnd")
  f = functools.partial(sp.sparse_decode_attention, block_size=bs, top_k=top_k,
                        return_lse=True, return_indices=True, implementation="mosaic_tpu",
                        kv_layout="hnd")
  kv = sds((1, hk, n, d), jnp.bfloat16)
  exp = jax.export.export(jax.jit(f), platforms=["tpu"])(
      sds((1, hq, d), jnp.bfloat16), kv, kv, sds((1,), jnp.int32), summ)
  assert "jattn_sparse_decode_tpu" in exp.mlir_module()
  width = sp.decode._decode_width(nb, top_k, 1, 1)
  assert [a.shape for a in exp.out_avals] == [(1, hq, d), (1, hq), (1, hk, width)]


def test_hnd_summaries_equal_transposed_nhd():
  """init (ragged lengths, a partial last block) then update (one new token per sequence; a
  sequence that did not grow stays unchanged): sums, counts and means are the transposed "nhd"
  ones, and select_decode_blocks on them agrees."""
  b, n, hq, hk, d, bs = 3, 100, 6, 3, 8, 16
  q, kc, _ = _inputs(43, b, n, hq, hk, d, d)
  kh = _hnd(kc)
  lens0 = jnp.array([31, 99, 5], jnp.int32)
  lens1 = jnp.array([32, 100, 5], jnp.int32)                      # row 2 did not grow
  s = sp.update_block_summaries(sp.init_block_summaries(kc, lens0, block_size=bs), kc, lens1)
  sh0 = sp.init_block_summaries(kh, lens0, block_size=bs, kv_layout="hnd")
  sh = sp.update_block_summaries(sh0, kh, lens1)
  assert sh.layout == "hnd" and sh.num_blocks == s.num_blocks == 7
  assert sh.sums.shape == (b, hk, 7, d)
  np.testing.assert_allclose(np.asarray(sh.sums), np.swapaxes(np.asarray(s.sums), 1, 2),
                             rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(sh.lengths), [32, 100, 5])
  np.testing.assert_array_equal(np.asarray(sh.counts()), np.asarray(s.counts()))
  np.testing.assert_allclose(np.asarray(sh.means()), np.swapaxes(np.asarray(s.means()), 1, 2),
                             rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(sh.means())[1, 2, 6], np.asarray(kc[1, 96:100, 2]).mean(0),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(sh.sums)[2], np.asarray(sh0.sums)[2])
  fresh = sp.init_block_summaries(kh, lens1, block_size=bs, kv_layout="hnd")
  np.testing.assert_allclose(np.asarray(sh.sums), np.asarray(fresh.sums), rtol=1e-5, atol=1e-5)
  # explicit kv_layout equal to the summaries' is accepted
  sp.update_block_summaries(sh0, kh, lens1, kv_layout="hnd")
  sel = lambda summ: sp.select_decode_blocks(q, summ, lens1, top_k=2)
  np.testing.assert_array_equal(np.asarray(sel(sh)), np.asarray(sel(s)))


def test_layout_mismatches_raise():
  b, n, hq, hk, d, bs = 1, 64, 4, 2, 8, 16
  q, kc, _ = _inputs(44, b, n, hq, hk, d, d)
  kh = _hnd(kc)
  lens = jnp.array([40], jnp.int32)
  s = sp.init_block_summaries(kc, lens, block_size=bs)
  sh = sp.init_block_summaries(kh, lens, block_size=bs, kv_layout="hnd")
  call = functools.partial(sp.sparse_decode_attention, block_size=bs, top_k=1,
                           implementation="xla")
  with pytest.raises(ValueError, match="layout='nhd' != kv_layout='hnd'"):
    call(q, kh, kh, lens, s, kv_layout="hnd")
  with pytest.raises(ValueError, match="layout='hnd' != kv_layout='nhd'"):
    call(q, kc, kc, lens, sh)
  with pytest.raises(ValueError, match="kv_layout must be"):
    call(q, kc, kc, lens, s, kv_layout="bhsd")
  with pytest.raises(ValueError, match="kv_layout must be"):
    sp.init_block_summaries(kc, lens, block_size=bs, kv_layout="NHD")
  with pytest.raises(ValueError, match="kv_layout must be"):
    sp.BlockSummaries(sums=s.sums, lengths=s.lengths, block_size=bs, layout="hdn")
  with pytest.raises(ValueError, match="made for a 'hnd' cache"):
    sp.update_block_summaries(sh, kh, lens + 1, kv_layout="nhd")
  # an "nhd" cache passed as "hnd" (with "hnd" summaries of the right cache): shapes disagree
  with pytest.raises(ValueError, match="does not match the head-major cache"):
    call(q, kc, kc, lens, sh, kv_layout="hnd")
  # paged caches have no head-major option
  table = jnp.arange(n // bs, dtype=jnp.int32)[None]
  pages = kc.reshape(n // bs, bs, hk, d)
  with pytest.raises(ValueError, match="contiguous"):
    sp.init_block_summaries(pages, lens, block_size=bs, page_table=table, kv_layout="hnd")
  with pytest.raises(ValueError, match="layout='hnd' != kv_layout='nhd'"):
    sp.sparse_paged_decode_attention(q, pages, pages, table, lens, sh, top_k=1,
                                     implementation="xla")
  with pytest.raises(ValueError, match="contiguous"):
    sp.update_block_summaries(sh, pages, lens + 1, page_table=table)


# ------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "mosaic_gpu"])
def test_gpu_hnd_equals_nhd(impl):
  """The compiled kernels on a head-major bf16 cache (B3, 8K, GQA 32:8, D128, 64-token blocks,
  lengths 8192 / 0 / 3001, default splits): the "nhd" call's indices; outputs and lse within
  bf16 rounding of it (both are sums over the same blocks, split the same way)."""
  if impl == "mosaic_gpu" and compat.gpu_compute_capability() != (9, 0):
    pytest.skip(f"needs sm90 (Hopper), got {compat.gpu_compute_capability()}")
  b, n, hq, hk, d, bs, top_k = 3, 8192, 32, 8, 128, 64, 24
  q, kc, vc = _inputs(45, b, n, hq, hk, d, d, jnp.bfloat16)
  lens = jnp.array([8192, 0, 3001], jnp.int32)
  summ = sp.init_block_summaries(kc, lens, block_size=bs)
  kh, vh = _hnd(kc), _hnd(vc)
  summ_h = sp.init_block_summaries(kh, lens, block_size=bs, kv_layout="hnd")
  run = lambda *a, **x: jax.jit(functools.partial(
      sp.sparse_decode_attention, block_size=bs, top_k=top_k, return_lse=True,
      return_indices=True, implementation=impl, **x))(*a)
  out, lse, idx = run(q, kc, vc, lens, summ)
  out_h, lse_h, idx_h = run(q, kh, vh, lens, summ_h, kv_layout="hnd")
  np.testing.assert_array_equal(np.asarray(idx_h), np.asarray(idx))
  assert _rel(out_h, out) < 1e-2, _rel(out_h, out)
  np.testing.assert_array_equal(np.isneginf(np.asarray(lse_h)), np.isneginf(np.asarray(lse)))
  fin = np.isfinite(np.asarray(lse))
  np.testing.assert_allclose(np.asarray(lse_h)[fin], np.asarray(lse)[fin], rtol=1e-3, atol=1e-3)
  ref, _, _ = _reference(q, kc, vc, lens, idx, bs)
  assert _rel(out_h, ref) < 2e-2


@pytest.mark.gpu
def test_gpu_hnd_prefetch_ids_and_early_search():
  """Session 23's two options compiled on the GPU (B3, 8K, GQA 32:8, D128, bf16, 64-token
  blocks, lengths 8192 / 0 / 3001): the attention with and without ``prefetch_ids`` (2 stages x
  2 blocks and 3 x 1) and the selection's full bit search (``search_loop="unrolled"``) and the
  score-space search (``"kary"``, 4 and 8 trials; session 25) against the default early exit
  give the same indices, output and lse to the bit (the same blocks, split and summed in the
  same order)."""
  _kernel_module_or_skip("triton")
  b, n, hq, hk, d, bs, top_k = 3, 8192, 32, 8, 128, 64, 24
  q, kc, vc = _inputs(46, b, n, hq, hk, d, d, jnp.bfloat16)
  lens = jnp.array([8192, 0, 3001], jnp.int32)
  kh, vh = _hnd(kc), _hnd(vc)
  summ_h = sp.init_block_summaries(kh, lens, block_size=bs, kv_layout="hnd")
  call = lambda launch, select: jax.jit(functools.partial(
      sp.decode._hnd_decode, block_size=bs, return_lse=True, return_indices=True, top_k=top_k,
      num_init_blocks=1, num_local_blocks=1, scale=None, implementation="triton",
      interpret=False, num_splits=None, fused_select=True, score_splits=None, _launch=launch,
      _select=select))(q, kh, vh, lens, summ_h)
  for stages, bps in ((2, 2), (3, 1)):
    launch = (("num_stages", stages), ("blocks_per_step", bps))
    base = call(launch, ())
    for got in (call(launch + (("prefetch_ids", True),), ()),
                call(launch, (("search_loop", "unrolled"),)),
                call(launch, (("search_loop", "kary"),)),
                call(launch, (("search_loop", "kary"), ("search_trials", 8)))):
      for x, y in zip(got, base):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{launch}")
  ref, _, _ = _reference(q, kc, vc, lens, base[2], bs)
  assert _rel(base[0], ref) < 2e-2
