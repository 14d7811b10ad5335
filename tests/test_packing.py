"""Tests for jattn.packing: BFD plans, materialised rows, segment ids under jit, the iterator,
and packed batches through attention and the block schedule."""
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from jattn.attention import flash_attention
from jattn.packing import (PackedIterator, TokenStore, loss_weights_from_segments, materialize,
                           pack_bfd, segments_from_lengths)
from pallas_kernels.block_schedule import make_schedule


# ----------------------------------------------------------------------------------------------
# Helpers: plain constructions the fast code is checked against
# ----------------------------------------------------------------------------------------------

def naive_bfd_loads(lengths, max_len):
  """Sequential BFD by scanning all bins: sorted row loads."""
  chunks = []
  for n in lengths:
    while n > 0:
      chunks.append(min(n, max_len))
      n -= min(n, max_len)
  caps = []
  for c in sorted(chunks, reverse=True):
    best = -1
    for i, r in enumerate(caps):
      if r >= c and (best < 0 or r < caps[best]):
        best = i
    if best < 0:
      caps.append(max_len - c)
    else:
      caps[best] -= c
  return sorted(max_len - r for r in caps)


def check_plan(plan, lengths, max_len):
  """Every invariant of a valid plan."""
  lengths = np.asarray(lengths, np.int64)
  assert plan.max_len == max_len and plan.num_docs == len(lengths)
  for arr in (plan.doc_ids, plan.chunk_starts, plan.chunk_lengths, plan.bins, plan.offsets):
    assert arr.shape == (plan.num_chunks,) and np.issubdtype(arr.dtype, np.integer)
  # Document order, and each document covered exactly once, in order, by consecutive chunks.
  key = plan.doc_ids * (int(lengths.max(initial=0)) + 1) + plan.chunk_starts
  assert (np.diff(key) > 0).all()
  assert ((plan.chunk_lengths >= 1) & (plan.chunk_lengths <= max_len)).all()
  for d, n in enumerate(lengths):
    sel = plan.doc_ids == d
    starts, lens = plan.chunk_starts[sel], plan.chunk_lengths[sel]
    if n == 0:
      assert sel.sum() == 0
      continue
    assert starts[0] == 0 and (starts[1:] == starts[:-1] + lens[:-1]).all()
    assert lens.sum() == n
    if n <= max_len:
      assert sel.sum() == 1  # never split
    else:
      assert (lens[:-1] == max_len).all()
  # Bins: in range, no overlap, within capacity, packed from column 0 without gaps.
  assert ((plan.bins >= 0) & (plan.bins < max(plan.num_bins, 1))).all()
  if plan.num_chunks:
    assert np.array_equal(np.unique(plan.bins), np.arange(plan.num_bins))  # no empty bin
  o = np.lexsort((plan.offsets, plan.bins))
  b, off, ln = plan.bins[o], plan.offsets[o], plan.chunk_lengths[o]
  new_bin = np.r_[True, b[1:] != b[:-1]] if len(b) else np.zeros(0, bool)
  assert (off[new_bin] == 0).all()
  cont = ~new_bin
  prev_end = (off + ln)[:-1]
  assert (off[1:][cont[1:]] == prev_end[cont[1:]]).all()  # back to back: no overlap, no gap
  assert (off + ln <= max_len).all()
  assert (plan.row_loads <= max_len).all()


lengths_st = st.lists(st.one_of(st.integers(0, 40), st.integers(0, 200)), max_size=60)


# ----------------------------------------------------------------------------------------------
# pack_bfd
# ----------------------------------------------------------------------------------------------

@given(lengths=lengths_st, max_len=st.integers(1, 64))
def test_plan_invariants_and_equals_sequential_bfd(lengths, max_len):
  plan = pack_bfd(lengths, max_len)
  check_plan(plan, lengths, max_len)
  ref = naive_bfd_loads(lengths, max_len)
  assert plan.num_bins == len(ref)
  assert sorted(plan.row_loads.tolist()) == ref


def test_example_layout():
  plan = pack_bfd([5, 3, 0, 4, 12], max_len=8)
  # Chunks longest first: 8 (doc 4), 5, 4, 4, 3 -> rows {8}, {5, 3}, {4, 4}.
  assert plan.num_bins == 3
  assert plan.doc_ids.tolist() == [0, 1, 3, 4, 4]
  assert plan.chunk_starts.tolist() == [0, 0, 0, 0, 8]
  assert sorted(plan.row_loads.tolist()) == [8, 8, 8]
  assert plan.utilization() == 1.0


def test_errors_and_edge_cases():
  for bad in ([3, -1], [1.5, 2], [1.0], np.array([True, False]), ["a"], [[1, 2]]):
    with pytest.raises(ValueError):
      pack_bfd(bad, 8)
  for bad_len in (0, -4, 2.5, True):
    with pytest.raises(ValueError):
      pack_bfd([1, 2], bad_len)
  with pytest.raises(ValueError, match="split_long"):
    pack_bfd([3, 9], 8, split_long=False)
  plan = pack_bfd([3, 8], 8, split_long=False)
  check_plan(plan, [3, 8], 8)
  for empty in ([], [0, 0, 0]):
    plan = pack_bfd(empty, 8)
    assert plan.num_bins == 0 and plan.num_chunks == 0 and plan.num_docs == len(empty)
  plan = pack_bfd(np.array([1, 1, 1], np.uint8), 1)
  assert plan.num_bins == 3


def test_one_million_lognormal_fast_and_tight():
  """Acceptance: 1M lognormal documents, max_len 8192: < 2 s, bins within 0.1% of the bound."""
  rng = np.random.default_rng(0)
  lengths = np.maximum(1, np.rint(np.exp(rng.normal(np.log(1024), 1.0, 1_000_000)))).astype(int)
  best = np.inf
  for _ in range(2):
    t = time.perf_counter()
    plan = pack_bfd(lengths, 8192)
    best = min(best, time.perf_counter() - t)
  lower = -(-int(lengths.sum()) // 8192)
  assert best < 2.0, best
  assert plan.num_bins <= lower * 1.001, (plan.num_bins, lower)
  assert plan.row_loads.sum() == lengths.sum() and plan.row_loads.max() <= 8192


# ----------------------------------------------------------------------------------------------
# materialize
# ----------------------------------------------------------------------------------------------

def make_docs(rng, lengths):
  # Token encodes (document, position) so misplaced tokens are caught.
  return [(1000 * (i + 1) + np.arange(n)).astype(np.int32) for i, n in enumerate(lengths)]


def numpy_segments(doc_lengths, max_len):
  b = doc_lengths.shape[0]
  seg = np.zeros((b, max_len), np.int32)
  pos = np.zeros((b, max_len), np.int32)
  for r in range(b):
    col, s = 0, 0
    for n in doc_lengths[r]:
      if n == 0:
        continue
      s += 1
      for p in range(n):
        if col < max_len:
          seg[r, col], pos[r, col] = s, p
        col += 1
  return seg, pos


@given(lengths=lengths_st, max_len=st.integers(1, 48), seed=st.integers(0, 2 ** 31))
def test_materialize_properties(lengths, max_len, seed):
  rng = np.random.default_rng(seed)
  docs = make_docs(rng, lengths)
  plan = pack_bfd(lengths, max_len)
  b = materialize(plan, docs, pad_id=-7)
  n = plan.num_bins
  assert b.tokens.shape == b.segment_ids.shape == b.positions.shape == (n, max_len)
  # Every non-padding slot holds the right token; tokens/doc_ids/chunk_starts agree.
  pad = b.segment_ids == 0
  assert (b.tokens[pad] == -7).all() and (b.positions[pad] == 0).all()
  assert pad.sum() == n * max_len - sum(lengths)
  for r in range(n):
    col = 0
    for s in range(b.doc_lengths.shape[1]):
      ln = b.doc_lengths[r, s]
      if ln == 0:
        assert b.doc_ids[r, s] == -1
        continue
      d, c0 = b.doc_ids[r, s], b.chunk_starts[r, s]
      np.testing.assert_array_equal(b.tokens[r, col:col + ln], docs[d][c0:c0 + ln])
      assert (b.segment_ids[r, col:col + ln] == s + 1).all()
      np.testing.assert_array_equal(b.positions[r, col:col + ln], np.arange(ln))
      col += ln
  # Segment ids and positions agree with the jitted construction from the chunk lengths.
  if n:
    seg, pos = segments_from_lengths(b.doc_lengths, max_len=max_len)
    np.testing.assert_array_equal(np.asarray(seg), b.segment_ids)
    np.testing.assert_array_equal(np.asarray(pos), b.positions)
  # Loss weights: predicting t + 1 from t within one chunk only.
  w = b.loss_weights
  assert (w[:, -1] == 0).all()
  same = (b.segment_ids[:, :-1] == b.segment_ids[:, 1:]) & (b.segment_ids[:, :-1] > 0)
  np.testing.assert_array_equal(w[:, :-1], same.astype(np.float32))
  assert w.sum() == sum(plan.chunk_lengths - 1)
  # Flat store gives the same rows; subsets of rows and empty rows (-1).
  store = TokenStore.from_documents(docs)
  b2 = materialize(plan, (store.tokens, store.offsets), pad_id=-7)
  np.testing.assert_array_equal(b2.tokens, b.tokens)
  if n:
    rows = rng.integers(-1, n, size=5)
    b3 = materialize(plan, store, rows, pad_id=-7)
    for i, r in enumerate(rows):
      if r < 0:
        assert (b3.segment_ids[i] == 0).all() and (b3.tokens[i] == -7).all()
      else:
        np.testing.assert_array_equal(b3.tokens[i], b.tokens[r])
        np.testing.assert_array_equal(b3.segment_ids[i], b.segment_ids[r])


def test_materialize_errors():
  plan = pack_bfd([3, 3, 3], 8)
  docs = [np.arange(3)] * 3
  with pytest.raises(ValueError, match="documents"):
    materialize(plan, docs[:2])
  with pytest.raises(ValueError, match="max_segments"):
    materialize(plan, docs, max_segments=1)
  with pytest.raises(ValueError, match="rows"):
    materialize(plan, docs, [plan.num_bins])
  with pytest.raises(ValueError):
    TokenStore(np.arange(5), np.array([0, 2, 4]))  # does not end at len(tokens)


def test_loss_weights_jax_and_numpy_agree():
  seg = np.array([[1, 1, 1, 2, 3, 3, 0, 0], [1, 2, 2, 2, 2, 2, 2, 2]], np.int32)
  expected = np.array([[1, 1, 0, 0, 1, 0, 0, 0], [0, 1, 1, 1, 1, 1, 1, 0]], np.float32)
  np.testing.assert_array_equal(loss_weights_from_segments(seg), expected)
  np.testing.assert_array_equal(np.asarray(jax.jit(loss_weights_from_segments)(seg)), expected)


# ----------------------------------------------------------------------------------------------
# segments_from_lengths under jit
# ----------------------------------------------------------------------------------------------

@given(st.lists(st.lists(st.integers(0, 9), min_size=5, max_size=5), min_size=3, max_size=3))
def test_segments_from_lengths_matches_numpy(rows):
  # Fixed shapes ([3, 5], max_len 24) so jit compiles once; zeros in the middle and rows longer
  # than max_len (cut) included.
  doc_lengths = np.array(rows, np.int32)
  seg, pos = segments_from_lengths(jnp.asarray(doc_lengths), max_len=24)
  ref_seg, ref_pos = numpy_segments(doc_lengths, 24)
  np.testing.assert_array_equal(np.asarray(seg), ref_seg)
  np.testing.assert_array_equal(np.asarray(pos), ref_pos)


def test_segments_from_lengths_inside_jit():
  @jax.jit
  def step(doc_lengths, x):
    seg, pos = segments_from_lengths(doc_lengths, max_len=x.shape[1])
    return seg, pos, jnp.sum(jnp.where(seg > 0, x, 0.0))

  dl = jnp.array([[3, 0, 2, 1], [6, 0, 0, 0]])
  seg, pos, total = step(dl, jnp.ones((2, 7)))
  assert seg.tolist() == [[1, 1, 1, 2, 2, 3, 0], [1, 1, 1, 1, 1, 1, 0]]
  assert pos.tolist() == [[0, 1, 2, 0, 1, 0, 0], [0, 1, 2, 3, 4, 5, 0]]
  assert float(total) == 12.0


# ----------------------------------------------------------------------------------------------
# PackedIterator
# ----------------------------------------------------------------------------------------------

def collect(it, n=None):
  out = []
  for i, b in enumerate(it):
    out.append(b)
    if n is not None and i + 1 == n:
      break
  return out


def chunks_of(batches):
  """Multiset of (doc, chunk_start, length) in a list of batches."""
  got = []
  for b in batches:
    m = b.doc_ids >= 0
    got += list(zip(b.doc_ids[m].tolist(), b.chunk_starts[m].tolist(), b.doc_lengths[m].tolist()))
  return got


@pytest.mark.parametrize("window", [None, 7])
def test_iterator_epochs_cover_each_document_once(window):
  rng = np.random.default_rng(1)
  lengths = rng.integers(0, 30, size=40)
  lengths[3] = 70  # split into chunks
  docs = make_docs(rng, lengths)
  it = PackedIterator(docs, max_len=16, batch_size=3, seed=5, window=window, num_epochs=2)
  steps = [it.steps_in_epoch(0), it.steps_in_epoch(1)]
  batches = collect(it)
  assert len(batches) == sum(steps)
  expected = sorted((int(d), int(c), int(min(16, lengths[d] - c)))
                    for d in range(len(lengths)) for c in range(0, int(lengths[d]), 16))
  for e0, e1 in ((0, steps[0]), (steps[0], sum(steps))):
    assert sorted(chunks_of(batches[e0:e1])) == expected
  for b in batches:  # shapes never change, tokens are the documents' tokens
    assert b.tokens.shape == (3, 16) and b.doc_lengths.shape == (3, it.max_segments)
    for r, s in zip(*np.nonzero(b.doc_ids >= 0)):
      col = b.doc_lengths[r, :s].sum()
      d, c0, ln = b.doc_ids[r, s], b.chunk_starts[r, s], b.doc_lengths[r, s]
      np.testing.assert_array_equal(b.tokens[r, col:col + ln], docs[d][c0:c0 + ln])
  # Epochs are shuffled differently.
  order0 = [tuple(b.doc_ids[:, 0]) for b in batches[:steps[0]]]
  order1 = [tuple(b.doc_ids[:, 0]) for b in batches[steps[0]:]]
  assert order0 != order1


def test_iterator_deterministic_and_seeded():
  rng = np.random.default_rng(2)
  docs = make_docs(rng, rng.integers(1, 20, size=30))
  a = collect(PackedIterator(docs, 16, 2, seed=3), 25)
  b = collect(PackedIterator(docs, 16, 2, seed=3), 25)
  c = collect(PackedIterator(docs, 16, 2, seed=4), 25)
  assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b))
  assert not all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, c))


def test_iterator_resume_every_step():
  rng = np.random.default_rng(3)
  docs = make_docs(rng, rng.integers(0, 25, size=23))
  kw = dict(max_len=16, batch_size=2, seed=9, num_epochs=3)
  full = collect(PackedIterator(docs, **kw))
  it = PackedIterator(docs, **kw)
  for i in range(len(full)):
    state = json.loads(json.dumps(it.get_state()))  # a checkpointable small dict
    it = PackedIterator(docs, **kw, state=state)  # fresh iterator each step
    b = next(it)
    np.testing.assert_array_equal(b.tokens, full[i].tokens)
    np.testing.assert_array_equal(b.doc_ids, full[i].doc_ids)
  with pytest.raises(StopIteration):
    next(it)
  with pytest.raises(ValueError, match="configuration"):
    PackedIterator(docs, **{**kw, "seed": 10}, state=it.get_state())
  with pytest.raises(ValueError, match="configuration"):
    PackedIterator(docs[:-1], **kw, state=it.get_state())


# ----------------------------------------------------------------------------------------------
# Attention side
# ----------------------------------------------------------------------------------------------

def numpy_causal_attention(q, k, v):
  """float64 causal attention of one document: q, k, v [len, heads, dim]."""
  s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
  s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  return np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v)


def test_packed_batch_attention_does_not_cross_documents():
  rng = np.random.default_rng(4)
  lengths = [37, 1, 20, 11, 29, 5, 50, 3]
  max_len = 64
  plan = pack_bfd(lengths, max_len)
  b = materialize(plan, make_docs(rng, lengths))
  seg = jnp.asarray(b.segment_ids)
  n, h, d = plan.num_bins, 2, 24
  ks = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 4)
  q, k, v = (jax.random.normal(kk, (n, max_len, h, d), jnp.float32) for kk in ks[:3])
  attn = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True, segment_ids=seg,
                                                 implementation="xla"))
  out = np.asarray(attn(q, k, v))
  # Each chunk equals causal attention over that document alone.
  for r in range(n):
    col = 0
    for ln in b.doc_lengths[r][b.doc_lengths[r] > 0]:
      sl = slice(col, col + ln)
      alone = numpy_causal_attention(*(np.asarray(x[r, sl], np.float64) for x in (q, k, v)))
      err = np.linalg.norm(out[r, sl] - alone) / np.linalg.norm(alone)
      assert err < 1e-6, err
      col += ln
  assert (out[b.segment_ids == 0] == 0).all()  # padding queries see nothing
  # Perturb one document's keys and values: only its own outputs change.
  r, s = np.argwhere(b.doc_lengths > 1)[0]
  m = jnp.asarray(b.segment_ids == s + 1)[..., None, None] & (jnp.arange(n) == r)[:, None, None,
                                                                                 None]
  noise = jax.random.normal(ks[3], k.shape)
  out2 = np.asarray(attn(q, jnp.where(m, k + noise, k), jnp.where(m, v + noise, v)))
  changed = np.abs(out2 - out).max(axis=(-1, -2)) > 0
  mask = np.asarray(m)[..., 0, 0]
  assert changed[mask].all()
  assert not changed[~mask].any()


def test_block_schedule_skips_cross_document_tiles():
  """A packed 16K row of four 4K documents visits as many tiles as four separate 4K rows."""
  one = int(make_schedule(4096, 4096, 128, 128, causal=True).visited_tiles()[0, 0])
  assert one == 32 * 33 // 2
  dense = int(make_schedule(16384, 16384, 128, 128, causal=True).visited_tiles()[0, 0])
  b = materialize(pack_bfd([4096] * 4, 16384), [np.zeros(4096, np.int32)] * 4)
  seg = jnp.asarray(b.segment_ids)
  assert seg.shape == (1, 16384) and int(seg.max()) == 4
  s = make_schedule(16384, 16384, 128, 128, causal=True, q_segment_ids=seg, kv_segment_ids=seg)
  packed = int(s.visited_tiles()[0, 0])
  assert packed == 4 * one == 2112
  assert dense == 128 * 129 // 2  # 3.9x more work without the segment mask
  # Unaligned documents: at most one extra boundary tile per (q tile, document boundary) pair.
  lengths = [4000, 4200, 4100, 4084]
  b = materialize(pack_bfd(lengths, 16384), [np.zeros(n, np.int32) for n in lengths])
  seg = jnp.asarray(b.segment_ids)
  s = make_schedule(16384, 16384, 128, 128, causal=True, q_segment_ids=seg, kv_segment_ids=seg)
  packed = int(s.visited_tiles()[0, 0])
  segs = np.asarray(seg[0]).reshape(128, 128)
  lo, hi = segs.min(1), segs.max(1)
  qi, kj = np.meshgrid(np.arange(128), np.arange(128), indexing="ij")
  expected = ((kj <= qi) & (hi[qi] >= lo[kj]) & (hi[kj] >= lo[qi])).sum()
  assert packed == expected
  separate = sum(int(make_schedule(n, n, 128, 128, causal=True).visited_tiles()[0, 0])
                 for n in lengths)
  assert separate <= packed <= separate * 1.05, (packed, separate)


@pytest.mark.gpu
def test_gpu_packed_batch_triton_matches_xla():
  """A BFD-packed bf16 batch through the Triton kernel: forward and VJP vs the fp32 reference."""
  rng = np.random.default_rng(5)
  max_len = 2048
  lengths = np.maximum(1, np.rint(np.exp(rng.normal(np.log(300), 1.2, 40)))).astype(int)
  plan = pack_bfd(lengths, max_len)
  b = materialize(plan, [np.zeros(n, np.int32) for n in lengths], rows=np.arange(2))
  seg = jnp.asarray(b.segment_ids)
  ks = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 4)
  q = jax.random.normal(ks[0], (2, max_len, 4, 64), jnp.bfloat16)
  k = jax.random.normal(ks[1], (2, max_len, 2, 64), jnp.bfloat16)
  v = jax.random.normal(ks[2], (2, max_len, 2, 64), jnp.bfloat16)
  ct = jax.random.normal(ks[3], q.shape, jnp.float32)

  def run(impl, dtype):
    def f(q, k, v):
      return flash_attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), causal=True,
                             segment_ids=seg, implementation=impl)
    out, vjp = jax.vjp(f, q, k, v)
    return (out,) + vjp(ct.astype(out.dtype))

  got = jax.jit(lambda: run("triton", jnp.bfloat16))()
  want = jax.jit(lambda: run("xla", jnp.float32))()
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    assert np.isfinite(g).all(), name
    assert np.linalg.norm(g - w) / np.linalg.norm(w) < 2e-2, name


def test_materialize_checks_document_lengths_for_every_store_form():
  plan = pack_bfd([5, 3], max_len=8)
  short_first = [[1, 2], [10, 11, 12, 13, 14, 15]]        # same count, lengths 2 and 6
  longer = [[1, 2, 3, 4, 5, 6, 7], [10, 11, 12]]           # would be silently truncated
  for docs in (short_first, longer):
    store = TokenStore.from_documents(docs)
    for form in (docs, store, (store.tokens, store.offsets)):
      with pytest.raises(ValueError, match=r"store document 0 has \d tokens, the plan's has 5"):
        materialize(plan, form)
  good = [[1, 2, 3, 4, 5], [10, 11, 12]]
  store = TokenStore.from_documents(good)
  for form in (good, store, (store.tokens, store.offsets)):
    assert materialize(plan, form).tokens.tolist() == [[1, 2, 3, 4, 5, 10, 11, 12]]
  # Only the rows built are read: a row-subset call checks those rows' documents.
  plan2 = pack_bfd([8, 3], max_len=8)
  with pytest.raises(ValueError, match="store document 1"):
    materialize(plan2, [np.arange(8), np.arange(4)], rows=[plan2.bins[1]])


def test_materialize_rejects_non_integer_rows_tokens_and_pad_id():
  plan = pack_bfd([3, 2], max_len=8)
  docs = [np.arange(3), np.arange(2)]
  with pytest.raises(TypeError, match="rows"):
    materialize(plan, docs, rows=[0.7])
  with pytest.raises(TypeError, match="store: tokens must be integers"):
    materialize(plan, [np.array([1.5, 2.5, 3.5]), np.arange(2)])
  with pytest.raises(TypeError, match="tokens"):
    TokenStore(np.ones(3), np.array([0, 3]))
  for bad in (2.5, True, 300):
    with pytest.raises(ValueError, match="pad_id"):
      materialize(plan, [np.arange(3, dtype=np.uint8), np.arange(2, dtype=np.uint8)], pad_id=bad)
  for bad in (0, 2.5):
    with pytest.raises(ValueError, match="max_segments"):
      materialize(plan, docs, max_segments=bad)
  b = materialize(plan, docs, rows=np.array([0, -1], np.int32), pad_id=np.int64(-1))
  assert b.tokens.tolist() == [[0, 1, 2, 0, 1, -1, -1, -1], [-1] * 8]
  assert TokenStore.from_documents([[], [4, 5]]).tokens.dtype.kind == "i"   # empty docs: no cast


@pytest.mark.parametrize("kw,name", [
    (dict(max_len=2.7), "max_len"), (dict(batch_size=2.5), "batch_size"),
    (dict(batch_size=True), "batch_size"), (dict(seed=-1), "seed"), (dict(seed=1.9), "seed"),
    (dict(window=2.5), "window"), (dict(window=0), "window"), (dict(num_epochs=-1), "num_epochs"),
    (dict(num_epochs=1.5), "num_epochs"), (dict(pad_id=2.5), "pad_id"),
    (dict(max_segments=0), "max_segments")])
def test_packed_iterator_rejects_bad_arguments(kw, name):
  docs = [np.arange(1, n + 1) for n in (5, 3, 4)]
  with pytest.raises(ValueError, match=name):
    PackedIterator(docs, **{"max_len": 8, "batch_size": 1, **kw})


def test_packed_iterator_valid_integer_arguments():
  docs = [np.arange(1, n + 1) for n in (5, 3, 4)]
  it = PackedIterator(docs, np.int64(8), np.int32(2), seed=2**40, window=np.int64(2),
                      num_epochs=0, pad_id=-1)
  assert list(it) == [] and json.dumps(it.get_state())             # zero epochs: nothing
  it = PackedIterator(docs, 8, 2, seed=3, num_epochs=1)
  assert sum(b.segment_ids.astype(bool).sum() for b in it) == 12
  state = it.get_state()
  with pytest.raises(ValueError, match="step"):
    it.set_state({**state, "step": 1.5})
  with pytest.raises(ValueError, match="epoch"):
    it.set_state({**state, "epoch": -1})


def test_zero_document_rows_are_padding_and_unsigned_lengths_keep_their_value():
  seg, pos = segments_from_lengths(np.zeros((2, 0), np.int32), 4)
  assert seg.shape == pos.shape == (2, 4) and not seg.any() and not pos.any()
  seg, pos = jax.jit(lambda d: segments_from_lengths(d, 3))(jnp.zeros((1, 0), jnp.int32))
  assert seg.tolist() == pos.tolist() == [[0, 0, 0]]
  with pytest.raises(ValueError, match=r"lengths\[0\] = 9223372036854775813"):
    pack_bfd(np.array([2**63 + 5], np.uint64), 8)
  with pytest.raises(ValueError, match=r"lengths\[1\] = -2"):
    pack_bfd([3, -2], 8)
  assert pack_bfd(np.array([5, 3], np.uint64), 8).doc_lengths.tolist() == [5, 3]
