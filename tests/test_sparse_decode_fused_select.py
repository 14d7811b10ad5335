"""Sparse decode with the block selection inside the attention kernel
(``pallas_kernels.sparse.decode_fused_select``).

Checks (Pallas interpreter): the fused kernel's kept lists and counts equal
``select_decode_slots``'s, and its output and lse equal the two-kernel path
``select_decode_slots`` + ``sparse_decode`` on the same scores to the bit, on ragged lengths
(0, shorter than init + local + top_k blocks, not a multiple of the block), GQA groups 4, 3
and 1, head_dim 24, narrower values, tied scores, 1 to 7 splits (more than the kept blocks), a
permuted arrival order, all threshold searches (unrolled, ``search_loop="rolled"`` and
"early"), contiguous and paged caches; the two launches
from block sums equal ``jattn.sparse``'s "triton" path and the fp32 "xla" reference. The
issue-5 bench shape lowers for CUDA (on the CPU) to two Triton kernels with no memset. GPU test
(``-m gpu``): the compiled kernel against the compiled two-kernel path.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn import sparse as sp
from pallas_kernels.sparse import decode as sd
from pallas_kernels.sparse import decode_fused_select as fs
from pallas_kernels.sparse.decode_select import decode_block_scores, select_decode_slots


def _two_kernel(q, k, v, lens, scores, page_table=None, *, block_size, top_k, num_init_blocks,
                num_local_blocks, num_splits, interpret=True):
  """Today's path on given scores: select_decode_slots + sparse_decode (merged, counts)."""
  nb = scores.shape[-1]
  width = fs.decode_width(nb, top_k, num_init_blocks, num_local_blocks)
  idx, cnt, arr = select_decode_slots(scores, lens, block_size=block_size, top_k=top_k,
                                      num_init_blocks=num_init_blocks,
                                      num_local_blocks=num_local_blocks, max_selected=width,
                                      return_arrivals=True, interpret=interpret)
  out, lse = sd.sparse_decode(q, k, v, lens, idx, page_table, cnt, arr, block_size=block_size,
                              num_splits=num_splits, interpret=interpret)
  return out, lse, idx, cnt


def _same(x, y):
  np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _tied_scores(key, b, hk, nb):
  """Random scores with many ties: values on a 0.5 grid (about 7 distinct values)."""
  return jnp.round(jax.random.normal(key, (b, hk, nb)) * 2.0) / 2.0


_CASES = {
    # b, hq, hk, d, dv, bs, n, lens, top_k, init, local, splits, digit_bits, dtype
    "gqa4_ragged": (3, 8, 2, 32, 32, 16, 208, [208, 37, 100], 4, 1, 2, 3, 2, jnp.bfloat16),
    "gqa1_many_splits": (2, 2, 2, 16, 8, 16, 160, [75, 16], 3, 1, 1, 7, 1, jnp.float32),
    "no_local_radix4": (2, 12, 3, 16, 16, 32, 320, [320, 0], 5, 2, 0, 4, 4, jnp.bfloat16),
    "gqa3_d24_one_split": (1, 6, 2, 24, 24, 16, 144, [139], 3, 1, 1, 1, 2, jnp.float32),
}


@pytest.mark.parametrize("case,paged,lookup,search_loop",
                         [(c, False, "reduce", "unrolled") for c in _CASES]
                         + [("gqa1_many_splits", True, "reduce", "unrolled"),
                            ("gqa4_ragged", False, "scratch", "unrolled"),
                            ("gqa1_many_splits", True, "scratch", "unrolled"),
                            ("gqa4_ragged", False, "reduce", "rolled"),           # radix 2
                            ("gqa1_many_splits", True, "scratch", "rolled"),      # bit search
                            ("no_local_radix4", False, "reduce", "rolled"),       # radix 4
                            ("gqa1_many_splits", False, "reduce", "early")])      # bit search
def test_fused_equals_two_kernels(case, paged, lookup, search_loop):
  """Indices, counts, output and lse of the fused kernel == select_decode_slots +
  sparse_decode on the same (tied) scores, to the bit; arrival order permuted; both lookups
  of the block ids; the threshold search unrolled (default) or as a loop."""
  b, hq, hk, d, dv, bs, n, lens, top_k, init, local, splits, bits, dt = _CASES[case]
  nb = n // bs
  ks = jax.random.split(jax.random.key(list(_CASES).index(case)), 4)
  q = jax.random.normal(ks[0], (b, hq, d), dt)
  k = jax.random.normal(ks[1], (b, n, hk, d), dt)
  v = jax.random.normal(ks[2], (b, n, hk, dv), dt)
  scores = _tied_scores(ks[3], b, hk, nb)
  lens = jnp.asarray(lens, jnp.int32)
  pt = None
  if paged:                              # pages of a shuffled pool holding the same blocks
    perm = np.random.default_rng(0).permutation(b * nb + 3)[:b * nb].reshape(b, nb)
    pool = lambda x: jnp.zeros((b * nb + 3, bs, hk, x.shape[-1]), dt).at[perm.reshape(-1)].set(
        x.reshape(b * nb, bs, hk, x.shape[-1]))
    k, v, pt = pool(k), pool(v), jnp.asarray(perm, jnp.int32)
  sel = dict(block_size=bs, top_k=top_k, num_init_blocks=init, num_local_blocks=local)
  want = _two_kernel(q, k, v, lens, scores, pt, num_splits=splits, **sel)
  stride = 2 if splits % 2 else 1        # another split than the last arrives last
  got = fs.sparse_decode_select_attend(q, k, v, lens, scores, pt, num_splits=splits,
                                       digit_bits=bits, return_indices=True, interpret=True,
                                       _split_stride=stride, lookup=lookup,
                                       search_loop=search_loop, **sel)
  for g, w in zip(got, want):
    _same(g, w)
  assert got[0].dtype == dt


def test_fused_selection_is_checked():
  """The equality above sees a wrong selection: a different top_k changes the lists."""
  b, hk, nb, bs = 1, 2, 12, 16
  q = jnp.ones((b, 4, 16)); k = jnp.ones((b, nb * bs, hk, 16))
  scores = jax.random.normal(jax.random.key(3), (b, hk, nb))
  lens = jnp.array([nb * bs], jnp.int32)
  _, _, idx, cnt = fs.sparse_decode_select_attend(q, k, k, lens, scores, block_size=bs, top_k=3,
                                                  num_splits=2, return_indices=True,
                                                  interpret=True)
  kw = dict(block_size=bs, num_init_blocks=1, num_local_blocks=1, max_selected=idx.shape[-1],
            interpret=True)
  ref_idx, ref_cnt = select_decode_slots(scores, lens, top_k=3, **kw)
  _same(idx, ref_idx); _same(cnt, ref_cnt)
  np.testing.assert_array_equal(np.asarray(cnt), 5)
  # the kept set really is the top 3 candidates (blocks 1 .. nb - 2) plus blocks 0 and nb - 1
  for h in range(hk):
    top = 1 + np.argsort(-np.asarray(scores[0, h, 1:nb - 1]), kind="stable")[:3]
    assert np.asarray(idx[0, h]).tolist() == sorted([0, nb - 1, *top.tolist()])
  bad_idx, _ = select_decode_slots(scores, lens, top_k=2, **kw)
  assert not np.array_equal(np.asarray(bad_idx), np.asarray(idx))


@pytest.mark.parametrize("bits", [2, 4])
def test_fused_rolled_search_several_chunks(bits):
  """``search_loop="rolled"`` over several radix compare chunks (nb_pad 64, search_chunk 16):
  kept lists and counts == ``select_decode_slots`` (tied scores, ragged lengths), output ==
  the unrolled search's to the bit."""
  b, hk, nb, bs = 2, 2, 60, 16
  ks = jax.random.split(jax.random.key(5), 2)
  q = jax.random.normal(ks[0], (b, 4, 16), jnp.float32)
  k = jax.random.normal(ks[1], (b, nb * bs, hk, 16), jnp.float32)
  scores = _tied_scores(jax.random.key(6), b, hk, nb)
  lens = jnp.array([nb * bs - 5, 23 * bs], jnp.int32)
  kw = dict(block_size=bs, top_k=9, num_init_blocks=1, num_local_blocks=2, num_splits=2,
            digit_bits=bits, search_chunk=16, return_indices=True, interpret=True)
  got = fs.sparse_decode_select_attend(q, k, k, lens, scores, search_loop="rolled", **kw)
  ref = fs.sparse_decode_select_attend(q, k, k, lens, scores, **kw)
  for g, w in zip(got, ref):
    _same(g, w)
  want_idx, want_cnt = select_decode_slots(scores, lens, block_size=bs, top_k=9,
                                           num_init_blocks=1, num_local_blocks=2,
                                           max_selected=got[2].shape[-1], interpret=True)
  _same(got[2], want_idx); _same(got[3], want_cnt)


def test_fused_from_summaries_equals_triton_path_and_reference():
  """The two launches from block sums (``sparse_decode_fused``) == ``jattn.sparse``'s
  "triton" path (indices, lse, output to the bit) and the fp32 "xla" reference within 2e-3;
  duplicated cache blocks make tied scores; the scores kernel with counters == the plain one."""
  b, hq, hk, d, bs, n = 3, 8, 2, 32, 16, 224
  ks = jax.random.split(jax.random.key(11), 3)
  q = jax.random.normal(ks[0], (b, hq, d), jnp.float32)
  k = jax.random.normal(ks[1], (b, n, hk, d), jnp.float32)
  v = jax.random.normal(ks[2], (b, n, hk, d), jnp.float32)
  k = k.at[:, 3 * bs:4 * bs].set(k[:, 6 * bs:7 * bs]).at[:, 9 * bs:10 * bs].set(
      k[:, 6 * bs:7 * bs])                                             # blocks 3, 6, 9 tie
  lens = jnp.array([224, 45, 170], jnp.int32)
  summ = sp.init_block_summaries(k, lens, block_size=bs)
  sel = dict(block_size=bs, top_k=3, num_init_blocks=1, num_local_blocks=1)
  scores, arr = fs.decode_block_scores_arrivals(q, summ.sums, summ.lengths, block_size=bs,
                                                interpret=True)
  _same(scores, decode_block_scores(q, summ.sums, summ.lengths, block_size=bs, interpret=True))
  _same(arr, np.zeros((b, hk), np.int32))
  assert float(scores[0, 0, 3]) == float(scores[0, 0, 6]) == float(scores[0, 0, 9])
  out, lse, idx = fs.sparse_decode_fused(q, k, v, lens, summ.sums, summ.lengths, num_splits=3,
                                         return_lse=True, return_indices=True, interpret=True,
                                         **sel)
  t_out, t_lse, t_idx = sp.sparse_decode_attention(
      q, k, v, lens, summ, return_lse=True, return_indices=True, implementation="triton",
      interpret=True, num_splits=3, **sel)
  _same(idx, t_idx); _same(lse, t_lse); _same(out, t_out)
  r_out, r_lse, r_idx = sp.sparse_decode_attention(
      q, k, v, lens, summ, return_lse=True, return_indices=True, implementation="xla", **sel)
  _same(idx, r_idx)
  np.testing.assert_allclose(np.asarray(out), np.asarray(r_out), atol=2e-3, rtol=2e-3)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(r_lse), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("layout,bps", [("nhd", 1), ("hnd", 1), ("hnd", 2)])
def test_api_fused_select_attend(layout, bps):
  """``sparse_decode_attention(..., fused_select="attend")`` (the scores launch, then the
  attention kernel whose every program selects itself; session 25): the default "triton"
  call's indices, lse and output to the bit (the same blocks in the same order and the same
  arithmetic), on a contiguous cache of either layout (head-major: lengths shared by each
  sequence's kv heads, ``lengths_group``), 1 and 2 blocks per step, ragged lengths and tied
  scores; it refuses other implementations and score_splits."""
  b, hq, hk, d, bs, n = 2, 8, 2, 32, 16, 224
  ks = jax.random.split(jax.random.key(12), 3)
  q = jax.random.normal(ks[0], (b, hq, d), jnp.float32)
  k = jax.random.normal(ks[1], (b, n, hk, d), jnp.float32)
  v = jax.random.normal(ks[2], (b, n, hk, d), jnp.float32)
  k = k.at[:, 3 * bs:4 * bs].set(k[:, 6 * bs:7 * bs])                 # blocks 3 and 6 tie
  lens = jnp.array([224, 93], jnp.int32)
  if layout == "hnd":
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  summ = sp.init_block_summaries(k, lens, block_size=bs, kv_layout=layout)
  kw = dict(block_size=bs, top_k=4, return_lse=True, return_indices=True,
            implementation="triton", interpret=True, num_splits=3, kv_layout=layout)
  if layout == "hnd":
    launch = (("num_stages", 2), ("blocks_per_step", bps), ("prefetch_ids", True))
    call = lambda fused: sp.decode._hnd_decode(
        q, k, v, lens, summ, block_size=bs, top_k=4, num_init_blocks=1, num_local_blocks=1,
        scale=None, return_lse=True, return_indices=True, implementation="triton",
        interpret=True, num_splits=3, fused_select=fused, score_splits=None, _launch=launch)
  else:
    call = lambda fused: sp.sparse_decode_attention(q, k, v, lens, summ, fused_select=fused,
                                                    **kw)
  got, want = call("attend"), call(None)
  for x, y in zip(got, want):
    _same(x, y)
  ref = sp.sparse_decode_attention(q, k, v, lens, summ, block_size=bs, top_k=4,
                                   implementation="xla", kv_layout=layout)
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(ref), atol=2e-3, rtol=2e-3)
  with pytest.raises(ValueError, match="'attend'.*'triton'"):
    sp.sparse_decode_attention(q, k, v, lens, summ, block_size=bs, top_k=4, kv_layout=layout,
                               implementation="xla", fused_select="attend")
  with pytest.raises(ValueError, match="score_splits"):
    sp.sparse_decode_attention(q, k, v, lens, summ, fused_select="attend", score_splits=2,
                               **kw)


def test_fused_options_raise():
  q = jnp.ones((1, 4, 16)); k = jnp.ones((1, 64, 2, 16)); lens = jnp.array([64])
  s = jnp.zeros((1, 2, 4))
  run = functools.partial(fs.sparse_decode_select_attend, q, k, k, lens, top_k=1,
                          interpret=True)
  with pytest.raises(ValueError, match="scores"):
    run(jnp.zeros((1, 2, 5)), block_size=16)
  with pytest.raises(ValueError, match="block_size"):
    run(s, block_size=24)
  with pytest.raises(ValueError, match="num_splits"):
    run(s, block_size=16, num_splits=0)
  with pytest.raises(ValueError, match="digit_bits"):
    run(s, block_size=16, digit_bits=3)
  with pytest.raises(ValueError, match="lookup"):
    run(s, block_size=16, lookup="gather")
  with pytest.raises(ValueError, match="search_loop"):
    run(s, block_size=16, search_loop="scan")
  with pytest.raises(ValueError, match="needs lookup='scratch'"):
    run(s, block_size=16, blocks_per_step=2)
  with pytest.raises(ValueError, match="blocks_per_step must be a power of two"):
    run(s, block_size=16, blocks_per_step=3, lookup="scratch")
  with pytest.raises(ValueError, match="lengths_group must be >= 1 and divide the batch"):
    run(s, block_size=16, lengths_group=2)


def _cuda_mlir(fn, *args):
  """MLIR text of jit(fn) exported for CUDA (on the CPU; Triton custom calls allowed)."""
  disabled = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  return jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=disabled)(
      *args).mlir_module()


def test_fused_is_two_launches_for_cuda():
  """At the issue-5 bench shape (B1, 128K, GQA 32:8, D128, bf16, 64-token blocks, top_k 387,
  33 splits) ``sparse_decode_fused`` lowers for CUDA (on the CPU) to two Triton kernels and
  nothing between them (the scores kernel zeroes the counters: no memset, no sort), contiguous
  (both lookups, and the rolled search) and paged."""
  S = jax.ShapeDtypeStruct
  bf16 = jnp.bfloat16
  n, bs = 131072, 64
  nb = n // bs
  sums, slen = S((1, nb, 8, 128), jnp.float32), S((1,), jnp.int32)
  q, lens = S((1, 32, 128), bf16), S((1,), jnp.int32)
  kw = dict(block_size=bs, top_k=387, num_splits=33)
  cases = [(lambda q, k, v, l, s, sl: fs.sparse_decode_fused(q, k, v, l, s, sl, **kw),
            (q, S((1, n, 8, 128), bf16), S((1, n, 8, 128), bf16), lens, sums, slen)),
           (lambda q, k, v, l, s, sl: fs.sparse_decode_fused(q, k, v, l, s, sl,
                                                             lookup="scratch", **kw),
            (q, S((1, n, 8, 128), bf16), S((1, n, 8, 128), bf16), lens, sums, slen)),
           (lambda q, k, v, l, s, sl: fs.sparse_decode_fused(q, k, v, l, s, sl,
                                                             search_loop="rolled", **kw),
            (q, S((1, n, 8, 128), bf16), S((1, n, 8, 128), bf16), lens, sums, slen)),
           (lambda q, k, v, pt, l, s, sl: fs.sparse_decode_fused(q, k, v, l, s, sl, pt, **kw),
            (q, S((nb + 4, bs, 8, 128), bf16), S((nb + 4, bs, 8, 128), bf16),
             S((1, nb), jnp.int32), lens, sums, slen))]
  for fn, args in cases:
    text = _cuda_mlir(fn, *args)
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 2
    assert "grid_z = 33" in text and "grid_z = 32" in text        # 2048 blocks / 64 per chunk
    assert "output_operand_alias" in text                          # counters updated in place
    for op in ("stablehlo.broadcast", "stablehlo.constant dense<0> : tensor<1x8xi32>",
               "stablehlo.sort", "stablehlo.reduce"):
      assert op not in text, op


def test_decode_kernel_default_path_unchanged():
  """``decode._kernel``'s ``slot_source`` hook is off by default: ``sparse_decode``'s jaxpr has
  no trace of it (every block id is a load of the index list)."""
  S = jax.ShapeDtypeStruct
  args = (S((1, 4, 16), jnp.float32), S((1, 64, 2, 16), jnp.float32),
          S((1, 64, 2, 16), jnp.float32), S((1,), jnp.int32), S((1, 2, 3), jnp.int32), None,
          S((1, 2), jnp.int32))
  text = str(jax.make_jaxpr(functools.partial(sd.sparse_decode, block_size=16, num_splits=2))(
      *args))
  assert "cumsum" not in text


# ------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_gpu_fused_equals_triton_path():
  """Compiled on the GPU (B3, 8K, GQA 32:8, D128, bf16, 64-token blocks, lengths 8192 / 0 /
  3001, default and 5 splits): the fused two launches give the "triton" path's indices, and
  its output and lse (the same blocks, order and arithmetic: equal, up to at most bf16 / fp32
  rounding should the compiler schedule the two kernels differently)."""
  b, n, hq, hk, d, bs, top_k = 3, 8192, 32, 8, 128, 64, 24
  ks = jax.random.split(jax.random.key(45), 3)
  q = jax.random.normal(ks[0], (b, hq, d), jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, n, hk, d), jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, n, hk, d), jnp.bfloat16)
  lens = jnp.array([8192, 0, 3001], jnp.int32)
  summ = sp.init_block_summaries(k, lens, block_size=bs)
  for splits in (None, 5):
    t_out, t_lse, t_idx = jax.jit(functools.partial(
        sp.sparse_decode_attention, block_size=bs, top_k=top_k, return_lse=True,
        return_indices=True, implementation="triton", num_splits=splits))(q, k, v, lens, summ)
    out, lse, idx = jax.jit(functools.partial(
        fs.sparse_decode_fused, block_size=bs, top_k=top_k, num_splits=splits, return_lse=True,
        return_indices=True))(q, k, v, lens, summ.sums, summ.lengths)
    _same(idx, t_idx)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(t_out, np.float32),
                               rtol=1e-2, atol=1e-2)
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(np.asarray(t_lse)))
    fin = np.isfinite(np.asarray(t_lse))
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(t_lse)[fin], rtol=1e-5,
                               atol=1e-5)
    ref = sp.sparse_decode_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                     v.astype(jnp.float32), lens, summ, block_size=bs,
                                     top_k=top_k, implementation="xla")
    err = np.linalg.norm(np.asarray(out, np.float32) - np.asarray(ref)) / np.linalg.norm(
        np.asarray(ref))
    assert err < 1e-2, err


@pytest.mark.gpu
def test_gpu_api_fused_select_attend_head_major():
  """Compiled on the GPU (head-major B3, 8K, GQA 32:8, D128, bf16, 64-token blocks, lengths
  8192 / 0 / 3001; the API's head-major launch and split count): ``fused_select="attend"``
  gives the default call's indices, and its output and lse up to bf16 / fp32 rounding (the
  same blocks, order and arithmetic in another kernel)."""
  b, n, hq, hk, d, bs, top_k = 3, 8192, 32, 8, 128, 64, 24
  ks = jax.random.split(jax.random.key(47), 3)
  q = jax.random.normal(ks[0], (b, hq, d), jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, hk, n, d), jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, hk, n, d), jnp.bfloat16)
  lens = jnp.array([8192, 0, 3001], jnp.int32)
  summ = sp.init_block_summaries(k, lens, block_size=bs, kv_layout="hnd")
  run = lambda fused: jax.jit(functools.partial(
      sp.sparse_decode_attention, block_size=bs, top_k=top_k, implementation="triton",
      kv_layout="hnd", return_lse=True, return_indices=True, fused_select=fused))(
          q, k, v, lens, summ)
  (out, lse, idx), (w_out, w_lse, w_idx) = run("attend"), run(None)
  _same(idx, w_idx)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(w_out, np.float32),
                             atol=1e-2, rtol=1e-2)
  fin = np.isfinite(np.asarray(w_lse))
  _same(np.isfinite(np.asarray(lse)), fin)
  np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(w_lse)[fin], atol=1e-3, rtol=1e-3)
