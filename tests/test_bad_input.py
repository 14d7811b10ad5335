"""Bad input at the public boundary: every invalid class raises the documented error naming the
argument; traced out-of-range values get the documented behaviour, the same on every
implementation, never a write outside the caller's rows or pages; jattn.debug_checks() reports
the first bad traced value."""
import functools
import inspect

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jattn
from jattn import sparse as sp
from pallas_kernels import tuning

R = lambda i, shape, dtype=jnp.float32: jax.random.normal(jax.random.key(i), shape, dtype)
Q, K = R(0, (2, 32, 4, 16)), R(1, (2, 32, 2, 16))
DQ, DK = R(2, (2, 4, 16)), R(3, (2, 32, 2, 16))          # decode: cache of 32
PAGES = R(4, (6, 16, 2, 16))
TABLE = jnp.array([[0, 1], [2, 3]], jnp.int32)
LENS = jnp.array([20, 32], jnp.int32)
SEG = jnp.ones((2, 32), jnp.int32)
xla = dict(implementation="xla")
flash = functools.partial(jattn.flash_attention, **xla)
decode = functools.partial(jattn.decode_attention, **xla)
paged = functools.partial(jattn.paged_decode_attention, **xla)
summ = sp.init_block_summaries(DK, LENS, block_size=16)
sdecode = functools.partial(jattn.sparse_decode_attention, block_size=16, top_k=1, **xla)

# (id, call, error, message naming the argument)
CASES = [
    ("q rank", lambda: flash(Q[0], K, K), ValueError, r"q must be \[batch"),
    ("q int", lambda: flash(Q.astype(jnp.int32), K, K), TypeError, "q must have a floating"),
    ("zero batch", lambda: flash(Q[:0], K[:0], K[:0]), ValueError, "q must have no zero-size"),
    ("zero kv seq", lambda: flash(Q, K[:, :0], K[:, :0]), ValueError, "k must have no zero-size"),
    ("zero heads", lambda: flash(Q[:, :, :0], K, K), ValueError, "q must have no zero-size"),
    ("zero head_dim", lambda: flash(Q[..., :0], K[..., :0], K[..., :0]), ValueError, "zero-size"),
    ("gqa", lambda: flash(Q[:, :, :3], K, K), ValueError, r"q_heads \(3\) must be a multiple"),
    ("batch", lambda: flash(Q, K[:1], K[:1]), ValueError, "batch sizes differ"),
    ("soft cap inf", lambda: flash(Q, K, K, logits_soft_cap=float("inf")), ValueError,
     "logits_soft_cap must be a finite number > 0, got inf"),
    ("soft cap nan", lambda: flash(Q, K, K, logits_soft_cap=float("nan")), ValueError,
     "logits_soft_cap"),
    ("soft cap 0", lambda: flash(Q, K, K, logits_soft_cap=0.0), ValueError, "logits_soft_cap"),
    ("scale nan", lambda: flash(Q, K, K, scale=float("nan")), ValueError, "scale must be"),
    ("scale str", lambda: flash(Q, K, K, scale="0.1"), TypeError, "scale must be"),
    ("causal str", lambda: flash(Q, K, K, causal="yes"), TypeError, "causal must be a bool"),
    ("window", lambda: flash(Q, K, K, local_window_size=-1), ValueError, "local_window_size"),
    ("segments float", lambda: flash(Q, K, K, segment_ids=SEG.astype(jnp.float32)), TypeError,
     "segment_ids must be an integer"),
    ("segments shape", lambda: flash(Q, K, K, segment_ids=SEG[:, :5]), ValueError,
     r"segment_ids must be \[batch, q_len\]"),
    ("segments int64", lambda: flash(Q, K, K, segment_ids=np.full((2, 32), 2**32 + 1)),
     ValueError, r"segment_ids\[0, 0\] = 4294967297, expected a value in \[-2147483648, "),
    ("implementation", lambda: jattn.flash_attention(Q, K, K, implementation="cuda"),
     ValueError, "unknown implementation 'cuda'"),
    ("plan platform", lambda: jattn.flash_attention_plan(Q, K, K, platform="cuda"), ValueError,
     "platform must be"),
    ("plan soft cap", lambda: jattn.flash_attention_plan(Q, K, K, logits_soft_cap=float("inf")),
     ValueError, "logits_soft_cap"),
    ("compute_capability str", lambda: tuning.Device("gpu", "NVIDIA H200", "9.0"), ValueError,
     "compute_capability must be"),
    ("decode batch", lambda: decode(DQ, DK[:1], DK[:1], LENS), ValueError,
     "k_cache batch 1 != q batch 2"),
    ("decode lengths > cache", lambda: decode(DQ, DK, DK, jnp.array([20, 33])), ValueError,
     r"kv_lengths\[1\] = 33, expected a value in \[0, 32\]"),
    ("decode lengths < 0", lambda: decode(DQ, DK, DK, jnp.array([-1, 3])), ValueError,
     r"kv_lengths\[0\] = -1"),
    ("decode lengths float", lambda: decode(DQ, DK, DK, jnp.array([3.0, 4.0])), TypeError,
     "kv_lengths must be an integer"),
    ("decode zero heads", lambda: decode(DQ[:, :0], DK, DK, LENS), ValueError,
     "q must have no zero-size"),
    ("decode soft cap", lambda: decode(DQ, DK, DK, LENS, logits_soft_cap=float("inf")),
     ValueError, "logits_soft_cap"),
    ("decode num_splits", lambda: decode(DQ, DK, DK, LENS, num_splits=0), ValueError,
     "num_splits"),
    ("paged page id", lambda: paged(DQ, PAGES, PAGES, jnp.array([[0, -1], [2, 3]]), LENS),
     ValueError, r"page_table\[0, 1\] = -1, expected a value in \[0, 5\]"),
    ("paged page id past pool", lambda: paged(DQ, PAGES, PAGES, jnp.array([[0, 1], [2, 6]]),
                                              LENS), ValueError, r"page_table\[1, 1\] = 6"),
    ("paged layout", lambda: paged(DQ, PAGES, PAGES, TABLE, LENS, kv_layout="bhsd"), ValueError,
     "kv_layout must be"),
    ("paged lengths", lambda: paged(DQ, PAGES, PAGES, TABLE, jnp.array([20, 40])), ValueError,
     r"kv_lengths\[1\] = 40, expected a value in \[0, 32\]"),
    ("append lengths < 0", lambda: jattn.append_kv(DK, DK, jnp.array([-1, 0]), DQ[:, :2],
                                                   DQ[:, :2]), ValueError, r"kv_lengths\[0\]"),
    ("append new dtype", lambda: jattn.append_kv(DK, DK, LENS, DQ[:, :2].astype(jnp.int32),
                                                 DQ[:, :2]), TypeError, "k_new must have a"),
    ("append paged page id", lambda: jattn.append_kv_paged(
        PAGES, PAGES, jnp.array([[0, -1], [2, 3]]), jnp.array([16, 3]), DQ[:, :2], DQ[:, :2]),
     ValueError, r"page_table\[0, 1\] = -1"),
    ("top_k 0", lambda: jattn.select_blocks(Q, K, block_size=16, q_block_size=16, top_k=0),
     ValueError, r"top_k must be an int in \[1, "),
    ("sparse top_k 0", lambda: jattn.sparse_attention(Q, K, K, block_size=16, q_block_size=16,
                                                      top_k=0, **xla), ValueError, "top_k"),
    ("sparse temperature", lambda: jattn.sparse_attention(
        Q, K, K, block_size=16, q_block_size=16, top_k=1, gate_temperature=float("inf"), **xla),
     ValueError, "gate_temperature"),
    ("block_scores zero size", lambda: sp.block_scores(Q[:, :0], K), ValueError,
     "q must have no zero-size"),
    ("sparse decode top_k 0", lambda: sdecode(DQ, DK, DK, LENS, summ, top_k=0), ValueError,
     "top_k"),
    ("sparse decode float lengths", lambda: sdecode(DQ, DK, DK, jnp.array([3.0, 4.0]), summ),
     TypeError, "kv_lengths must be an integer"),
    ("sparse decode lengths", lambda: sdecode(DQ, DK, DK, jnp.array([3, 99]), summ), ValueError,
     r"kv_lengths\[1\] = 99"),
    ("sparse decode batch", lambda: sdecode(DQ[:1], DK, DK, LENS[:1], summ), ValueError,
     "k_cache batch 2 != q batch 1"),
    ("select_decode_blocks float lengths", lambda: sp.select_decode_blocks(
        DQ, summ, jnp.array([3.0, 4.0]), top_k=1), TypeError, "kv_lengths must be an integer"),
    ("summaries float lengths", lambda: sp.init_block_summaries(DK, jnp.array([1.5, 2.0]),
                                                                block_size=16), TypeError,
     "kv_lengths"),
    ("segments_from_lengths < 0", lambda: jattn.segments_from_lengths(jnp.array([[3, -2]]), 8),
     ValueError, r"doc_lengths\[0, 1\] = -2"),
    ("segments_from_lengths float", lambda: jattn.segments_from_lengths(jnp.array([[3.0]]), 8),
     TypeError, "doc_lengths must be an integer"),
    ("segments_from_lengths int64", lambda: jattn.segments_from_lengths(np.array([[2**40]]), 8),
     ValueError, r"doc_lengths\[0, 0\] = 1099511627776"),
    ("segments_from_lengths max_len", lambda: jattn.segments_from_lengths(jnp.array([[3]]), 0),
     ValueError, "max_len must be"),
]


@pytest.mark.parametrize("call,error,match", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_input_raises_naming_the_argument(call, error, match):
  with pytest.raises(error, match=match):
    call()


def test_int64_segment_ids_traced_are_refused():
  """A wider id type cannot be range-checked under jit: TypeError, never a silent cast."""
  seg = jax.ShapeDtypeStruct((2, 32), jnp.uint32)
  with pytest.raises(TypeError, match="segment_ids must be int32"):
    jax.eval_shape(lambda s: flash(Q, K, K, segment_ids=s), seg)


@pytest.mark.parametrize("call,plan", [
    (jattn.flash_attention, jattn.flash_attention_plan),
    (jattn.block_sparse_attention, jattn.block_sparse_plan),
    (jattn.decode_attention, jattn.decode_plan),
    (jattn.paged_decode_attention, jattn.decode_plan),
    (jattn.sparse_decode_attention, sp.sparse_decode_plan),
    (jattn.sparse_paged_decode_attention, sp.sparse_decode_plan),
], ids=lambda f: f.__name__)
def test_plans_take_the_calls_keywords(call, plan):
  kw = lambda f: {n for n, p in inspect.signature(f).parameters.items()
                  if p.kind == p.KEYWORD_ONLY}
  assert kw(call) <= set(inspect.signature(plan).parameters), kw(call) - set(
      inspect.signature(plan).parameters)
  for seg in (SEG, jax.ShapeDtypeStruct(SEG.shape, jnp.int32)):
    p = jattn.flash_attention_plan(Q, K, K, causal=True, scale=0.3, logits_soft_cap=30.0,
                                   return_lse=True, segment_ids=seg)
    assert p.implementation == "xla"


def test_unused_page_table_entries_may_hold_anything():
  """Only pages below a sequence's length are read: -1 past it is no error."""
  table = jnp.array([[0, -1], [2, 3]], jnp.int32)
  out = paged(DQ, PAGES, PAGES, table, jnp.array([16, 32]))
  ref = paged(DQ, PAGES, PAGES, TABLE, jnp.array([16, 32]))
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


IMPLS = [dict(implementation="xla"), dict(implementation="triton", interpret=True),
         dict(implementation="mosaic_tpu", interpret=True)]


def test_traced_out_of_range_values_are_clamped_on_every_implementation():
  """Under jit, lengths outside [0, capacity] act as clamped and page ids outside the pool as
  clamped into it: each implementation returns the result of the clamped call."""
  q, pages = R(5, (3, 4, 128)), R(6, (6, 16, 2, 128))
  lens, table = jnp.array([-3, 70, 20]), jnp.array([[0, 1], [5, -1], [9, 2]])
  good_lens, good_table = jnp.clip(lens, 0, 32), jnp.clip(table, 0, 5)
  k = pages.reshape(3, 32, 2, 128)
  for kw in IMPLS:
    f = jax.jit(functools.partial(jattn.decode_attention, num_splits=2, return_lse=True, **kw))
    g = jax.jit(functools.partial(jattn.paged_decode_attention, num_splits=2, return_lse=True,
                                  **kw))
    for got, want in ((f(q, k, k, lens), f(q, k, k, good_lens)),
                      (g(q, pages, pages, table, lens), g(q, pages, pages, good_table,
                                                          good_lens))):
      for x, y in zip(got, want):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(kw))
    assert float(f(q, k, k, lens)[1][0, 0]) == -np.inf                 # length < 0: empty
    s = sp.init_block_summaries(pages, good_lens, block_size=16, page_table=good_table)
    h = jax.jit(functools.partial(jattn.sparse_paged_decode_attention, top_k=1,
                                  return_indices=True, **kw))
    for x, y in zip(h(q, pages, pages, table, good_lens, s),
                    h(q, pages, pages, good_table, good_lens, s)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(kw))


def test_traced_appends_never_write_another_slot():
  k = jnp.zeros((2, 8, 1, 4))
  new = jnp.ones((2, 1, 4))
  k2, _, lens = jax.jit(jattn.append_kv)(k, k, jnp.array([-1, 8]), new, new)
  assert not bool(jnp.any(k2)) and lens.tolist() == [0, 9]          # both writes dropped
  pages = jnp.zeros((4, 16, 1, 4))
  table = jnp.array([[0, -1], [2, 7]], jnp.int32)                  # -1 and 7: not in the pool
  kp, _, _ = jax.jit(jattn.append_kv_paged)(pages, pages, table, jnp.array([16, 20]), new, new)
  assert not bool(jnp.any(kp))


def test_debug_checks_report_the_first_bad_traced_value():
  f = jax.jit(lambda lens, table: jattn.paged_decode_attention(DQ, PAGES, PAGES, table, lens,
                                                               **xla))
  with pytest.raises(ValueError, match=r"^page_table\[0, 1\] = 9, expected a value in \[0, 5\]$"):
    with jattn.debug_checks():
      f(LENS, jnp.array([[0, 9], [2, 3]]))
  with pytest.raises(ValueError, match=r"kv_lengths\[0\] = -4"):
    with jattn.debug_checks():
      jax.jit(jattn.append_kv)(DK, DK, jnp.array([-4, 0]), DQ[:, :2], DQ[:, :2])
  with pytest.raises(ValueError, match=r"doc_lengths\[0, 0\] = -1"):
    with jattn.debug_checks():
      jax.jit(functools.partial(jattn.segments_from_lengths, max_len=8))(jnp.array([[-1, 3]]))
  with jattn.debug_checks():                                     # good values: no error
    out = f(LENS, TABLE)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(f(LENS, TABLE)))


def _segments_numpy(lengths, max_len):
  seg, pos = np.zeros((len(lengths), max_len), np.int32), np.zeros((len(lengths), max_len),
                                                                   np.int32)
  for b, row in enumerate(lengths):
    col, doc = 0, 0
    for n in row:
      n = min(int(n), max_len - col)
      if n > 0:
        doc += 1
        seg[b, col:col + n], pos[b, col:col + n] = doc, np.arange(n)
        col += n
  return seg, pos


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(st.lists(st.lists(st.one_of(st.integers(0, 5), st.integers(2**30, 2**31 - 1)),
                                    min_size=1, max_size=4), min_size=1, max_size=3).filter(
                      lambda rows: len({len(r) for r in rows}) == 1))
def test_segments_from_lengths_large_lengths_never_wrap(rows):
  """Lengths whose sums overflow int32 still give the right ids (a row is cut at max_len)."""
  seg, pos = jattn.segments_from_lengths(np.array(rows, np.int64), max_len=7)
  want_seg, want_pos = _segments_numpy(rows, 7)
  np.testing.assert_array_equal(np.asarray(seg), want_seg)
  np.testing.assert_array_equal(np.asarray(pos), want_pos)
