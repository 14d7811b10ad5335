"""Head-major contiguous caches for sparse decode (``kv_layout="hnd"``: [batch, kv_heads, len,
head_dim]) and the sparse decode plan.

Every implementation runs "hnd" as a reshape to batch * kv_heads sequences of one kv head, so
the checks are: "hnd" on the transposed cache == "nhd" (indices, outputs, lse) and == the fp32
reference over the kept blocks, for "xla", "triton" (interpreted, both launches) and
"mosaic_tpu" (the TPU interpreter); the plan's resolution and that the call runs it;
``init_block_summaries`` / ``update_block_summaries`` in "hnd" equal the transposed "nhd"
summaries; mismatched layouts raise. The GPU test (``-m gpu``) compares the compiled Triton
kernels.
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
from pallas_kernels.sparse.decode_select import decode_width, default_score_splits
from test_sparse import _kernel_module_or_skip
from tests.helpers import normal

_FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0,
                     "xla_llvm_disable_expensive_passes": True}


def _hnd(x):
  """[b, n, hk, d] -> head-major [b, hk, n, d] (a copy, as a head-major cache would hold)."""
  return jnp.swapaxes(x, 1, 2)


def _rel(x, ref):
  x = np.asarray(x, np.float32).astype(np.float64)
  ref = np.asarray(ref, np.float32).astype(np.float64)
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def _inputs(seed, b, n, hq, hk, d, dv, dtype=jnp.float32):
  return normal(seed, (b, hq, d), (b, n, hk, d), (b, n, hk, dv), dtype=dtype)


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
@pytest.mark.parametrize("cc", [None, (9, 0)])
def test_hnd_equals_nhd_on_transposed_cache(impl, cc, monkeypatch):
  """GQA 6:2, head_dim 48 with values 32 wide, a 100-token cache in 16-token blocks (a partial
  last block); lengths 100, 0, 1 and 45 (mid-block, fewer candidates than top_k); Triton with 3
  splits, each layout with its own plan ("hnd": scores and selection in one launch, ids
  prefetched; with compute capability 9.0 two blocks per step and the merge kernel). Same kept
  blocks, same outputs and lse, equal to the fp32 reference; the empty row gives 0 and -inf."""
  if impl != "xla":
    _kernel_module_or_skip(impl)
  if cc is not None and impl != "triton":
    pytest.skip("the compute capability only changes the Triton launch")
  monkeypatch.setattr(compat, "gpu_compute_capability", lambda: cc)
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


def test_hnd_triton_kernels_read_unrepeated_lengths():
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
      kv_layout="hnd", num_splits=2))(q, kh, vh, lens, summ_h)

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
  assert len(calls) == 2                          # scores + selection, attention
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


def test_sparse_decode_plan_resolution(monkeypatch):
  """``sparse_decode_plan``: "xla" and "mosaic_tpu" take no config; "triton" on "nhd" and
  paged caches: two selection launches and ``default_num_splits``; on "hnd": one selection
  launch, one attention program per multiprocessor, ids prefetched, and on sm90 (where 3 x 2
  blocks of K/V fit in 200 KB) two blocks per step and the merge kernel. An explicit
  ``num_splits`` wins."""
  monkeypatch.setattr(compat, "gpu_core_count", lambda: 132)
  sds = jax.ShapeDtypeStruct
  n, bs, hq, hk, d, top_k = 131072, 64, 32, 8, 128, 387
  q = sds((1, hq, d), jnp.bfloat16)
  kv = sds((1, n, hk, d), jnp.bfloat16)
  plan = functools.partial(sp.sparse_decode_plan, block_size=bs, top_k=top_k)
  p = plan(q, kv, kv, implementation="xla")
  assert (p.op, p.implementation, p.config, p.backward, p.table) == (
      "sparse_decode", "xla", None, None, None)
  assert plan(q, kv, kv, implementation="mosaic_tpu").config is None
  with pytest.raises(ValueError, match="num_splits applies to the Triton kernel only"):
    plan(q, kv, kv, implementation="mosaic_tpu", num_splits=2)
  assert plan(q, kv, kv, implementation="mosaic_gpu").implementation == "triton"
  cfg = sp.decode.SparseDecodeConfig
  assert plan(q, kv, kv, implementation="triton").config == cfg(num_splits=33)
  assert plan(q, kv, kv, implementation="triton", num_splits=5).config == cfg(num_splits=5)
  table = sds((1, n // bs), jnp.int32)
  pages = sds((n // bs, bs, hk, d), jnp.bfloat16)
  assert plan(q, pages, pages, page_table=table, implementation="triton").config == cfg(33)
  for cc, dd, bs_, sm90 in (((9, 0), 128, 64, True), ((9, 0), 256, 64, False),
                            ((9, 0), 128, 128, False), ((8, 0), 128, 64, False),
                            (None, 128, 64, False)):
    monkeypatch.setattr(compat, "gpu_compute_capability", lambda cc=cc: cc)
    kvh_ = sds((1, hk, n, dd), jnp.bfloat16)
    c = sp.sparse_decode_plan(sds((1, hq, dd), jnp.bfloat16), kvh_, kvh_, block_size=bs_,
                              top_k=top_k, kv_layout="hnd", implementation="triton").config
    nb = n // bs_
    width = decode_width(nb, top_k, 1, 1)
    assert c == cfg(num_splits=sp.decode._hnd_triton_num_splits(hk, width), fused_select=True,
                    score_splits=default_score_splits(hk, 1, nb),
                    blocks_per_step=2 if sm90 else 1, prefetch_ids=True,
                    merge_kernel=sm90), (cc, dd, bs_)
  assert sp.decode._hnd_triton_num_splits(8, 389, core_count=132) == 16
  assert sp.decode._hnd_triton_num_splits(8, 26, core_count=132) == 7     # >= 4 blocks a split
  assert sp.decode._hnd_triton_num_splits(64, 389, core_count=132) == sd.default_num_splits(
      64, 1, 389, core_count=132)


@pytest.mark.parametrize("layout", ["nhd", "hnd", "paged"])
def test_sparse_decode_runs_its_plan(layout, monkeypatch):
  """The call hands the Triton kernels exactly its plan's config (selection launch, score
  splits, attention splits and launch), with and without an explicit ``num_splits``."""
  from pallas_kernels.sparse import decode_select as ds
  seen = []

  def spy(mod, name, keys):
    orig = getattr(mod, name)

    def f(*args, **kw):
      seen.append((name,) + tuple(kw.get(k) for k in keys))
      return orig(*args, **kw)
    monkeypatch.setattr(mod, name, f)
  spy(sd, "sparse_decode", ("num_splits", "blocks_per_step", "prefetch_ids", "merge_kernel"))
  spy(ds, "score_select_decode_slots", ("score_splits",))
  spy(ds, "select_decode_slots", ())
  b, n, hq, hk, d, bs = 2, 128 + 16 * ("hnd", "paged", "nhd").index(layout), 4, 2, 16, 16
  q, kc, vc = _inputs(50, b, n, hq, hk, d, d)
  lens = jnp.array([n, 37], jnp.int32)
  for ns in (None, 2):
    seen.clear()
    kw = dict(top_k=2, implementation="triton", num_splits=ns)
    if layout == "paged":
      pages, vpages = kc.reshape(b * n // bs, bs, hk, d), vc.reshape(b * n // bs, bs, hk, d)
      table = jnp.arange(b * n // bs, dtype=jnp.int32).reshape(b, n // bs)
      summ = sp.init_block_summaries(pages, lens, block_size=bs, page_table=table)
      sp.sparse_paged_decode_attention(q, pages, vpages, table, lens, summ, interpret=True, **kw)
      p = sp.sparse_decode_plan(q, pages, vpages, block_size=bs, page_table=table, **kw)
    else:
      kc_, vc_ = (kc, vc) if layout == "nhd" else (_hnd(kc), _hnd(vc))
      summ = sp.init_block_summaries(kc_, lens, block_size=bs, kv_layout=layout)
      sp.sparse_decode_attention(q, kc_, vc_, lens, summ, block_size=bs, kv_layout=layout,
                                 interpret=True, **kw)
      p = sp.sparse_decode_plan(q, kc_, vc_, block_size=bs, kv_layout=layout, **kw)
    c = p.config
    select = (("score_select_decode_slots", c.score_splits) if c.fused_select
              else ("select_decode_slots",))
    assert seen == [select, ("sparse_decode", c.num_splits, c.blocks_per_step, c.prefetch_ids,
                             c.merge_kernel)], (layout, ns, seen)
    assert ns is None or c.num_splits == ns


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
  width = decode_width(nb, top_k, 1, 1)
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
  # an "nhd" page pool read as head-major pages, and summaries of the other layout
  table = jnp.arange(n // bs, dtype=jnp.int32)[None]
  pages = kc.reshape(n // bs, bs, hk, d)
  with pytest.raises(ValueError, match="page size 2 must equal block_size 16"):
    sp.init_block_summaries(pages, lens, block_size=bs, page_table=table, kv_layout="hnd")
  with pytest.raises(ValueError, match="layout='hnd' != kv_layout='nhd'"):
    sp.sparse_paged_decode_attention(q, pages, pages, table, lens, sh, top_k=1,
                                     implementation="xla")
  with pytest.raises(ValueError, match="does not match the 'hnd' summaries"):
    sp.update_block_summaries(sh, pages, lens + 1, page_table=table)


# ------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_gpu_hnd_equals_nhd():
  """The compiled kernels on a head-major bf16 cache (B3, 8K, GQA 32:8, D128, 64-token blocks,
  lengths 8192 / 0 / 3001, default splits): the "nhd" call's indices; outputs and lse within
  bf16 rounding of it (both are sums over the same blocks, split the same way)."""
  b, n, hq, hk, d, bs, top_k = 3, 8192, 32, 8, 128, 64, 24
  q, kc, vc = _inputs(45, b, n, hq, hk, d, d, jnp.bfloat16)
  lens = jnp.array([8192, 0, 3001], jnp.int32)
  summ = sp.init_block_summaries(kc, lens, block_size=bs)
  kh, vh = _hnd(kc), _hnd(vc)
  summ_h = sp.init_block_summaries(kh, lens, block_size=bs, kv_layout="hnd")
  run = lambda *a, **x: jax.jit(functools.partial(
      sp.sparse_decode_attention, block_size=bs, top_k=top_k, return_lse=True,
      return_indices=True, implementation="triton", **x))(*a)
  out, lse, idx = run(q, kc, vc, lens, summ)
  out_h, lse_h, idx_h = run(q, kh, vh, lens, summ_h, kv_layout="hnd")
  np.testing.assert_array_equal(np.asarray(idx_h), np.asarray(idx))
  assert _rel(out_h, out) < 1e-2, _rel(out_h, out)
  np.testing.assert_array_equal(np.isneginf(np.asarray(lse_h)), np.isneginf(np.asarray(lse)))
  fin = np.isfinite(np.asarray(lse))
  np.testing.assert_allclose(np.asarray(lse_h)[fin], np.asarray(lse)[fin], rtol=1e-3, atol=1e-3)
  ref, _, _ = _reference(q, kc, vc, lens, idx, bs)
  assert _rel(out_h, ref) < 2e-2
