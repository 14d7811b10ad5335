"""``pallas_kernels.sparse.decode_one_launch``: block scores, selection and attention in one
Triton launch (programs take roles by ticket; attention splits wait on their (batch, kv head)'s
ready flag).

Interpreted on the CPU: the lists and counts equal ``score_select_decode_slots``' to the bit,
the output and lse equal ``decode.sparse_decode``'s on those lists (same launch options) to
the bit and the fp32 reference over the kept blocks within 2e-3, on an "nhd" cache and on a
head-major cache seen as batch x kv_heads sequences (``lengths_group``), with lengths 0, 1 and
ragged, a block count that is not a power of two, GQA 3:1, head_dim 48 and values of 32.
Lowered for CUDA (on the CPU) at the issue-5 shape: one Triton call. GPU tests (``-m gpu``)
compare the compiled kernel with the two-launch path.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn import sparse as sp
from pallas_kernels.sparse import decode as sd
from pallas_kernels.sparse.decode_one_launch import sparse_decode_one_launch
from pallas_kernels.sparse.decode_select import score_select_decode_slots
from test_sparse import _kernel_module_or_skip
from test_sparse_decode_layout import _hnd, _inputs, _reference, _rel


def _two_launches(q, k, v, lens, sums, slens, *, bs, top_k, width, splits, score_splits,
                  lengths_group, interpret, **launch):
  """The default path's two kernels (scores + selection, then the merged attention)."""
  idx, cnt, arr = score_select_decode_slots(
      q, sums, slens, lens, block_size=bs, top_k=top_k, num_init_blocks=1,
      num_local_blocks=1, max_selected=width, score_splits=score_splits, chunk=16,
      return_arrivals=True, lengths_group=lengths_group, interpret=interpret)
  out, lse = sd.sparse_decode(q, k, v, lens, idx, None, cnt, arr, block_size=bs,
                              num_splits=splits, lengths_group=lengths_group,
                              interpret=interpret, **launch)
  return out, lse, idx, cnt


@pytest.mark.parametrize("layout,splits,score_splits,launch", [
    ("nhd", 3, 2, dict(num_stages=2, blocks_per_step=2, prefetch_ids=True)),
    ("hnd", 2, 1, dict(num_stages=3, blocks_per_step=1, prefetch_ids=False)),
    ("hnd", 5, 3, dict(num_stages=3, blocks_per_step=1, prefetch_ids=True)),
    ("nhd", 1, 3, dict(num_stages=3, blocks_per_step=1, prefetch_ids=False))])
def test_one_launch_equals_two_launches(layout, splits, score_splits, launch):
  _kernel_module_or_skip("triton")
  b, n, hq, hk, d, dv, bs, top_k = 4, 600, 6, 2, 48, 32, 16, 6
  q, kc, vc = _inputs(71, b, n, hq, hk, d, dv)
  lens_l = [587, 0, 1, 270]                   # 38 blocks: 3 score tiles of 16
  lens = jnp.array(lens_l, jnp.int32)
  summ = sp.init_block_summaries(kc, lens, block_size=bs)
  nb = summ.num_blocks
  width = sp.decode._decode_width(nb, top_k, 1, 1)
  if layout == "nhd":
    args, group = (q, kc, vc, lens, summ.sums, summ.lengths), 1
  else:   # head-major: batch x kv_heads sequences of one kv head, lengths shared per batch
    seq = lambda x: _hnd(x).reshape(b * hk, n, 1, x.shape[-1])
    sums = jnp.swapaxes(summ.sums, 1, 2).reshape(b * hk, nb, 1, d)
    args, group = (q.reshape(b * hk, hq // hk, d), seq(kc), seq(vc), lens, sums,
                   summ.lengths), hk
  kw = dict(top_k=top_k, lengths_group=group, interpret=True, **launch)
  got = sparse_decode_one_launch(*args, block_size=bs, num_splits=splits,
                                 score_splits=score_splits, chunk=16, **kw)
  want = _two_launches(*args, bs=bs, width=width, splits=splits, score_splits=score_splits,
                       **kw)
  for x, y, name in zip(got, want, ("out", "lse", "indices", "counts")):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
  out, lse, idx, cnt = got
  if layout == "hnd":
    out, lse = out.reshape(b, hq, dv), lse.reshape(b, hq)
    idx, cnt = idx.reshape(b, hk, width), cnt.reshape(b, hk)
  ref_idx = sp.sparse_decode_attention(q, kc, vc, lens, summ, block_size=bs, top_k=top_k,
                                       implementation="xla", return_indices=True)[1]
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref_idx))
  ref, ref_lse, _ = _reference(q, kc, vc, lens, idx, bs)
  assert _rel(out, ref) < 2e-3
  fin = np.isfinite(np.asarray(ref_lse))
  np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(ref_lse)[fin], rtol=1e-4,
                             atol=1e-4)
  assert np.all(np.isneginf(np.asarray(lse)[~fin])) and np.all(np.asarray(out)[1] == 0)


def test_one_launch_checks_its_arguments():
  q, kc, vc = _inputs(72, 1, 64, 4, 2, 16, 16)
  lens = jnp.array([50], jnp.int32)
  summ = sp.init_block_summaries(kc, lens, block_size=16)
  run = functools.partial(sparse_decode_one_launch, block_size=16, top_k=1, interpret=True)
  with pytest.raises(ValueError, match="num_splits must be >= 1"):
    run(q, kc, vc, lens, summ.sums, summ.lengths, num_splits=0)
  with pytest.raises(ValueError, match="sums must be"):
    run(q, kc, vc, lens, summ.sums[:, :2], summ.lengths, num_splits=2)
  with pytest.raises(ValueError, match="does not match the cache"):
    run(q[..., :8], kc, vc, lens, summ.sums, summ.lengths, num_splits=2)
  with pytest.raises(ValueError, match="chunk must be"):
    run(q, kc, vc, lens, summ.sums, summ.lengths, num_splits=2, chunk=8)
  with pytest.raises(ValueError, match="kv_lengths"):
    run(q, kc, vc, jnp.array([50, 50], jnp.int32), summ.sums, summ.lengths, num_splits=2)


def test_one_launch_lowers_for_cuda():
  """At the issue-5 shape (B1 S128K GQA 32:8 D128 bf16, 64-token blocks, top 387) seen as 8
  sequences of one kv head: one Triton call and nothing else but the counters' zeros."""
  S = jax.ShapeDtypeStruct
  bf = jnp.bfloat16
  fn = functools.partial(sparse_decode_one_launch, block_size=64, top_k=387, num_splits=33,
                         lengths_group=8)
  args = (S((8, 4, 128), bf), S((8, 131072, 1, 128), bf), S((8, 131072, 1, 128), bf),
          S((1,), jnp.int32), S((8, 2048, 1, 128), jnp.float32), S((1,), jnp.int32))
  disabled = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  text = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=disabled)(
      *args).mlir_module()
  assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 1


@pytest.mark.gpu
def test_gpu_one_launch_equals_two_launches():
  """Compiled (B3, 8K, GQA 32:8, D128, bf16, 64-token blocks, lengths 8192 / 0 / 3001, the
  head-major view): the lists and counts of the two-launch path to the bit, the output within
  bf16 rounding of it and the fp32 reference."""
  _kernel_module_or_skip("triton")
  b, n, hq, hk, d, bs, top_k = 3, 8192, 32, 8, 128, 64, 24
  q, kc, vc = _inputs(73, b, n, hq, hk, d, d, jnp.bfloat16)
  lens = jnp.array([8192, 0, 3001], jnp.int32)
  summ = sp.init_block_summaries(kc, lens, block_size=bs)
  nb = summ.num_blocks
  width = sp.decode._decode_width(nb, top_k, 1, 1)
  seq = lambda x: _hnd(x).reshape(b * hk, n, 1, d)
  sums = jnp.swapaxes(summ.sums, 1, 2).reshape(b * hk, nb, 1, d)
  args = (q.reshape(b * hk, hq // hk, d), seq(kc), seq(vc), lens, sums, summ.lengths)
  kw = dict(top_k=top_k, lengths_group=hk, interpret=False, num_stages=2, blocks_per_step=2,
            prefetch_ids=True)
  for splits, score_splits in ((8, 4), (3, 1)):
    got = jax.jit(functools.partial(sparse_decode_one_launch, block_size=bs,
                                    num_splits=splits, score_splits=score_splits, chunk=16,
                                    **kw))(*args)
    want = _two_launches(*args, bs=bs, width=width, splits=splits, score_splits=score_splits,
                         **kw)
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))
    np.testing.assert_array_equal(np.asarray(got[3]), np.asarray(want[3]))
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32),
                               atol=2e-2, rtol=2e-2)
    ref, _, _ = _reference(q, kc, vc, lens, got[2].reshape(b, hk, width), bs)
    assert _rel(got[0].reshape(b, hq, d), ref) < 2e-2


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_api_fused_select_all(layout):
  """``sparse_decode_attention(..., fused_select="all")`` ("triton", interpreted): the kept
  lists of ``fused_select=True`` to the bit and its output and lse within fp32 rounding (the
  attention may step over two blocks at a time), on both cache layouts; other
  implementations and paged caches refuse it."""
  _kernel_module_or_skip("triton")
  b, n, hq, hk, d, bs, top_k = 2, 300, 4, 2, 32, 16, 5
  q, kc, vc = _inputs(74, b, n, hq, hk, d, d)
  lens = jnp.array([290, 77], jnp.int32)
  kh, vh = (kc, vc) if layout == "nhd" else (_hnd(kc), _hnd(vc))
  summ = sp.init_block_summaries(kh, lens, block_size=bs, kv_layout=layout)
  call = functools.partial(sp.sparse_decode_attention, q, kh, vh, lens, summ, block_size=bs,
                           top_k=top_k, implementation="triton", interpret=True, num_splits=3,
                           return_lse=True, return_indices=True, kv_layout=layout)
  out, lse, idx = call(fused_select="all")
  out_t, lse_t, idx_t = call(fused_select=True)
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(idx_t))
  np.testing.assert_allclose(np.asarray(out), np.asarray(out_t), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_t), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="fused_select='all'"):
    sp.sparse_decode_attention(q, kh, vh, lens, summ, block_size=bs, top_k=top_k,
                               implementation="xla", fused_select="all", kv_layout=layout)
  with pytest.raises(ValueError, match="fused_select must be"):
    call(fused_select="yes")
  if layout == "nhd":
    pages = kc[:, :18 * bs].reshape(2 * 18, bs, hk, d)
    table = jnp.arange(2 * 18, dtype=jnp.int32).reshape(2, 18)
    plens = jnp.array([280, 77], jnp.int32)
    psumm = sp.init_block_summaries(kc[:, :18 * bs], plens, block_size=bs)
    with pytest.raises(ValueError, match="fused_select='all'"):
      sp.sparse_paged_decode_attention(q, pages, pages, table, plens, psumm, top_k=top_k,
                                       implementation="triton", interpret=True,
                                       fused_select="all")
