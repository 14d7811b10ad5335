"""Tests of jattn.sparse: selection rules, block-sparse attention, gate gradients, captured mass,
sparse decode. Brute-force numpy/jnp references are written here, independent of the module."""
import functools
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jattn import debug_checks
from jattn import sparse as sp
from jattn.sparse import decode as sp_decode
from pallas_kernels.flash.reference import attention_reference
from tests.helpers import ci_cases, normal

HI = jax.lax.Precision.HIGHEST
# One compiled program per call shape (much faster on CPU than op-by-op dispatch).
select = jax.jit(sp.select_blocks, static_argnames=(
    "block_size", "top_k", "q_block_size", "causal", "num_init_blocks", "num_local_blocks",
    "score"))


def _rel(x, ref):
  x = np.asarray(x, np.float64)
  ref = np.asarray(ref, np.float64)
  return np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30)


def _qkv(seed, b, sq, sk, hq, hk, d, dtype=jnp.float32):
  return normal(seed, (b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, d), dtype=dtype)


def _packed_segments(rng, b, n, max_docs=4, pad=True):
  seg = np.zeros((b, n), np.int32)
  for r in range(b):
    cuts = np.sort(rng.choice(np.arange(1, n), size=max_docs - 1, replace=False))
    bounds = [0, *cuts, n]
    for t in range(max_docs):
      seg[r, bounds[t]:bounds[t + 1]] = t + 1
    if pad:
      seg[r, n - rng.integers(0, n // 5):] = 0
  return seg


def _expected_scores(q, k, qbs, bs, qseg=None, kseg=None):
  q = np.asarray(q, np.float64)
  k = np.asarray(k, np.float64)
  b, sq, hq, d = q.shape
  _, sk, hk, _ = k.shape
  nq, nk = -(-sq // qbs), -(-sk // bs)

  def means(x, block, n_blocks, seg):
    out = np.zeros((x.shape[0], n_blocks) + x.shape[2:])
    for bi in range(x.shape[0]):
      for i in range(n_blocks):
        rows = np.arange(i * block, min((i + 1) * block, x.shape[1]))
        if seg is not None:
          rows = rows[seg[bi, rows] != 0]
        if len(rows):
          out[bi, i] = x[bi, rows].mean(0)
    return out

  qbar = means(q, qbs, nq, qseg).reshape(b, nq, hk, hq // hk, d).sum(3)
  kbar = means(k, bs, nk, kseg)
  return np.einsum("bihd,bjhd->bhij", qbar, kbar)


def _check_rules(sel, scores, *, sq, sk, qbs, bs, top_k, ni, nl, causal, qseg=None, kseg=None):
  """Brute-force check of every selection rule; returns the number of rows checked."""
  idx = np.asarray(sel.indices)
  cnt = np.asarray(sel.counts)
  b, hk, nq, ms = idx.shape
  nk = -(-sk // bs)
  off = sk - sq
  rows = 0
  for bi in range(b):
    for g in range(hk):
      for i in range(nq):
        q_first = i * qbs + off
        q_last = min((i + 1) * qbs, sq) - 1 + off
        row = idx[bi, g, i]
        c = cnt[bi, g, i]
        assert (row[:c] >= 0).all() and (row[c:] == -1).all()
        assert (np.diff(row[:c]) > 0).all(), row
        chosen = set(row[:c].tolist())
        vis = set(range(nk)) if not causal else {j for j in range(nk) if j * bs <= q_last}
        if qseg is not None:
          qs = set(qseg[bi, max(i * qbs, 0):min((i + 1) * qbs, sq)].tolist()) - {0}
          vis = {j for j in vis if qs & (set(kseg[bi, j * bs:(j + 1) * bs].tolist()) - {0})}
        init = set(range(ni))
        if qseg is not None:
          # Initial blocks of the query block's document (its smallest nonzero id): the blocks
          # from the one holding that document's first key on.
          init = set()
          if qs and (kseg[bi] == min(qs)).any():
            first = int(np.argmax(kseg[bi] == min(qs))) // bs
            init = set(range(first, first + ni))
        forced = {j for j in vis if j in init}
        if nl > 0 and q_last >= 0:
          forced |= {j for j in vis if max(q_first, 0) // bs - (nl - 1) <= j <= q_last // bs}
        assert chosen <= vis, ("future/invisible block selected", bi, g, i, chosen - vis)
        assert forced <= chosen, ("forced block missing", bi, g, i, forced - chosen)
        others = chosen - forced
        rest = vis - chosen
        want = top_k if isinstance(top_k, int) else int(top_k * len(vis) + 0.5) - len(forced)
        assert len(others) == min(max(want, 0), len(vis - forced)), (len(others), top_k)
        if others and rest:
          lo = min(scores[bi, g, i, j] for j in others)
          hi = max(scores[bi, g, i, j] for j in rest)
          assert lo >= hi - 1e-5 * (1 + abs(hi)), (lo, hi)
        rows += 1
  return rows


SELECTION_CASES = [
    # b, sq, sk, hq, hk, d, bs, qbs, top_k, ni, nl, causal
    (2, 300, 300, 4, 2, 16, 32, 32, 2, 1, 1, True),
    (1, 40, 130, 4, 1, 8, 16, 1, 3, 1, 2, True),      # per-token, q_len < kv_len
    (1, 200, 200, 2, 2, 8, 16, 64, 3, 2, 1, True),    # q block spans 4 key blocks
    (1, 96, 96, 3, 1, 8, 16, 16, 2, 0, 0, False),     # non-causal, nothing forced
    # a fractional top_k: each row keeps that share of its visible blocks in total
    (1, 40, 130, 4, 1, 8, 16, 1, 0.19, 1, 2, True),   # per-token
    (2, 300, 300, 4, 2, 16, 32, 32, 0.5, 1, 1, True),
    (1, 200, 200, 2, 2, 8, 16, 64, 0.3, 2, 1, True),
    (1, 96, 96, 3, 1, 8, 16, 16, 0.25, 0, 0, False),
]
# Rows with fewer candidates than top_k ("all of them when fewer remain") occur in every causal
# case (early query blocks).


@pytest.mark.parametrize("case", SELECTION_CASES)
def test_selection_rules(case):
  b, sq, sk, hq, hk, d, bs, qbs, top_k, ni, nl, causal = case
  q, k, _ = _qkv(sum(case[:8]), b, sq, sk, hq, hk, d)
  sel = select(q, k, block_size=bs, q_block_size=qbs, top_k=top_k, causal=causal,
                         num_init_blocks=ni, num_local_blocks=nl)
  scores = _expected_scores(q, k, qbs, bs)
  np.testing.assert_allclose(np.asarray(sel.scores), scores, rtol=1e-4, atol=1e-4)
  assert sel.indices.dtype == jnp.int32
  assert sel.indices.shape[:3] == (b, hk, -(-sq // qbs))
  rows = _check_rules(sel, scores, sq=sq, sk=sk, qbs=qbs, bs=bs, top_k=top_k, ni=ni, nl=nl,
                      causal=causal)
  assert rows == b * hk * (-(-sq // qbs))
  assert sel.max_selected == int(np.asarray(sel.counts).max())   # the static width is exact
  # tile_mask / to_mask agree with the index lists.
  tm = np.asarray(sel.tile_mask())
  assert tm.sum() == int(np.asarray(sel.counts).sum())
  em = np.asarray(sel.to_mask(sq, sk))
  assert em.shape == (b, hk, sq, sk)
  bi, g, i = b - 1, hk - 1, (sq - 1) // qbs
  for j in range(-(-sk // bs)):
    assert em[bi, g, sq - 1, j * bs] == tm[bi, g, i, j]


def test_selection_gqa_shared_and_jit():
  b, s, hq, hk, d = 1, 256, 6, 2, 16
  q, k, _ = _qkv(3, b, s, s, hq, hk, d)
  f = jax.jit(functools.partial(sp.select_blocks, block_size=32, q_block_size=32, top_k=2))
  sel = f(q, k)
  # The selection of kv head g depends on the sum of its query heads only: permuting the query
  # heads inside a group leaves it unchanged; moving a head to the other group changes it.
  perm = jnp.array([2, 0, 1, 5, 3, 4])
  sel2 = f(q[:, :, perm], k)
  np.testing.assert_array_equal(np.asarray(sel.indices), np.asarray(sel2.indices))
  swap = jnp.array([3, 4, 5, 0, 1, 2])
  sel3 = f(q[:, :, swap], k)
  assert not np.array_equal(np.asarray(sel.indices), np.asarray(sel3.indices))
  # density: 0 < visible fraction <= 1 and the "all" fraction is smaller under causal.
  assert 0 < float(sel.density("all")) < float(sel.density("visible")) <= 1


def test_selection_segments():
  rng = np.random.default_rng(0)
  b, s, hq, hk, d, bs, qbs = 2, 256, 2, 1, 8, 16, 16
  q, k, _ = _qkv(4, b, s, s, hq, hk, d)
  seg = _packed_segments(rng, b, s)
  sel = select(q, k, block_size=bs, q_block_size=qbs, top_k=3, segment_ids=jnp.asarray(seg))
  scores = _expected_scores(q, k, qbs, bs, seg, seg)
  np.testing.assert_allclose(np.asarray(sel.scores), scores, rtol=1e-4, atol=1e-4)
  _check_rules(sel, scores, sq=s, sk=s, qbs=qbs, bs=bs, top_k=3, ni=1, nl=1, causal=True,
               qseg=seg, kseg=seg)
  # Documents restrict the choice: fewer blocks than without segments.
  sel0 = select(q, k, block_size=bs, q_block_size=qbs, top_k=3)
  assert int(sel.counts.sum()) < int(sel0.counts.sum())


def _rows_from_docs(n, layout):
  """One row of segment ids from [(doc length or -pad length)], ids 1, 2, .. in order."""
  row, doc = [], 0
  for ln in layout:
    if ln < 0:
      row += [0] * -ln
    else:
      doc += 1
      row += [doc] * ln
  assert len(row) == n, len(row)
  return row


# Packed rows of awkward lengths (70, 130, 1, 55; one-token documents; documents starting
# mid-block), padding at the end, at the front and between documents, and one single document.
PACKED_ROWS = [[70, 130, 1, 55, -44], [-10, 40, -5, 100, 1, 100, -44], [55, 1, 130, 70, 1, -43],
               [300]]
PACKED_CASES = [
    # bs, qbs, top_k, ni, nl, causal
    (16, 16, 3, 1, 1, True),
    (16, 16, 0.4, 1, 1, True),  # a share of each query block's own document's blocks
    (16, 16, 2, 2, 2, True),
    (16, 32, 3, 2, 1, True),    # a query block spans two key blocks
    (16, 16, 2, 2, 2, False),   # non-causal: the per-document bound on max_selected is used
]


@pytest.mark.parametrize("case", PACKED_CASES)
def test_selection_packed_documents_keep_their_initial_blocks(case):
  """With segment ids every query block keeps the first num_init blocks of its own document."""
  bs, qbs, top_k, ni, nl, causal = case
  s, hq, hk, d = 300, 4, 2, 8
  seg = np.array([_rows_from_docs(s, r) for r in PACKED_ROWS], np.int32)
  b = seg.shape[0]
  q, k, _ = _qkv(7 + int(sum(case[:5])), b, s, s, hq, hk, d)
  sel = select(q, k, block_size=bs, q_block_size=qbs, top_k=top_k, causal=causal,
               num_init_blocks=ni, num_local_blocks=nl, segment_ids=jnp.asarray(seg))
  scores = _expected_scores(q, k, qbs, bs, seg, seg)
  np.testing.assert_allclose(np.asarray(sel.scores), scores, rtol=1e-4, atol=1e-4)
  # every rule (document-initial blocks kept, nothing invisible / from another document, exactly
  # top_k others with the highest scores), with the module's scores for the ranking
  rows = _check_rules(sel, np.asarray(sel.scores), sq=s, sk=s, qbs=qbs, bs=bs, top_k=top_k, ni=ni,
                      nl=nl, causal=causal, qseg=seg, kseg=seg)
  nq = -(-s // qbs)
  assert rows == b * hk * nq
  # The rule is exercised: rows whose document-initial block is neither block 0..ni-1 nor local
  # (so only the per-document rule keeps it), and they keep it.
  idx = np.asarray(sel.indices)
  exercised = 0
  for bi in range(b):
    for i in range(nq):
      qs = set(seg[bi, i * qbs:(i + 1) * qbs].tolist()) - {0}
      if not qs:
        continue
      first = int(np.argmax(seg[bi] == min(qs))) // bs
      q_first, q_last = i * qbs, min((i + 1) * qbs, s) - 1
      local_lo = q_first // bs - (nl - 1) if nl else s
      if first >= ni and first < local_lo and (not causal or first * bs <= q_last):
        assert (idx[bi, :, i] == first).any(axis=-1).all(), (bi, i, first)
        exercised += 1
  assert exercised >= 10, exercised
  # The static width: exact maximum count under causal (unchanged by segment ids), a bound
  # otherwise.
  sel0 = select(q, k, block_size=bs, q_block_size=qbs, top_k=top_k, causal=causal,
                num_init_blocks=ni, num_local_blocks=nl)
  assert sel.max_selected >= int(np.asarray(sel.counts).max())
  if causal:
    assert sel.max_selected == sel0.max_selected
  # One document without padding: the same selection as without segment ids.
  np.testing.assert_array_equal(np.asarray(sel.indices)[-1], np.asarray(sel0.indices)[-1])


def test_selection_packed_documents_jit_and_sparse_attention():
  """Eager == jit, and sparse_attention (jitted) selects the same blocks as select_blocks."""
  bs = qbs = 16
  s, hq, hk, d = 300, 4, 2, 8
  seg = jnp.asarray(np.array([_rows_from_docs(s, r) for r in PACKED_ROWS[:3]], np.int32))
  q, k, v = _qkv(11, seg.shape[0], s, s, hq, hk, d)
  kw = dict(block_size=bs, q_block_size=qbs, top_k=2, num_init_blocks=2, num_local_blocks=1)
  eager = sp.select_blocks(q, k, segment_ids=seg, **kw)
  jitted = jax.jit(lambda q, k, seg: sp.select_blocks(q, k, segment_ids=seg, **kw))(q, k, seg)
  np.testing.assert_array_equal(np.asarray(eager.indices), np.asarray(jitted.indices))
  f = jax.jit(lambda q, k, v, seg: sp.sparse_attention(q, k, v, segment_ids=seg,
                                                       implementation="xla",
                                                       return_selection=True, **kw))
  _, sel = f(q, k, v, seg)
  np.testing.assert_array_equal(np.asarray(sel.indices), np.asarray(eager.indices))
  # the second document of row 0 (keys 70..199) starts in key block 4: its query blocks keep it
  idx = np.asarray(eager.indices)
  for i in range(5, 13):
    assert (idx[0, :, i] == 4).any(-1).all() and (idx[0, :, i] == 5).any(-1).all(), i
    assert not ((idx[0, :, i] >= 0) & (idx[0, :, i] < 4)).any(), i   # not from the 1st document


def test_selection_non_monotone_segments_stay_selectable():
  """Documents out of order / interleaved: the initial-block rule may pick a less useful block
  but never one that is causally invisible or outside the query block's id range."""
  bs = qbs = 16
  s, hq, hk, d = 160, 2, 1, 8
  seg = np.array([[3] * 40 + [1] * 50 + [0] * 10 + [2] * 60,
                  ([1, 2] * 80)], np.int32)
  q, k, _ = _qkv(13, 2, s, s, hq, hk, d)
  sel = select(q, k, block_size=bs, q_block_size=qbs, top_k=1, num_init_blocks=2,
               num_local_blocks=1, segment_ids=jnp.asarray(seg))
  idx, cnt = np.asarray(sel.indices), np.asarray(sel.counts)
  nk = -(-s // bs)
  rng = lambda row, lo, hi: (min([x for x in row[lo:hi] if x] or [2**31 - 1]), max(row[lo:hi]))
  for bi in range(2):
    for i in range(s // qbs):
      row = idx[bi, 0, i]
      assert (row[:cnt[bi, 0, i]] >= 0).all() and (np.diff(row[:cnt[bi, 0, i]]) > 0).all()
      qmn, qmx = rng(seg[bi], i * qbs, (i + 1) * qbs)
      for j in row[:cnt[bi, 0, i]]:
        assert j < nk and j * bs <= (i + 1) * qbs - 1, (bi, i, j)
        kmn, kmx = rng(seg[bi], j * bs, (j + 1) * bs)
        assert qmx > 0 and kmx > 0 and qmn <= kmx and kmn <= qmx, (bi, i, j)


# Packed rows with negative (and mixed-sign) document ids, nonzero ids non-decreasing, padding
# (id 0) at the front, between documents and at the end, a one-token document, documents
# starting mid-block and an all-padding 16-block; length 100 (blocks of 16: ragged last block).
NEG_ROWS = [[-3] * 20 + [-1] * 30 + [0] * 5 + [2] * 25 + [0] * 20,
            [0] * 10 + [-5] * 17 + [-2] + [-1] * 40 + [4] * 32,
            [-2] * 33 + [0] * 20 + [-1] * 47,
            [-9] * 100]


def _shift_ids(seg, by=100):
  """Order-preserving map of the nonzero ids to positive ones (0 stays padding)."""
  seg = np.asarray(seg)
  return np.where(seg != 0, seg + by, 0).astype(np.int32)


def _block_ranges_np(seg, block):
  b, n = seg.shape
  nb = -(-n // block)
  lo = np.full((b, nb), np.iinfo(np.int32).max, np.int64)
  hi = np.full((b, nb), np.iinfo(np.int32).min, np.int64)
  for bi in range(b):
    for j in range(nb):
      ids = [x for x in seg[bi, j * block:(j + 1) * block].tolist() if x != 0]
      if ids:
        lo[bi, j], hi[bi, j] = min(ids), max(ids)
  return lo, hi


@pytest.mark.parametrize("qbs,bs", ci_cases([(16, 16), (8, 16), (32, 16)], [(8, 16)]))
def test_segment_ranges_and_doc_start_negative_ids(qbs, bs):
  """Every nonzero id, negative included, is a document (only 0 is padding): the per-block
  ranges, the block overlap and the document-start block against brute force, and equal to
  those of the same rows with the ids shifted positive; int32-extreme ids and an all-padding
  row too."""
  i32 = np.iinfo(np.int32)
  extreme = [[0] * 20 + [i32.min] * 10 + [-1] * 7 + [0] * 3 + [i32.max] * 60,
             [0] * 100]
  seg = np.array(NEG_ROWS + extreme, np.int32)
  n = seg.shape[1]
  nq, nk = -(-n // qbs), -(-n // bs)
  segj = jnp.asarray(seg)
  # each function as one jitted program (block sizes static)
  segment_ranges = jax.jit(sp.selection.segment_ranges, static_argnums=1)
  segment_overlap = jax.jit(sp.selection.segment_overlap, static_argnums=(2, 3))
  doc_start_blocks = jax.jit(sp.selection.doc_start_blocks, static_argnums=(2, 3))
  lo, hi = (np.asarray(x) for x in segment_ranges(segj, bs))
  elo, ehi = _block_ranges_np(seg, bs)
  np.testing.assert_array_equal(lo, elo)
  np.testing.assert_array_equal(hi, ehi)
  # overlap: both blocks hold a nonzero id and the ranges intersect
  qlo, qhi = _block_ranges_np(seg, qbs)
  has_q, has_k = qlo <= qhi, elo <= ehi
  want = (has_q[:, :, None] & has_k[:, None, :] & (qlo[:, :, None] <= ehi[:, None, :])
          & (elo[:, None, :] <= qhi[:, :, None]))
  got = np.asarray(segment_overlap(segj, segj, qbs, bs))
  np.testing.assert_array_equal(got, want)
  # doc start: the block of the first key of the query block's smallest nonzero id; nk for an
  # all-padding query block
  ds = np.asarray(doc_start_blocks(segj, segj, qbs, bs))
  want_ds = np.full((seg.shape[0], nq), nk)
  for bi in range(seg.shape[0]):
    for i in range(nq):
      if has_q[bi, i]:
        want_ds[bi, i] = int(np.argmax(seg[bi] == qlo[bi, i])) // bs
  np.testing.assert_array_equal(ds, want_ds)
  # the negative rows give what their positive shift gives
  neg = jnp.asarray(np.array(NEG_ROWS, np.int32))
  pos = jnp.asarray(_shift_ids(NEG_ROWS))
  np.testing.assert_array_equal(np.asarray(segment_overlap(neg, neg, qbs, bs)),
                                np.asarray(segment_overlap(pos, pos, qbs, bs)))
  np.testing.assert_array_equal(np.asarray(doc_start_blocks(neg, neg, qbs, bs)),
                                np.asarray(doc_start_blocks(pos, pos, qbs, bs)))


@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_negative_segment_ids_match_shifted(impl):
  """Block selection and block-sparse attention with negative document ids == the same calls
  with the ids shifted positive (order-preserving), and every selection rule holds; real query
  rows attend (finite lse) and padding rows give 0."""
  if impl == "triton":
    _kernel_module_or_skip("triton")
  bs = qbs = 16
  neg = np.array(NEG_ROWS, np.int32)
  pos = _shift_ids(neg)
  b, s = neg.shape
  hq, hk, d = 2, 1, 16
  q, k, v = _qkv(23, b, s, s, hq, hk, d)
  kw = dict(block_size=bs, q_block_size=qbs, top_k=1, num_init_blocks=1, num_local_blocks=1)
  sel_n = select(q, k, segment_ids=jnp.asarray(neg), **kw)
  sel_p = select(q, k, segment_ids=jnp.asarray(pos), **kw)
  np.testing.assert_array_equal(np.asarray(sel_n.indices), np.asarray(sel_p.indices))
  np.testing.assert_array_equal(np.asarray(sel_n.counts), np.asarray(sel_p.counts))
  _check_rules(sel_n, np.asarray(sel_n.scores), sq=s, sk=s, qbs=qbs, bs=bs, top_k=1, ni=1, nl=1,
               causal=True, qseg=neg, kseg=neg)
  extra = dict(interpret=True) if impl == "triton" else {}
  attn = jax.jit(lambda q, k, v, seg, sel: sp.block_sparse_attention(
      q, k, v, sel, segment_ids=seg, return_lse=True, implementation=impl, **extra))
  out_n, lse_n = attn(q, k, v, jnp.asarray(neg), sel_n)
  out_p, lse_p = attn(q, k, v, jnp.asarray(pos), sel_p)
  np.testing.assert_allclose(np.asarray(out_n), np.asarray(out_p), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(lse_n), np.asarray(lse_p), rtol=1e-5, atol=1e-5)
  real = neg != 0
  lse_n = np.asarray(lse_n)
  assert np.isfinite(lse_n.transpose(0, 2, 1)[real]).all()
  assert (lse_n.transpose(0, 2, 1)[~real] == -np.inf).all()
  allowed = _allowed_from_indices(sel_n, s, s, True, neg, neg)
  ref = _dense(q, k, v, allowed, 1 / np.sqrt(d))
  assert _rel(out_n, ref) < 2e-3, _rel(out_n, ref)
  if impl == "xla":
    # sparse_attention (selection + attention in one call)
    f = jax.jit(lambda q, k, v, seg: sp.sparse_attention(q, k, v, segment_ids=seg,
                                                         implementation="xla", **kw))
    np.testing.assert_allclose(np.asarray(f(q, k, v, jnp.asarray(neg))),
                               np.asarray(f(q, k, v, jnp.asarray(pos))), rtol=1e-5, atol=1e-5)


def _committed_selection(scores, *, sq, sk, qbs, bs, top_k, ni, nl, causal):
  """Reference of the rule without segment ids: forced = blocks 0..ni-1 and the local blocks
  (when visible), then the top_k highest scores of the rest; ascending, -1 padded."""
  b, hk, nq, nk = scores.shape
  off = sk - sq
  rows = np.full((b, hk, nq, nk), -1, np.int64)
  for bi in range(b):
    for g in range(hk):
      for i in range(nq):
        q_first, q_last = i * qbs + off, min((i + 1) * qbs, sq) - 1 + off
        vis = [j for j in range(nk) if not causal or j * bs <= q_last]
        forced = {j for j in vis if j < ni}
        if nl > 0 and q_last >= 0:
          forced |= {j for j in vis if max(q_first, 0) // bs - (nl - 1) <= j <= q_last // bs}
        rest = sorted((j for j in vis if j not in forced), key=lambda j: -scores[bi, g, i, j])
        kept = sorted(forced | set(rest[:top_k]))
        rows[bi, g, i, :len(kept)] = kept
  return rows


@pytest.mark.parametrize("case", [c for c in SELECTION_CASES if isinstance(c[8], int)]
                         + [(2, 257, 257, 4, 2, 8, 16, 16, 3, 3, 2, True)])
def test_selection_without_segments_unchanged(case):
  """Without segment ids the initial blocks are the row's blocks 0..num_init-1, as before."""
  b, sq, sk, hq, hk, d, bs, qbs, top_k, ni, nl, causal = case
  q, k, _ = _qkv(100 + sum(case[:8]), b, sq, sk, hq, hk, d)
  sel = select(q, k, block_size=bs, q_block_size=qbs, top_k=top_k, causal=causal,
               num_init_blocks=ni, num_local_blocks=nl)
  ref = _committed_selection(np.asarray(sel.scores), sq=sq, sk=sk, qbs=qbs, bs=bs, top_k=top_k,
                             ni=ni, nl=nl, causal=causal)
  ms = sel.max_selected
  assert (ref[..., ms:] == -1).all()
  np.testing.assert_array_equal(np.asarray(sel.indices), ref[..., :ms])


# ----------------------------------------------------------------------------- attention
def _allowed_from_indices(sel, sq, sk, causal, qseg=None, kseg=None):
  """Element mask [b, hk, sq, sk] built by loops from the index lists (independent of to_mask)."""
  idx = np.asarray(sel.indices)
  b, hk, nq, _ = idx.shape
  qbs, bs = sel.q_block_size, sel.block_size
  m = np.zeros((b, hk, sq, sk), bool)
  for bi in range(b):
    for g in range(hk):
      for i in range(nq):
        for j in idx[bi, g, i]:
          if j >= 0:
            m[bi, g, i * qbs:(i + 1) * qbs, j * bs:(j + 1) * bs] = True
  qp = np.arange(sq)[:, None] + sk - sq
  kp = np.arange(sk)[None, :]
  if causal:
    m &= (kp <= qp)[None, None]
  if qseg is not None:
    m &= ((qseg[:, :, None] == kseg[:, None, :]) & (kseg[:, None, :] != 0))[:, None]
  return m


def _dense(q, k, v, allowed, scale, bias=None):
  """fp32 masked softmax attention, [b, s, h, d] layout, optional additive logit bias
  [b, hk, sq, sk]; empty rows give 0."""
  b, sq, hq, d = q.shape
  hk = k.shape[2]
  g = hq // hk
  qf = q.astype(jnp.float32).reshape(b, sq, hk, g, d)
  s = jnp.einsum("bqhgd,bkhd->bhgqk", qf, k.astype(jnp.float32), precision=HI) * scale
  if bias is not None:
    s = s + bias[:, :, None]
  allowed = jnp.asarray(allowed)[:, :, None]
  s = jnp.where(allowed, s, -jnp.inf)
  m = jax.lax.stop_gradient(jnp.max(jnp.where(allowed, s, -1e30), -1, keepdims=True))
  p = jnp.where(allowed, jnp.exp(s - m), 0.0)
  l = p.sum(-1, keepdims=True)
  p = p / jnp.where(l == 0, 1.0, l)
  o = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(jnp.float32), precision=HI)
  return o.reshape(b, sq, hq, v.shape[-1])


def _vjp_check(f_test, f_ref, args, seed, tol):
  """Forward and VJP (random cotangent) of f_test vs f_ref, each in one jitted program."""
  def run(f):
    def g(args, ct):
      out, vjp = jax.vjp(f, *args)
      return out, vjp(ct.astype(out.dtype))
    return g
  shape = jax.eval_shape(f_ref, *args).shape
  ct, = normal(seed, shape)
  out_t, g_t = jax.jit(run(f_test))(args, ct)
  out_r, g_r = jax.jit(run(f_ref))(args, ct)
  assert _rel(out_t, out_r) < tol, _rel(out_t, out_r)
  for name, gt, gr in zip("qkv", g_t, g_r):
    assert _rel(gt, gr) < tol, (name, _rel(gt, gr))
  return g_t


@pytest.mark.parametrize("segments", [False, True])
def test_block_sparse_attention_xla(segments):
  rng = np.random.default_rng(1)
  b, sq, sk, hq, hk, d, bs, qbs = 2, 150, 200, 4, 2, 24, 32, 16
  q, k, v = _qkv(5 + segments, b, sq, sk, hq, hk, d)
  qseg = kseg = None
  if segments:
    kseg = _packed_segments(rng, b, sk, pad=False)
    qseg = kseg[:, sk - sq:].copy()
    qseg[0, -7:] = 0                                        # padded (empty) query rows
  kw = dict(segment_ids=None if qseg is None else jnp.asarray(qseg),
            kv_segment_ids=None if kseg is None else jnp.asarray(kseg))
  sel = select(q, k, block_size=bs, q_block_size=qbs, top_k=2, **kw)
  allowed = _allowed_from_indices(sel, sq, sk, True, qseg, kseg)
  scale = 0.3
  _vjp_check(
      lambda q, k, v: sp.block_sparse_attention(q, k, v, sel, scale=scale, implementation="xla",
                                                **kw),
      lambda q, k, v: _dense(q, k, v, allowed, scale), (q, k, v), 11, 2e-3)
  out, lse = sp.block_sparse_attention(q, k, v, sel, return_lse=True, implementation="xla", **kw)
  assert lse.shape == (b, hq, sq)
  if segments:
    assert np.all(np.asarray(lse[0, :, -7:]) == -np.inf)
    assert np.all(np.asarray(out[0, -7:]) == 0)


def _kernel_module_or_skip(impl):
  from jattn.attention import kernel_module
  try:
    return kernel_module(impl)
  except ImportError as e:
    pytest.skip(f"{impl} kernels not available yet: {e}")


@pytest.mark.parametrize("impl,bs", [("triton", 16), ("mosaic_tpu", 128)])
def test_block_sparse_attention_kernels_interpret(impl, bs):
  """Pallas kernels (interpret mode) walking the selection's schedule vs the dense reference over
  the selection: forward and VJP, packed segment ids, ragged last block."""
  _kernel_module_or_skip(impl)
  rng = np.random.default_rng(2)
  b, hq, hk, d = 1, 2, 1, 32
  s = 4 * bs + bs // 2                                       # ragged last block
  q, k, v = _qkv(7, b, s, s, hq, hk, d)
  seg = _packed_segments(rng, b, s, max_docs=2, pad=False)
  kw = dict(segment_ids=jnp.asarray(seg))
  sel = select(q, k, block_size=bs, q_block_size=bs, top_k=1, **kw)
  # Some causally visible tile must be skipped, or the test could not catch a kernel that
  # ignores the selection.
  assert int(sel.counts.sum()) < int(sel.num_visible.sum())
  allowed = _allowed_from_indices(sel, s, s, True, seg, seg)
  _vjp_check(
      lambda q, k, v: sp.block_sparse_attention(q, k, v, sel, implementation=impl,
                                                interpret=True, **kw),
      lambda q, k, v: _dense(q, k, v, allowed, 1 / np.sqrt(d)), (q, k, v), 12, 2e-3)
  if impl == "triton":
    # The STE gate on top of the kernels (flash VJP + gate-gradient kernel) == dense reference.
    ste = lambda q, k, v: sp.sparse_attention(
        q, k, v, block_size=bs, q_block_size=bs, top_k=1, gate_grad="ste",
        implementation="triton", interpret=True, **kw)

    def ref(q, k, v):
      sc = sp.block_scores(q, k, block_size=bs, q_block_size=bs, segment_ids=kw["segment_ids"],
                           kv_segment_ids=kw["segment_ids"])
      return _gate_reference(q, k, v, sel, sc / np.sqrt(d), 1 / np.sqrt(d), seg=seg)

    _vjp_check(ste, ref, (q, k, v), 16, 2e-3)


def test_kernel_rejects_unsupported_block_sizes():
  q, k, v = _qkv(8, 1, 128, 128, 2, 1, 16)
  sel = select(q, k, block_size=64, q_block_size=64, top_k=1)
  _kernel_module_or_skip("mosaic_tpu")
  with pytest.raises(ValueError, match="q_block_size=64"):
    sp.block_sparse_attention(q, k, v, sel, implementation="mosaic_tpu", interpret=True)
  _kernel_module_or_skip("triton")
  sel8 = select(q, k, block_size=64, q_block_size=8, top_k=1)
  with pytest.raises(ValueError, match="q_block_size=8"):
    sp.block_sparse_attention(q, k, v, sel8, implementation="triton", interpret=True)
  with pytest.raises(ValueError, match="does not support"):
    sp.block_sparse_attention(q, k, v, sel, implementation="cudnn")


# ----------------------------------------------------------------------------- gates
def _gate_reference(q, k, v, sel, gate, scale, causal=True, seg=None):
  """Dense attention over the selection with the tile bias gate - stop_gradient(gate) expanded to
  elements; gate: [b, hk, nq, nk] (differentiable in q, k)."""
  sq, sk = q.shape[1], k.shape[1]
  allowed = _allowed_from_indices(sel, sq, sk, causal, seg, seg)
  bias = gate - jax.lax.stop_gradient(gate)
  bias = jnp.repeat(jnp.repeat(bias, sel.q_block_size, 2)[:, :, :sq], sel.block_size, 3)[..., :sk]
  return _dense(q, k, v, allowed, scale, bias)


@pytest.mark.parametrize("segments,top_k", [(False, 1), (True, 1), (True, 0.4)])
def test_ste_forward_unchanged_and_gradient(segments, top_k):
  rng = np.random.default_rng(3)
  b, s, hq, hk, d, bs, qbs = 1, 160, 4, 2, 16, 32, 16
  q, k, v = _qkv(9, b, s, s, hq, hk, d)
  seg = _packed_segments(rng, b, s, max_docs=2) if segments else None
  kw = dict(block_size=bs, q_block_size=qbs, top_k=top_k, implementation="xla",
            segment_ids=None if seg is None else jnp.asarray(seg))
  scale, temp = 1 / np.sqrt(d), 0.5
  f_none = lambda q, k, v: sp.sparse_attention(q, k, v, gate_grad="none", **kw)
  f_ste = lambda q, k, v: sp.sparse_attention(q, k, v, gate_grad="ste", gate_temperature=temp,
                                              **kw)
  out_none, sel = jax.jit(lambda q, k, v: sp.sparse_attention(q, k, v, return_selection=True,
                                                               **kw))(q, k, v)
  np.testing.assert_array_equal(np.asarray(jax.jit(f_ste)(q, k, v)), np.asarray(out_none))

  def ref(q, k, v):
    gate = scale * sp.block_scores(q, k, block_size=bs, q_block_size=qbs,
                                   segment_ids=kw["segment_ids"],
                                   kv_segment_ids=kw["segment_ids"]) / temp
    return _gate_reference(q, k, v, sel, gate, scale, seg=seg)

  g_ste = _vjp_check(f_ste, ref, (q, k, v), 13, 2e-3)
  if segments:
    return
  # "none" is plain attention over the selection (no gradient through the scores); ste adds a
  # gradient to q and k (not to v). Same cotangent (seed 13) for both.
  allowed = _allowed_from_indices(sel, s, s, True, seg, seg)
  g_none = _vjp_check(f_none, lambda q, k, v: _dense(q, k, v, allowed, scale), (q, k, v), 13,
                      2e-3)
  assert _rel(g_ste[0], g_none[0]) > 1e-2 and _rel(g_ste[1], g_none[1]) > 1e-2
  assert _rel(g_ste[2], g_none[2]) < 1e-5


@pytest.mark.parametrize("top_k", [2, 0.3])
def test_gumbel_deterministic_and_gradient(top_k):
  b, s, hq, hk, d, bs, qbs = 1, 192, 2, 1, 16, 16, 32
  q, k, v = _qkv(10, b, s, s, hq, hk, d)
  scale, temp = 1 / np.sqrt(d), 2.0
  kw = dict(block_size=bs, q_block_size=qbs, top_k=top_k, gate_grad="gumbel",
            gate_temperature=temp, implementation="xla", return_selection=True)
  run = jax.jit(lambda q, k, v, rng: sp.sparse_attention(q, k, v, rng=rng, **kw))
  o1, s1 = run(q, k, v, jax.random.key(0))
  o2, s2 = run(q, k, v, jax.random.key(0))
  o3, s3 = run(q, k, v, jax.random.key(1))
  np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))
  np.testing.assert_array_equal(np.asarray(s1.indices), np.asarray(s2.indices))
  assert not np.array_equal(np.asarray(s1.indices), np.asarray(s3.indices))
  s_none = select(q, k, block_size=bs, q_block_size=qbs, top_k=top_k)
  assert not np.array_equal(np.asarray(s1.indices), np.asarray(s_none.indices))
  # Selection rules hold for the perturbed ranking.
  noise = jax.random.gumbel(jax.random.key(0), s1.scores.shape)
  ranking = np.asarray((scale * s1.scores + noise) / temp)
  _check_rules(s1, ranking, sq=s, sk=s, qbs=qbs, bs=bs, top_k=top_k, ni=1, nl=1, causal=True)

  def ref(q, k, v):
    sc = sp.block_scores(q, k, block_size=bs, q_block_size=qbs)
    return _gate_reference(q, k, v, s1, (scale * sc + noise) / temp, scale)

  f = lambda q, k, v: sp.sparse_attention(q, k, v, rng=jax.random.key(0), **kw)[0]
  g_gumbel = _vjp_check(f, ref, (q, k, v), 15, 2e-3)
  # The gate path adds gradient to q and k that plain attention over the same blocks lacks.
  allowed = _allowed_from_indices(s1, s, s, True)
  g_plain = _vjp_check(lambda q, k, v: _dense(q, k, v, allowed, scale),
                       lambda q, k, v: _dense(q, k, v, allowed, scale), (q, k, v), 15, 2e-3)
  assert _rel(g_gumbel[0], g_plain[0]) > 1e-2 and _rel(g_gumbel[1], g_plain[1]) > 1e-2
  assert _rel(g_gumbel[2], g_plain[2]) < 1e-5
  with pytest.raises(ValueError, match="rng"):
    sp.sparse_attention(q, k, v, block_size=bs, top_k=1, gate_grad="gumbel")
  with pytest.raises(ValueError, match="gate_grad"):
    sp.sparse_attention(q, k, v, block_size=bs, top_k=1, gate_grad="soft")


# ----------------------------------------------------------------------------- score distillation
def _dense_probs(q, k, qseg=None, kseg=None):
  """Brute-force causal (bottom-right) softmax probabilities [b, hq, sq, sk], fp32."""
  b, sq, hq, d = q.shape
  sk, hk = k.shape[1], k.shape[2]
  kf = jnp.repeat(k.astype(jnp.float32), hq // hk, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kf, precision=HI) / np.sqrt(d)
  allowed = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)
  allowed = np.broadcast_to(allowed, (b, sq, sk))
  if qseg is not None:
    allowed = allowed & (qseg[:, :, None] == kseg[:, None, :]) & (kseg[:, None, :] != 0)
  allowed = jnp.asarray(allowed)[:, None]
  p = jax.nn.softmax(jnp.where(allowed, s, -jnp.inf), axis=-1)
  return jnp.where(allowed, p, 0.0)


def _pool(p, hk, qbs, bs, query_pool="sum"):
  """[b, hq, sq, sk] -> [b, hk, nq, nk]: sum over each tile's keys, sum or max over its queries,
  sum over the group's heads (zero padding)."""
  b, hq, sq, sk = p.shape
  nq, nk = -(-sq // qbs), -(-sk // bs)
  p = jnp.pad(p, ((0, 0), (0, 0), (0, nq * qbs - sq), (0, nk * bs - sk)))
  p = p.reshape(b, hk, hq // hk, nq, qbs, nk, bs).sum(6)
  return (p.max(4) if query_pool == "max" else p.sum(4)).sum(2)


@pytest.mark.parametrize("segments,query_pool", [(False, "sum"), (True, "sum"), (True, "max")])
def test_block_attention_mass_brute_force(segments, query_pool):
  rng = np.random.default_rng(11)
  b, sq, sk, hq, hk, d, bs, qbs = 2, 100, 130, 4, 2, 8, 32, 16
  q, k, _ = _qkv(21, b, sq, sk, hq, hk, d)
  qseg = kseg = None
  if segments:
    kseg = _packed_segments(rng, b, sk)
    qseg = kseg[:, sk - sq:].copy()
  f = jax.jit(functools.partial(sp.block_attention_mass, block_size=bs, q_block_size=qbs,
                                query_pool=query_pool,
                                max_chunk_elems=3000))      # several chunks, a padded last one
  m = f(q, k, segment_ids=None if qseg is None else jnp.asarray(qseg),
        kv_segment_ids=None if kseg is None else jnp.asarray(kseg))
  ref = _pool(_dense_probs(q, k, qseg, kseg), hk, qbs, bs, query_pool)
  np.testing.assert_allclose(np.asarray(m), np.asarray(ref), atol=2e-5)
  with pytest.raises(ValueError, match="query_pool"):
    sp.block_attention_mass(q, k, query_pool="mean")


@pytest.mark.parametrize("gate,pool", [("none", "sum"), ("ste", "max")])
def test_score_aux_forward_unchanged_and_gradient(gate, pool):
  """score_aux_weight keeps the forward (and selection) bit for bit and adds w * dKL to the
  q/k gradient, KL written here from scratch (dense probabilities pooled per tile, renormalised
  over the candidate blocks: visible, not block 0, not the local block)."""
  b, s, hq, hk, d, bs, qbs, top_k, w = 1, 192, 4, 2, 16, 32, 16, 1, 100.0
  q, k, v = _qkv(23, b, s, s, hq, hk, d)
  q = 3.0 * q                                           # peaked attention: a non-flat target
  scale = 1 / np.sqrt(d)
  kw = dict(block_size=bs, q_block_size=qbs, top_k=top_k, gate_grad=gate, implementation="xla")
  run = jax.jit(lambda q, k, v, w: sp.sparse_attention(q, k, v, score_aux_weight=w,
                                                       score_aux_pool=pool,
                                                       return_selection=True, **kw),
                static_argnums=3)
  o0, s0 = run(q, k, v, 0.0)
  o1, s1 = run(q, k, v, w)
  np.testing.assert_array_equal(np.asarray(o1), np.asarray(o0))
  np.testing.assert_array_equal(np.asarray(s1.indices), np.asarray(s0.indices))

  nq, nk = s // qbs, s // bs
  i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
  hi = (i * qbs + qbs - 1) // bs                        # the local (and last visible) block
  cand = jnp.asarray((j >= 1) & (j < hi))                # [nq, nk]

  def kl_ref(q, k):
    z = scale * sp.block_scores(q, k, block_size=bs, q_block_size=qbs)
    m = jax.lax.stop_gradient(_pool(_dense_probs(q, k), hk, qbs, bs, pool))
    pt = jnp.where(cand, m, 0.0)
    pt = pt / jnp.maximum(pt.sum(-1, keepdims=True), 1e-30)
    logq = jax.nn.log_softmax(jnp.where(cand, z, -jnp.inf), -1)
    row = jnp.sum(jnp.where(cand, pt * (jnp.log(jnp.where(cand, pt, 1.0))
                                          - jnp.where(cand, logq, 0.0)), 0.0), -1)
    ok = jnp.asarray(cand.sum(-1) >= 2)
    return jnp.sum(jnp.where(ok, row, 0.0)) / (ok.sum() * b * hk)

  kl = float(jax.jit(functools.partial(sp.block_score_kl, block_size=bs, q_block_size=qbs,
                                       query_pool=pool))(q, k))
  assert kl > 1e-3 and abs(kl - float(jax.jit(kl_ref)(q, k))) < 1e-5 * max(1.0, kl)
  ct, = normal(29, o0.shape)
  grad = lambda w: jax.jit(jax.grad(lambda q, k, v: jnp.sum(ct * run(q, k, v, w)[0]),
                                    (0, 1, 2)))(q, k, v)
  g0, g1 = grad(0.0), grad(w)
  gk = jax.jit(jax.grad(lambda q, k: w * kl_ref(q, k), (0, 1)))(q, k)
  for a, base, extra in zip(g1[:2], g0[:2], gk):
    assert _rel(a, base) > 1e-3, _rel(a, base)          # the term is not negligible here
    assert _rel(a - base, extra) < 1e-2, _rel(a - base, extra)
  np.testing.assert_array_equal(np.asarray(g1[2]), np.asarray(g0[2]))   # v: untouched


def test_score_kl_gradient_reaches_unkept_blocks():
  """dKL/dz = softmax(z) - p on every candidate block, kept or not (the gates "ste"/"gumbel"
  send gradient to kept blocks only); zero outside the candidates."""
  b, s, h, d, bs = 1, 256, 2, 16, 32
  q, k, _ = _qkv(31, b, s, s, h, h, d)
  sel = select(q, k, block_size=bs, q_block_size=bs, top_k=1)
  mass = jax.jit(functools.partial(sp.block_attention_mass, block_size=bs, q_block_size=bs))(q, k)
  cand, _, _ = sp.selection.candidates(b, h, q_len=s, kv_len=s, q_block_size=bs, block_size=bs,
                              causal=True, num_init=1, num_local=1, seg_ok=None, doc_start=None)
  z = jnp.asarray(np.random.default_rng(0).normal(size=mass.shape), jnp.float32)
  gz = np.asarray(jax.jit(jax.grad(sp.metrics.score_kl))(z, mass, cand))
  cand = np.broadcast_to(np.asarray(cand), gz.shape)
  unkept = cand & ~np.asarray(sel.tile_mask())
  assert unkept.sum() >= 10 and np.all(np.abs(gz[unkept]) > 0)
  assert np.all(gz[~cand] == 0)
  # the formula, per row with >= 2 candidates (mean over those rows)
  ok = cand.sum(-1) >= 2
  pt = np.where(cand, np.asarray(mass), 0.0)
  pt = pt / np.maximum(pt.sum(-1, keepdims=True), 1e-30)
  zz = np.where(cand, np.asarray(z, np.float64), -np.inf)
  sm = np.where(cand, np.exp(zz - np.where(cand, zz, -1e30).max(-1, keepdims=True)), 0.0)
  sm = sm / np.maximum(sm.sum(-1, keepdims=True), 1e-300)
  want = np.where(cand & ok[..., None], sm - pt, 0.0) / ok.sum()
  np.testing.assert_allclose(gz, want, atol=1e-6)
  with pytest.raises(ValueError, match="score_aux_weight"):
    sp.sparse_attention(q, k, k, block_size=bs, top_k=1, score_aux_weight=-1.0)


# ----------------------------------------------------------------------------- captured mass
def test_captured_mass():
  rng = np.random.default_rng(4)
  b, s, hq, hk, d, bs, qbs = 2, 130, 4, 2, 8, 16, 8
  q, k, _ = _qkv(11, b, s, s, hq, hk, d)
  q = q * 3.0                                                  # peaky softmax
  seg = _packed_segments(rng, b, s, max_docs=3)
  segj = jnp.asarray(seg)
  full = select(q, k, block_size=bs, q_block_size=qbs, top_k=100)
  mass = jax.jit(sp.captured_mass, static_argnames=("causal", "reduce", "max_chunk_elems"))
  np.testing.assert_allclose(float(mass(q, k, full)), 1.0, rtol=1e-6)
  sel = select(q, k, block_size=bs, q_block_size=qbs, top_k=2, segment_ids=segj)
  # Brute force in float64.
  scale = 1 / np.sqrt(d)
  qn, kn = np.asarray(q, np.float64), np.asarray(k, np.float64)
  kept = _allowed_from_indices(sel, s, s, False)
  per = np.zeros((b, hq))
  tot, cnt = 0.0, 0
  for bi in range(b):
    for h in range(hq):
      g = h // (hq // hk)
      ms, n = 0.0, 0
      for t in range(s):
        vis = (np.arange(s) <= t) & (seg[bi] == seg[bi, t]) & (seg[bi] != 0)
        if not vis.any():
          continue
        logit = qn[bi, t, h] @ kn[bi, :, g].T * scale
        p = np.exp(logit - logit[vis].max()) * vis
        ms += p[kept[bi, g, t]].sum() / p.sum()
        n += 1
      per[bi, h] = ms / max(n, 1)
      tot, cnt = tot + ms, cnt + n
  got = mass(q, k, sel, segment_ids=segj, reduce=False, max_chunk_elems=2000)
  np.testing.assert_allclose(np.asarray(got), per, rtol=1e-4)
  got = mass(q, k, sel, segment_ids=segj)
  np.testing.assert_allclose(float(got), tot / cnt, rtol=1e-4)
  assert 0.2 < tot / cnt < 0.999


# ----------------------------------------------------------------------------- decode
def test_block_summaries_incremental():
  b, n, hk, d, bs = 2, 100, 2, 8, 16
  k, = normal(12, (b, n, hk, d))
  lens = jnp.array([3, 40])
  summ = sp.init_block_summaries(k, lens, block_size=bs)
  step = jax.jit(sp.update_block_summaries)
  for t in range(1, 30):
    summ = step(summ, k, lens + t)
  ref = sp.init_block_summaries(k, lens + 29, block_size=bs)
  np.testing.assert_allclose(np.asarray(summ.sums), np.asarray(ref.sums), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(summ.lengths), [32, 69])
  same = step(summ, k, lens + 29)                              # no growth: unchanged
  np.testing.assert_array_equal(np.asarray(same.sums), np.asarray(summ.sums))
  means = np.asarray(summ.means())
  np.testing.assert_allclose(means[1, 4], np.asarray(k[1, 64:69]).mean(0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("top_k", [3, 0.3])
def test_sparse_decode_matches_reference_and_training_selection(top_k):
  b, n, hq, hk, d, bs = 3, 300, 4, 2, 16, 16
  q, kc, vc = normal(13, (b, hq, d), (b, n, hk, d), (b, n, hk, d))
  lens = jnp.array([300, 170, 20])
  summ = sp.init_block_summaries(kc, lens, block_size=bs)
  out, lse, idx = jax.jit(functools.partial(
      sp.sparse_decode_attention, block_size=bs, top_k=top_k, num_local_blocks=2,
      return_lse=True, return_indices=True))(q, kc, vc, lens, summ)
  idx = np.asarray(idx)
  nb = -(-n // bs)
  mask = np.zeros((b, hk, 1, n), bool)
  for bi in range(b):
    L = int(lens[bi])
    # Same selection as training-time per-token selection on the prefix's last query.
    sel = select(q[bi:bi + 1, None], kc[bi:bi + 1, :L], block_size=bs, q_block_size=1,
                           top_k=top_k, num_local_blocks=2)
    want = np.asarray(sel.indices[0, :, 0])
    got = idx[bi]
    for g in range(hk):
      np.testing.assert_array_equal(got[g][got[g] >= 0], want[g][want[g] >= 0])
      for j in got[g][got[g] >= 0]:
        mask[bi, g, 0, j * bs:min((j + 1) * bs, L)] = True
    nv = -(-L // bs)
    kept = 1 + 2 + top_k if isinstance(top_k, int) else max(3, int(top_k * nv + 0.5))
    assert (got[:, :] >= 0).sum(-1).min() == min(nv, kept)
  assert nb > idx.shape[-1]
  ref, ref_lse = attention_reference(q[:, None], kc, vc, block_mask=jnp.asarray(mask))
  assert _rel(out, ref[:, 0]) < 2e-3
  assert _rel(lse, ref_lse[:, :, 0]) < 2e-3


@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_sparse_paged_decode(impl):
  """Paged cache (shuffled pages) == contiguous cache, for the xla path and the Triton kernel
  (interpret mode, several splits); paged summaries == contiguous ones."""
  b, n, hq, hk, d, bs, top_k = 3, 200, 4, 2, 16, 16, 2
  q, kc, vc = normal(14, (b, hq, d), (b, n, hk, d), (b, n, hk, d))
  lens = jnp.array([200, 70, 20])                    # 20: only forced blocks, empty top-k slots
  nb = -(-n // bs)
  pt = jnp.asarray(np.random.default_rng(5).permutation(b * nb + 3)[:b * nb].reshape(b, nb),
                   jnp.int32)
  blocks = lambda x: jnp.pad(x, ((0, 0), (0, nb * bs - n), (0, 0), (0, 0))).reshape(
      b * nb, bs, hk, d)
  kp = jnp.zeros((b * nb + 3, bs, hk, d)).at[pt.reshape(-1)].set(blocks(kc))
  vp = jnp.full((b * nb + 3, bs, hk, d), 7.0).at[pt.reshape(-1)].set(blocks(vc))
  summ = sp.init_block_summaries(kc, lens, block_size=bs)
  psumm = sp.update_block_summaries(
      sp.init_block_summaries(kp, lens - 1, block_size=bs, page_table=pt), kp, lens,
      page_table=pt)
  np.testing.assert_allclose(np.asarray(psumm.sums), np.asarray(summ.sums), atol=1e-5)
  kw = dict(top_k=top_k, implementation=impl, interpret=True, return_indices=True)
  if impl == "triton":
    kw["num_splits"] = 3
  out_c, idx_c = jax.jit(functools.partial(sp.sparse_decode_attention, block_size=bs, **kw))(
      q, kc, vc, lens, summ)
  if impl == "xla":
    ref, idx = out_c, idx_c
  else:
    ref, idx = jax.jit(functools.partial(sp.sparse_decode_attention, block_size=bs, top_k=top_k,
                                         implementation="xla", return_indices=True))(
                                             q, kc, vc, lens, summ)
  out_p, idx_p = jax.jit(functools.partial(sp.sparse_paged_decode_attention, **kw))(
      q, kp, vp, pt, lens, psumm)
  np.testing.assert_array_equal(np.asarray(idx_c), np.asarray(idx))
  np.testing.assert_array_equal(np.asarray(idx_p), np.asarray(idx))
  assert _rel(out_c, ref) < 2e-3 and _rel(out_p, ref) < 2e-3


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,qbs,bs,tol", [(jnp.bfloat16, 128, 64, 2e-2),
                                              (jnp.float32, 64, 32, 2e-3)])
def test_gpu_block_sparse_triton(dtype, qbs, bs, tol):
  """Triton kernels on the GPU vs the fp32 reference over the selection (fwd + VJP), with
  packed segment ids and GQA; and the STE gate over the kernel vs the xla path."""
  rng = np.random.default_rng(6)
  b, s, hq, hk, d = 2, 2048, 4, 2, 128
  q, k, v = _qkv(17, b, s, s, hq, hk, d, dtype)
  seg = jnp.asarray(_packed_segments(rng, b, s, max_docs=3))
  kw = dict(block_size=bs, q_block_size=qbs, top_k=4, segment_ids=seg)
  sel = select(q, k, **kw)
  up = lambda x: x.astype(jnp.float32)
  ref = lambda q, k, v: sp.block_sparse_attention(up(q), up(k), up(v), sel, segment_ids=seg,
                                                  implementation="xla").astype(q.dtype)
  _vjp_check(lambda q, k, v: sp.block_sparse_attention(q, k, v, sel, segment_ids=seg,
                                                       implementation="triton"),
             ref, (q, k, v), 18, tol)
  ste = lambda impl: lambda q, k, v: sp.sparse_attention(
      up(q), up(k), up(v), gate_grad="ste", implementation=impl, **kw)
  if dtype == jnp.float32:
    _vjp_check(ste("triton"), ste("xla"), (q, k, v), 19, tol)


@pytest.mark.gpu
def test_gpu_sparse_decode_triton():
  b, n, hq, hk, d, bs, top_k = 2, 32768, 32, 8, 128, 64, 96
  ks = jax.random.split(jax.random.key(20), 3)
  q = jax.random.normal(ks[0], (b, hq, d), jnp.bfloat16)
  kc = jax.random.normal(ks[1], (b, n, hk, d), jnp.bfloat16)
  vc = jax.random.normal(ks[2], (b, n, hk, d), jnp.bfloat16)
  lens = jnp.array([n, 20000])
  summ = sp.init_block_summaries(kc, lens, block_size=bs)
  run = lambda impl: jax.jit(functools.partial(
      sp.sparse_decode_attention, block_size=bs, top_k=top_k, implementation=impl,
      return_indices=True))(q, kc, vc, lens, summ)
  out_t, idx_t = run("triton")
  out_x, idx_x = run("xla")
  np.testing.assert_array_equal(np.asarray(idx_t), np.asarray(idx_x))
  assert _rel(out_t, out_x) < 2e-2


@pytest.mark.gpu
def test_gpu_decode_select():
  """The selection kernel compiled on the GPU at the bench shape (2048 blocks, top 387, 8
  warps) on the adversarial rows (ties, +0/-0, infinities, all equal, neighbouring floats) and
  on continuous ones, lengths from 0 to past the cache: XLA's lax.top_k selection, to the
  bit."""
  from pallas_kernels.sparse.decode_select import decode_width, select_decode_slots
  nb, bs, top_k = 2048, 64, 387
  rng = np.random.default_rng(23)
  lens = jnp.array([nb * bs, 0, 1, (nb // 2) * bs, (nb // 3) * bs + 5, nb * bs + 100,
                    2 * bs + 1, bs * (top_k + 2)])
  scores = jnp.concatenate([_adversarial_decode_scores(rng, lens.shape[0], nb),
                            jnp.asarray(rng.standard_cauchy((lens.shape[0], 2, nb)),
                                        jnp.float32)], axis=1)
  sel_kw = dict(block_size=bs, top_k=top_k, num_init_blocks=1, num_local_blocks=1)
  want = jax.jit(functools.partial(sp.decode._decode_select_from_scores, **sel_kw))(scores, lens)
  idx, _ = jax.jit(functools.partial(select_decode_slots, max_selected=decode_width(
      nb, top_k, 1, 1), **sel_kw))(scores, lens)
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(want))


def test_sparse_attention_lowers_for_tpu():
  """Selection + Mosaic TPU kernels (forward and VJP, STE gate) lower for TPU (jax.export)."""
  _kernel_module_or_skip("mosaic_tpu")
  b, s, hq, hk, d = 1, 1024, 4, 2, 128
  q = jax.ShapeDtypeStruct((b, s, hq, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, s, hk, d), jnp.bfloat16)

  def loss(q, k, v):
    out = sp.sparse_attention(q, k, v, block_size=128, q_block_size=128, top_k=2,
                              gate_grad="ste", implementation="mosaic_tpu")
    return jnp.sum(out.astype(jnp.float32) ** 2)

  exp = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=["tpu"])(
      q, kv, kv)
  assert exp.mlir_module().count("tpu_custom_call") == 3  # forward, dQ, dK/dV


def test_gate_grad_kernel_interpret():
  """Triton per-tile dS sums == the XLA pass, with GQA, q_len < kv_len, ragged blocks, segment
  ids and a random lse cotangent; and the XLA pass == autodiff of a per-tile logit bias."""
  _kernel_module_or_skip("triton")
  from pallas_kernels.sparse.gate_grad import tile_logit_grads
  rng = np.random.default_rng(7)
  b, sq, sk, hq, hk, d, bs = 1, 40, 72, 4, 2, 16, 16
  q, k, v = _qkv(21, b, sq, sk, hq, hk, d)
  kseg = _packed_segments(rng, b, sk, max_docs=2, pad=False)
  qseg = kseg[:, sk - sq:]
  kw = dict(segment_ids=jnp.asarray(qseg), kv_segment_ids=jnp.asarray(kseg))
  sel = select(q, k, block_size=bs, q_block_size=bs, top_k=1, **kw)
  scale = 0.3
  out, lse = jax.jit(lambda q, k, v: sp.block_sparse_attention(
      q, k, v, sel, scale=scale, return_lse=True, implementation="xla", **kw))(q, k, v)
  dout, dlse = normal(22, out.shape, lse.shape)
  dlse = jnp.where(jnp.isfinite(lse), dlse, 0.0)
  segs = (kw["segment_ids"], kw["kv_segment_ids"])
  want = jax.jit(functools.partial(sp.attention._tile_logit_grads, causal=True, scale=scale))(
      q, k, v, out, lse, dout, dlse, sel, *segs)
  got = tile_logit_grads(q, k, v, out, lse, dout, dlse, sel.indices, sel.counts, *segs,
                         block_q=bs, block_k=bs, causal=True, scale=scale, interpret=True)
  assert _rel(got, want) < 1e-4
  # Autodiff: d/dbias of sum(out * dout) + sum(lse * dlse) with a per-tile logit bias at 0.
  allowed = _allowed_from_indices(sel, sq, sk, True, qseg, kseg)
  idx = np.asarray(sel.indices)

  def loss(bias_tiles):
    bias = jnp.repeat(jnp.repeat(bias_tiles, bs, 2)[:, :, :sq], bs, 3)[..., :sk]
    qf = q.reshape(b, sq, hk, hq // hk, d)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qf, k, precision=HI) * scale + bias[:, :, None]
    s = jnp.where(allowed[:, :, None], s, -jnp.inf)
    l = jax.nn.logsumexp(s, axis=-1)
    p = jnp.where(jnp.isfinite(l)[..., None], jnp.exp(s - jnp.where(jnp.isfinite(l), l, 0)[..., None]), 0)
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p, v, precision=HI).reshape(out.shape)
    l = jnp.where(jnp.isfinite(l), l, 0.0).reshape(lse.shape)
    return jnp.sum(o * dout) + jnp.sum(l * dlse)

  nq, nk = -(-sq // bs), -(-sk // bs)
  g = np.asarray(jax.jit(jax.grad(loss))(jnp.zeros((b, hk, nq, nk))))
  ref = np.where(idx >= 0, np.take_along_axis(g, np.maximum(idx, 0), axis=-1), 0.0)
  assert _rel(want, ref) < 1e-4
  assert np.abs(ref).max() > 1e-3


# ----------------------------------------------------------------------------- decode kernels
def _np_total_order(x):
  bits = np.asarray(x, np.float32).view(np.int32).astype(np.int64)
  return np.where(bits < 0, -(bits & 0x7FFFFFFF) - 1, bits)


def _np_decode_select(scores, lens, bs, top_k, n_init, n_local, width):
  """Brute force: forced blocks, then the top_k candidates by (score desc in IEEE total
  order, block id asc), sorted, padded with -1 to ``width``."""
  scores = np.asarray(scores, np.float32)
  b, hk, nb = scores.shape
  out = np.full((b, hk, width), -1, np.int32)
  for bi in range(b):
    L = min(int(lens[bi]), nb * bs)
    diag = (L - 1) // bs if L > 0 else -1
    for h in range(hk):
      forced = {j for j in range(nb) if j <= diag and (j < n_init or j > diag - n_local)}
      cand = [j for j in range(diag + 1) if j not in forced and j < nb]
      keys = _np_total_order(scores[bi, h, cand])
      order = sorted(range(len(cand)), key=lambda t: (-keys[t], cand[t]))
      kept = sorted(forced | {cand[t] for t in order[:top_k]})
      out[bi, h, :len(kept)] = kept
  return out


@pytest.mark.parametrize("nb,bs,top_k,n_init,n_local", [
    (37, 16, 5, 1, 1), (300, 16, 40, 2, 3), (2048, 64, 387, 1, 1), (20, 32, 0, 1, 2),
    (9, 16, 30, 0, 0), (64, 16, 7, 3, 0)])
def test_decode_select_kernel(nb, bs, top_k, n_init, n_local):
  """Pallas selection (interpret) == lax.top_k selection == brute force on the same scores,
  with many exact ties (quantised scores, +0/-0), lengths 0, 1, mid-block, on a block
  boundary, past the cache."""
  _kernel_module_or_skip("triton")
  from pallas_kernels.sparse.decode_select import decode_width, select_decode_slots
  rng = np.random.default_rng(nb + top_k)
  b, hk = 6, 3
  scores = np.round(rng.normal(size=(b, hk, nb)) * 4) / 4              # many ties
  scores[:, 0, ::3] = -0.0
  scores[:, 0, 1::3] = 0.0
  scores = jnp.asarray(scores, jnp.float32)
  lens = jnp.array([nb * bs, 0, 1, (nb // 2) * bs, (nb // 3) * bs + 5, nb * bs + 100])
  width = decode_width(nb, top_k, n_init, n_local)
  kw = dict(block_size=bs, top_k=top_k, num_init_blocks=n_init, num_local_blocks=n_local)
  idx, cnt = select_decode_slots(scores, lens, max_selected=width, interpret=True, **kw)
  want = jax.jit(functools.partial(sp.decode._decode_select_from_scores, **kw))(scores, lens)
  brute = _np_decode_select(scores, np.asarray(lens), bs, top_k, n_init, n_local, width)
  np.testing.assert_array_equal(np.asarray(want), brute)
  np.testing.assert_array_equal(np.asarray(idx), brute)
  np.testing.assert_array_equal(np.asarray(cnt), (brute >= 0).sum(-1))
  assert (brute >= 0).sum() > 0


def _adversarial_decode_scores(rng, b, nb):
  """[b, 7, nb] fp32 rows: quantised (many ties), all equal, +0/-0, -inf/inf/-FLT_MAX and
  subnormals, continuous, neighbouring floats (keys differing in the low bits only), and
  -inf everywhere except a few blocks."""
  f32 = np.float32
  rows = [np.round(rng.normal(size=(b, nb)) * 4) / 4,
          np.full((b, nb), 1.5),
          np.where(rng.random((b, nb)) < 0.5, -0.0, 0.0),
          rng.choice(np.array([-np.inf, np.inf, -np.finfo(f32).max, np.finfo(f32).max,
                               -np.finfo(f32).smallest_subnormal, 1e-45, -1.0], f32), (b, nb)),
          rng.normal(size=(b, nb)),
          np.nextafter(f32(0.75), f32(2)) + np.arange(nb) % 5 * np.spacing(f32(0.75)),
          np.where(rng.random((b, nb)) < 0.1, rng.normal(size=(b, nb)), -np.inf)]
  rows[5] = np.broadcast_to(rng.permutation(rows[5].astype(f32)), (b, nb))
  return jnp.asarray(np.stack([np.asarray(r, f32) for r in rows], axis=1))


@pytest.mark.parametrize("nb,bs,top_k,n_init,n_local", [
    (37, 16, 5, 1, 1), (300, 16, 40, 2, 3), (9, 16, 30, 0, 0)])
def test_decode_select_kernel_adversarial(nb, bs, top_k, n_init, n_local):
  """The selection kernel selects exactly what lax.top_k and brute force select on adversarial
  rows: ties to the lower block id, forced blocks, top_k above the visible blocks, lengths 0,
  1, mid-block, on a block boundary and past the cache, all-equal rows, +0/-0, +-inf,
  -FLT_MAX, subnormals; the arrival counters come back zeroed."""
  _kernel_module_or_skip("triton")
  from pallas_kernels.sparse.decode_select import decode_width, select_decode_slots
  rng = np.random.default_rng(3 * nb + top_k)
  lens = jnp.array([nb * bs, 0, 1, (nb // 2) * bs, (nb // 3) * bs + 5, nb * bs + 100,
                    2 * bs + 1, bs * min(nb, top_k + 2)])
  scores = _adversarial_decode_scores(rng, lens.shape[0], nb)
  width = decode_width(nb, top_k, n_init, n_local)
  kw = dict(block_size=bs, top_k=top_k, num_init_blocks=n_init, num_local_blocks=n_local)
  idx, cnt, arr = select_decode_slots(scores, lens, max_selected=width, interpret=True,
                                      return_arrivals=True, **kw)
  want = jax.jit(functools.partial(sp.decode._decode_select_from_scores, **kw))(scores, lens)
  brute = _np_decode_select(scores, np.asarray(lens), bs, top_k, n_init, n_local, width)
  # lax.top_k ranks -inf candidates with the masked (forced, invisible) blocks, ties to the
  # lower id, so a -inf candidate can lose its place: brute force only on -inf-free heads.
  finite = [h for h in range(scores.shape[1]) if not np.isneginf(scores[:, h]).any()]
  np.testing.assert_array_equal(np.asarray(want)[:, finite], brute[:, finite])
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(cnt), (np.asarray(want) >= 0).sum(-1))
  np.testing.assert_array_equal(np.asarray(arr), 0)


def _keep_after_search(key, real, t_u, top_k):
  """The selection kernel's step after the search (``_keep_flags``): keys > t, then the ties
  at t by lower index up to top_k."""
  thr = np.int64(t_u) ^ -(2 ** 31)
  key, real = np.asarray(key, np.int64), np.asarray(real)
  above = (key > thr) & real
  tie = (key == thr) & real
  rank = np.cumsum(tie) - tie
  return above | (tie & (rank < top_k - above.sum()))


def test_bit_search_keeps_the_top_k():
  """``topk.bit_search`` stops at the first trial that counts exactly top_k keys. On continuous
  scores that is well before 32 steps (2048 blocks, top 387); after the threshold step (keys
  above it, then ties at it by lower index) the kept set is the brute-force top_k (ties to the
  lower index) on every row of the adversarial set (ties at the k-th key, all equal, +0/-0,
  infinities, neighbouring floats), for several top_k, with and without padded lanes; c_t is
  the count of real keys at the threshold."""
  from pallas_kernels.sparse import topk
  rng = np.random.default_rng(11)

  def brute(key, real, k):
    key, real = np.asarray(key, np.int64), np.asarray(real)
    order = sorted(np.flatnonzero(real), key=lambda j: (-key[j], j))[:k]
    keep = np.zeros(key.shape, bool)
    keep[order] = True
    return keep
  steps = []
  for i in range(20):
    s = jnp.asarray(rng.normal(size=2048) * rng.uniform(1e-3, 1e3), jnp.float32)
    key, real = topk.total_order_key(s), jnp.arange(2048) < 2046
    t, n = topk.bit_search(key, real, top_k=387, return_steps=True)
    np.testing.assert_array_equal(_keep_after_search(key, real, t, 387), brute(key, real, 387))
    steps.append(int(n))
  assert max(steps) < 32 and np.mean(steps) < 24, steps
  rows = _adversarial_decode_scores(rng, 3, 300).reshape(-1, 300)
  search = jax.jit(topk.bit_search, static_argnames=("top_k", "n_real"))
  for r in range(rows.shape[0]):
    key = topk.total_order_key(rows[r])
    for top_k in (1, 5, 40, 299, 300):
      for n_real in (300, 257):
        real = jnp.arange(300) < n_real
        k = min(top_k, n_real)
        t_u, c_t = search(key, real, top_k=k, n_real=n_real)
        np.testing.assert_array_equal(_keep_after_search(key, real, t_u, k),
                                      brute(key, real, k), err_msg=f"row {r} top_k {top_k}")
        thr = np.int64(t_u) ^ -(2 ** 31)
        want = int(np.sum((np.asarray(key) >= thr) & np.asarray(real)))
        assert int(c_t) == want >= k, (r, top_k, n_real, int(c_t), want)


@pytest.mark.parametrize("hq,hk,d,nb", [(6, 2, 72, 150), (4, 4, 16, 5)])
def test_decode_block_scores_kernel(hq, hk, d, nb):
  """Pallas block scores (interpret) vs fp64 q-group-sum . key_sum / count, GQA group 3 and
  1, head_dim 72, a block count that is not a multiple of the score tile, partial blocks."""
  _kernel_module_or_skip("triton")
  from pallas_kernels.sparse.decode_select import decode_block_scores
  b, bs = 3, 16
  q, = normal(31, (b, hq, d), dtype=jnp.bfloat16)
  kc, = normal(32, (b, nb * bs, hk, d))
  lens = jnp.array([nb * bs, 1, nb * bs // 2 + 3])
  summ = sp.init_block_summaries(kc, lens, block_size=bs)
  got = decode_block_scores(q, summ.sums, summ.lengths, block_size=bs, interpret=True)
  qs = np.asarray(q, np.float64).reshape(b, hk, hq // hk, d).sum(2)
  cnt = np.maximum(np.asarray(summ.counts()), 1)
  want = np.einsum("bhd,bjhd->bhj", qs, np.asarray(summ.sums, np.float64)) / cnt[:, None, :]
  assert _rel(got, want) < 1e-6
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_decode_score_select_fused_kernel():
  """Scores + selection in one kernel (interpret) == the two kernels (scores, and the
  selection of its scores; zeroed counters) and == lax.top_k / brute force on the same scores:
  one program per (batch, kv head), and 4 score splits of one tile each arriving out of order,
  the last reaching past the last block; GQA group 2, head_dim 72, 200 blocks; random,
  quantised (ties, +0/-0) and special (inf, -inf, NaN, FLT_MAX overflow, subnormal) key sums;
  lengths 0, 1, mid-block, on a boundary, past the cache; summaries one token behind."""
  _kernel_module_or_skip("triton")
  from pallas_kernels.sparse.decode_select import (decode_block_scores, decode_width,
                                                   score_select_decode_slots,
                                                   select_decode_slots)
  b, hq, hk, d, bs, nb, top_k, n_init, n_local = 8, 6, 3, 72, 16, 200, 5, 1, 2
  rng = np.random.default_rng(5)
  f32 = np.float32
  q = np.asarray(rng.normal(size=(b, hq, d)), f32)
  sums = np.asarray(rng.normal(size=(b, nb, hk, d)) * 8, f32)
  # kv head 1: qsum = 2 e_0 and quantised sums in dim 0 (exact ties, +0/-0); kv head 2: the
  # same query and special values (3 * FLT_MAX / count overflows to inf for full blocks).
  q[:, 2:, :] = 0.0
  q[:, 2:, 0] = 1.0
  sums[:, :, 1:, :] = 0.0
  sums[:, :, 1, 0] = np.round(rng.normal(size=(b, nb)) * 2) / 2 * 16
  sums[:, ::4, 1, 0] = -0.0
  sums[:, :, 2, 0] = rng.choice(np.array([np.inf, -np.inf, np.nan, np.finfo(f32).max, -1.0,
                                          np.finfo(f32).smallest_subnormal, 4.0], f32), (b, nb))
  lens = jnp.array([nb * bs, 0, 1, (nb // 2) * bs, (nb // 3) * bs + 5, nb * bs + 100, 2 * bs + 1,
                    bs * (top_k + 3)])
  slens = jnp.maximum(lens - 1, 0)
  q, sums = jnp.asarray(q, jnp.bfloat16), jnp.asarray(sums)
  width = decode_width(nb, top_k, n_init, n_local)
  kw = dict(block_size=bs, top_k=top_k, num_init_blocks=n_init, num_local_blocks=n_local,
            max_selected=width, interpret=True)
  scores = decode_block_scores(q, sums, slens, block_size=bs, interpret=True)
  idx, cnt = select_decode_slots(scores, lens, **kw)
  sel_kw = {k: kw[k] for k in ("block_size", "top_k", "num_init_blocks", "num_local_blocks")}
  want = jax.jit(functools.partial(sp.decode._decode_select_from_scores, **sel_kw))(scores, lens)
  brute = _np_decode_select(scores, np.asarray(lens), bs, top_k, n_init, n_local, width)
  np.testing.assert_array_equal(np.asarray(idx)[:, :2], np.asarray(want)[:, :2])
  np.testing.assert_array_equal(np.asarray(idx)[:, :2], brute[:, :2])
  assert np.isnan(np.asarray(scores)[:, 2]).any() and np.isinf(np.asarray(scores)[:, 2]).any()
  mag = np.asarray(decode_block_scores(jnp.abs(q), jnp.abs(sums), slens, block_size=bs,
                                       interpret=True))   # the summands' magnitude
  fin = np.isfinite(mag)
  for splits, stride in ((1, 1), (4, 3)):                            # 4 tiles of 64
    msg = f"splits={splits} stride={stride}"
    i, c, a, s = score_select_decode_slots(q, sums, slens, lens, score_splits=splits,
                                           return_arrivals=True, return_scores=True,
                                           _split_stride=stride, **kw)
    # The same scores up to the interpreter's reduction order on the CPU (the same code per
    # tile: a few fp32 roundings of the summands' magnitude, whose sum cancels to far less),
    # non-finite ones exactly; and the selection of exactly those scores.
    got, ref = np.asarray(s), np.asarray(scores)
    np.testing.assert_array_equal(got[~fin], ref[~fin], err_msg=msg)
    np.testing.assert_array_less(np.abs(got[fin] - ref[fin]), 8 * np.finfo(f32).eps * mag[fin]
                                 + 1e-30, err_msg=msg)
    want_s = jax.jit(functools.partial(sp.decode._decode_select_from_scores, **sel_kw))(s, lens)
    np.testing.assert_array_equal(np.asarray(i), np.asarray(want_s), err_msg=msg)
    np.testing.assert_array_equal(np.asarray(c), (np.asarray(want_s) >= 0).sum(-1), err_msg=msg)
    np.testing.assert_array_equal(np.asarray(a), 0, err_msg=msg)
  with pytest.raises(ValueError, match="coprime"):
    score_select_decode_slots(q, sums, slens, lens, score_splits=4, _split_stride=2, **kw)
  with pytest.raises(ValueError, match="score_splits"):
    score_select_decode_slots(q, sums, slens, lens, score_splits=0, **kw)


@pytest.mark.parametrize("dtype,tol", ci_cases([(jnp.float32, 2e-3), (jnp.bfloat16, 2e-2)],
                                               [(jnp.float32, 2e-3)]))
def test_sparse_decode_triton_interpret(dtype, tol):
  """The Triton path (interpret) vs the fp32 reference restricted to its selection,
  which equals the XLA path's; GQA group 3, head_dim 72, lengths 1, on a block boundary,
  ragged; default and explicit split counts (more splits than kept blocks)."""
  _kernel_module_or_skip("triton")
  b, n, hq, hk, d, bs, top_k = 4, 250, 6, 2, 72, 16, 4
  q, kc, vc = normal(33, (b, hq, d), (b, n, hk, d), (b, n, hk, d), dtype=dtype)
  lens = jnp.array([250, 1, 160, 77])
  summ = sp.init_block_summaries(kc, lens, block_size=bs)
  idx_x = jax.jit(functools.partial(sp.select_decode_blocks, top_k=top_k, num_local_blocks=2))(
      q, summ, lens)
  up = lambda x: np.asarray(x, np.float32)
  mask = np.zeros((b, hk, 1, n), bool)
  for bi in range(b):
    for g in range(hk):
      for j in np.asarray(idx_x)[bi, g]:
        if j >= 0:
          mask[bi, g, 0, j * bs:min((j + 1) * bs, int(lens[bi]))] = True
  ref, ref_lse = attention_reference(jnp.asarray(up(q))[:, None], jnp.asarray(up(kc)),
                                     jnp.asarray(up(vc)), block_mask=jnp.asarray(mask))
  for splits in (None, 2, 7):
    out, lse, idx = jax.jit(functools.partial(
        sp.sparse_decode_attention, block_size=bs, top_k=top_k, num_local_blocks=2,
        return_lse=True, return_indices=True, implementation="triton", interpret=True,
        num_splits=splits))(q, kc, vc, lens, summ)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(idx_x))
    assert out.dtype == dtype
    assert _rel(out, ref[:, 0]) < tol
    assert _rel(lse, ref_lse[:, :, 0]) < 1e-3


def test_sparse_decode_default_splits():
  """B1 with 8 kv heads fills a 132-SM H200 (about two programs per SM), never splitting into
  fewer than 4 blocks per split."""
  from pallas_kernels.sparse.decode import default_num_splits
  assert default_num_splits(1, 8, 389, core_count=132) == 33
  assert default_num_splits(1, 8, 20, core_count=132) == 5
  assert default_num_splits(64, 8, 389, core_count=132) == 1


def _narrow_value_decode_inputs(seed, b, n, hq, hk, d, dv, bs, lens, dtype=jnp.float32):
  """q, contiguous k [.., d] / v [.., dv] caches, and the same caches in a shuffled page pool
  whose spare pages hold NaN values and whose table entries past each length are garbage."""
  q, kc, vc = normal(seed, (b, hq, d), (b, n, hk, d), (b, n, hk, dv), dtype=dtype)
  nb = -(-n // bs)
  rng = np.random.default_rng(seed)
  perm = rng.permutation(b * nb + 2)
  blocks = lambda x: jnp.pad(x, ((0, 0), (0, nb * bs - n), (0, 0), (0, 0))).reshape(
      b * nb, bs, hk, x.shape[-1])
  kp = jnp.full((b * nb + 2, bs, hk, d), 1e4, dtype).at[perm[:b * nb]].set(blocks(kc))
  vp = jnp.full((b * nb + 2, bs, hk, dv), jnp.nan, dtype).at[perm[:b * nb]].set(blocks(vc))
  table = perm[:b * nb].reshape(b, nb).astype(np.int32)
  for i, L in enumerate(lens):
    used = -(-L // bs)
    table[i, used:] = np.where(np.arange(nb - used) % 2, -7, perm[-1])  # never read
  return q, kc, vc, kp, vp, jnp.asarray(table)


@pytest.mark.parametrize("impl", ["xla", "triton"])
@pytest.mark.parametrize("d,dv,hq,hk", ci_cases([(48, 32, 6, 2), (72, 40, 4, 1)], [(72, 40, 4, 1)]))
def test_sparse_decode_values_narrower_than_keys(impl, d, dv, hq, hk):
  """MLA-shaped caches (keys d wide, values dv < d): contiguous and paged (shuffled pages, NaN
  spare pages) sparse decode return [.., dv] outputs equal to the fp32 reference restricted to the
  selection; GQA, a zero-length and a one-token sequence, several splits."""
  if impl == "triton":
    _kernel_module_or_skip("triton")
  b, n, bs, top_k = 4, 100, 16, 2
  lens = [100, 0, 1, 45]
  q, kc, vc, kp, vp, table = _narrow_value_decode_inputs(40 + d, b, n, hq, hk, d, dv, bs, lens)
  lens = jnp.array(lens, jnp.int32)
  summ = sp.init_block_summaries(kc, lens, block_size=bs)
  psumm = sp.init_block_summaries(kp, lens, block_size=bs, page_table=table)
  idx_x = np.asarray(jax.jit(functools.partial(sp.select_decode_blocks, top_k=top_k))(
      q, summ, lens))
  mask = np.zeros((b, hk, 1, n), bool)
  for bi in range(b):
    for g in range(hk):
      for j in idx_x[bi, g][idx_x[bi, g] >= 0]:
        mask[bi, g, 0, j * bs:min((j + 1) * bs, int(lens[bi]))] = True
  assert mask[0].sum() < hk * n                                   # sparse: blocks were skipped
  ref, ref_lse = attention_reference(q[:, None], kc, vc, block_mask=jnp.asarray(mask))
  ref, ref_lse = ref[:, 0], ref_lse[:, :, 0]                    # [b, hq, dv], [b, hq]
  kw = dict(top_k=top_k, return_lse=True, return_indices=True, implementation=impl,
            interpret=True, num_splits=3 if impl == "triton" else None)
  runs = {
      "contiguous": jax.jit(functools.partial(sp.sparse_decode_attention, block_size=bs, **kw))(
          q, kc, vc, lens, summ),
      "paged": jax.jit(functools.partial(sp.sparse_paged_decode_attention, **kw))(
          q, kp, vp, table, lens, psumm),
  }
  for name, (out, lse, idx) in runs.items():
    np.testing.assert_array_equal(np.asarray(idx), idx_x, err_msg=name)
    assert out.shape == (b, hq, dv) and out.dtype == q.dtype, (name, out.shape)
    assert not np.isnan(np.asarray(out)).any(), name
    assert _rel(out, ref) < 2e-3, (name, _rel(out, ref))
    assert np.all(np.asarray(out[1]) == 0) and np.all(np.isneginf(np.asarray(lse[1]))), name
    np.testing.assert_allclose(np.asarray(lse)[[0, 2, 3]], np.asarray(ref_lse)[[0, 2, 3]],
                               rtol=1e-4, atol=1e-4, err_msg=name)


def test_sparse_decode_partials_value_width():
  """The Triton kernel's partials carry the value width, and a k/v pair that disagrees in any
  other dim is rejected with a clear error."""
  _kernel_module_or_skip("triton")
  from pallas_kernels.sparse.decode import sparse_decode_partials
  q = jnp.ones((1, 4, 48)); k = jnp.ones((1, 64, 2, 48))
  idx = jnp.array([[[2, 0], [1, -1]]], jnp.int32)
  o, lse = sparse_decode_partials(q, k, k[..., :32], jnp.array([40], jnp.int32), idx,
                                  block_size=16, num_splits=2, interpret=True)
  assert o.shape == (1, 2, 4, 32) and lse.shape == (1, 2, 4)
  with pytest.raises(ValueError, match="share all but its last"):
    sparse_decode_partials(q, k, k[:, :32, :, :32], jnp.array([40], jnp.int32), idx,
                           block_size=16, num_splits=2, interpret=True)
  summ = sp.init_block_summaries(k, jnp.array([40]), block_size=16)
  with pytest.raises(ValueError, match="same shape except the last dim"):
    sp.sparse_decode_attention(q, k, k[:, :, :1, :32], jnp.array([40]), summ, block_size=16,
                               top_k=1, implementation="xla")


# ----------------------------------------------------------------------------- merged decode kernel
def _selection_reference(q, kc, vc, lens, idx, bs):
  """fp32 dense attention restricted to the kept blocks ``idx`` [b, hk, m] (-1 padded)."""
  b, n, hk, _ = kc.shape
  idx = np.asarray(idx)
  mask = np.zeros((b, hk, 1, n), bool)
  for bi in range(b):
    for g in range(hk):
      for j in idx[bi, g][idx[bi, g] >= 0]:
        mask[bi, g, 0, j * bs:min((j + 1) * bs, int(lens[bi]))] = True
  up = lambda x: jnp.asarray(x, jnp.float32)
  ref, ref_lse = attention_reference(up(q)[:, None], up(kc), up(vc), block_mask=jnp.asarray(mask))
  return ref[:, 0], ref_lse[:, :, 0]


@pytest.mark.parametrize("dtype,tol", ci_cases([(jnp.float32, 2e-3), (jnp.bfloat16, 2e-2)],
                                               [(jnp.bfloat16, 2e-2)]))
def test_sparse_decode_merged_kernel(dtype, tol):
  """The one-launch attention + in-kernel merge (interpret) vs the fp32 reference restricted to
  the selection and vs the two-kernel path (partials + merge kernel): contiguous and paged
  (shuffled pages, NaN spare pages), GQA group 3, values narrower than keys, lengths 0, 1,
  mid-block and full, top_k larger than the visible blocks, 1 split, several, more splits than
  kept blocks, and split orders in which another split than the last arrives last."""
  _kernel_module_or_skip("triton")
  from pallas_kernels.common.merge import merge_partials_pallas
  from pallas_kernels.sparse.decode import sparse_decode, sparse_decode_partials
  from pallas_kernels.sparse.decode_select import (decode_block_scores, decode_width,
                                                   select_decode_slots)
  b, n, hq, hk, d, dv, bs, top_k = 4, 100, 6, 2, 48, 32, 16, 9       # 7 blocks: top_k > visible
  lens_l = [100, 0, 1, 45]
  q, kc, vc, kp, vp, table = _narrow_value_decode_inputs(61, b, n, hq, hk, d, dv, bs, lens_l,
                                                         dtype)
  lens = jnp.array(lens_l, jnp.int32)
  summ = sp.init_block_summaries(kc, lens, block_size=bs)
  nb = summ.num_blocks
  width = decode_width(nb, top_k, 1, 1)
  kw = dict(block_size=bs, top_k=top_k, num_init_blocks=1, num_local_blocks=1)
  scores = decode_block_scores(q, summ.sums, summ.lengths, block_size=bs, interpret=True)
  idx, cnt, arr = select_decode_slots(scores, lens, max_selected=width, interpret=True,
                                      return_arrivals=True, **kw)
  np.testing.assert_array_equal(np.asarray(arr), 0)
  np.testing.assert_array_equal(np.asarray(cnt), [[7, 7], [0, 0], [1, 1], [3, 3]])
  ref, ref_lse = _selection_reference(q, kc, vc, lens, idx, bs)
  caches = {"contiguous": (kc, vc, None), "paged": (kp, vp, table)}
  # Split counts and arrival orders do not depend on the dtype, nor on the cache layout (only the
  # addressing does). fp32: every split case over the paged cache (shuffled pages, NaN spares):
  # 1 split, 2 in order, 3 with split 1 arriving last, 5 uneven, 8 > 7 kept blocks (empty splits)
  # with split 5 last; the contiguous cache at 8/5 (its 1-split case is the bf16 one below, and
  # 3 splits in order are the no-counters call at the end). bf16 (the output cast): one
  # contiguous and one paged case. Each case is an interpret-mode compile (CI time).
  if dtype == jnp.float32:
    cases = ([("paged", c) for c in [(1, 1), (2, 1), (3, 2), (5, 3), (8, 5)]]
             + [("contiguous", (8, 5))])
  else:
    cases = [("contiguous", (1, 1)), ("paged", (5, 3))]
  for name, (splits, stride) in cases:
    k, v, pt = caches[name]
    msg = f"{name} splits={splits} stride={stride}"
    out, lse = sparse_decode(q, k, v, lens, idx, pt, cnt, arr, block_size=bs, num_splits=splits,
                             interpret=True, _split_stride=stride)
    assert out.shape == (b, hq, dv) and out.dtype == dtype, msg
    assert not np.isnan(np.asarray(out, np.float32)).any(), msg
    assert _rel(out, ref) < tol, (msg, _rel(out, ref))
    assert np.all(np.asarray(out[1], np.float32) == 0), msg
    assert np.all(np.isneginf(np.asarray(lse[1]))), msg
    np.testing.assert_allclose(np.asarray(lse)[[0, 2, 3]], np.asarray(ref_lse)[[0, 2, 3]],
                               rtol=1e-4, atol=1e-4, err_msg=msg)
    parts = sparse_decode_partials(q, k, v, lens, idx, pt, cnt, block_size=bs,
                                   num_splits=splits, interpret=True)
    two, two_lse = merge_partials_pallas(*parts, out_dtype=dtype, interpret=True)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(two, np.float32),
                                  err_msg=msg)
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(two_lse), err_msg=msg)
  if dtype != jnp.float32:
    return
  # Without counters from the selection kernel the wrapper makes zeros (dtype-independent).
  out, _ = sparse_decode(q, kc, vc, lens, idx, None, cnt, block_size=bs, num_splits=3,
                         interpret=True)
  assert _rel(out, ref) < tol
  with pytest.raises(ValueError, match="coprime"):
    sparse_decode(q, kc, vc, lens, idx, None, cnt, block_size=bs, num_splits=4,
                  interpret=True, _split_stride=2)
  with pytest.raises(ValueError, match="arrivals must be"):
    sparse_decode(q, kc, vc, lens, idx, None, cnt, arr[:, :1], block_size=bs, num_splits=2,
                  interpret=True)


def _kept_block_lists(seed, bs, *, top_k):
  """The attention-kernel tests' case: B4 N100 GQA 6:2, head_dim 48 / values 32, lengths
  100 / 0 / 1 / 45, contiguous and paged caches, and the Triton selection's compact kept
  lists. Returns (q, kc, vc, kp, vp, table, lens, idx, cnt, arrivals, width)."""
  from pallas_kernels.sparse.decode_select import (decode_block_scores, decode_width,
                                                   select_decode_slots)
  b, n, hq, hk, d, dv = 4, 100, 6, 2, 48, 32
  lens_l = [100, 0, 1, 45]
  q, kc, vc, kp, vp, table = _narrow_value_decode_inputs(seed, b, n, hq, hk, d, dv, bs, lens_l)
  lens = jnp.array(lens_l, jnp.int32)
  summ = sp.init_block_summaries(kc, lens, block_size=bs)
  width = decode_width(summ.num_blocks, top_k, 1, 1)
  kw = dict(block_size=bs, top_k=top_k, num_init_blocks=1, num_local_blocks=1)
  scores = decode_block_scores(q, summ.sums, summ.lengths, block_size=bs, interpret=True)
  idx, cnt, arr = select_decode_slots(scores, lens, max_selected=width, interpret=True,
                                      return_arrivals=True, **kw)
  return q, kc, vc, kp, vp, table, lens, idx, cnt, arr, width


@pytest.mark.parametrize("bps,splits", ci_cases([(1, 3), (1, 7), (2, 2)], [(2, 2)]))
def test_sparse_decode_prefetch_ids(bps, splits):
  """``prefetch_ids=True`` (each split's block ids and pages loaded once as a vector, each step
  picking its ids from registers): at one block per step the default kernel's partials and
  merged output to the bit; at two blocks per step (splits hold whole steps) the fp32
  reference; the merge kernel (``merge_kernel=True``) the in-kernel merge's output. Contiguous
  and paged, with counts (compact lists) and without (lists in any order with -1 holes),
  lengths 0 / 1 / ragged, more splits than kept blocks. A wrong pick would move blocks between
  splits or drop them, which the merged output and the per-split partials both see."""
  _kernel_module_or_skip("triton")
  from pallas_kernels.sparse.decode import sparse_decode, sparse_decode_partials
  bs = 16
  q, kc, vc, kp, vp, table, lens, idx, cnt, arr, width = _kept_block_lists(62, bs, top_k=4)
  ref, ref_lse = _selection_reference(q, kc, vc, lens, idx, bs)
  # the same kept sets as unordered lists with -1 holes (no counts: every slot walked)
  perm = np.random.default_rng(5).permutation(width)
  shuffled = jnp.asarray(np.asarray(idx)[..., perm])
  run = dict(block_size=bs, num_splits=splits, interpret=True)
  pre = dict(run, blocks_per_step=bps, prefetch_ids=True)
  for (k, v, pt), lists, c in (((kc, vc, None), idx, cnt), ((kp, vp, table), idx, cnt),
                               ((kc, vc, None), shuffled, None),
                               ((kp, vp, table), shuffled, None)):
    msg = f"paged={pt is not None} counts={c is not None} bps={bps} splits={splits}"
    a = arr if c is not None else None
    out_p, lse_p = sparse_decode(q, k, v, lens, lists, pt, c, a, **pre)
    assert _rel(out_p, ref) < 2e-3, (msg, _rel(out_p, ref))
    fin = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_allclose(np.asarray(lse_p)[fin], np.asarray(ref_lse)[fin], rtol=1e-4,
                               atol=1e-4, err_msg=msg)
    out_m, lse_m = sparse_decode(q, k, v, lens, lists, pt, c, merge_kernel=True, **pre)
    np.testing.assert_allclose(np.asarray(out_m), np.asarray(out_p), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse_m), np.asarray(lse_p), rtol=1e-6, atol=1e-6)
    if bps == 1:
      base = sparse_decode_partials(q, k, v, lens, lists, pt, c, **run)
      got = sparse_decode_partials(q, k, v, lens, lists, pt, c, prefetch_ids=True, **run)
      for x, y in zip(got, base):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=msg)
      out_b, lse_b = sparse_decode(q, k, v, lens, lists, pt, c, a, **run)
      np.testing.assert_array_equal(np.asarray(out_p), np.asarray(out_b), err_msg=msg)
      np.testing.assert_array_equal(np.asarray(lse_p), np.asarray(lse_b), err_msg=msg)
  for bad in (dict(blocks_per_step=3, prefetch_ids=True), dict(blocks_per_step=2)):
    with pytest.raises(ValueError, match="blocks_per_step"):
      sparse_decode_partials(q, kc, vc, lens, idx, None, cnt, **run, **bad)


def test_sparse_decode_prefetch_ids_lowers_for_cuda():
  """At the bench shape the ``prefetch_ids`` kernel lowers for CUDA (on the CPU), contiguous
  and paged: one Triton call at 1 block per step (in-kernel merge), two at 2 blocks per step
  with the merge kernel (the sm90 head-major launch)."""
  from pallas_kernels.sparse.decode import sparse_decode
  S = jax.ShapeDtypeStruct
  bf16 = jnp.bfloat16
  n, bs, nb, _ = _bench_decode_shape()
  q, lens = S((1, 32, 128), bf16), S((1,), jnp.int32)
  idx, cnt = S((1, 8, 389), jnp.int32), S((1, 8), jnp.int32)
  for bps in (1, 2):
    for paged in (False, True):
      kv = S((nb + 4, bs, 8, 128), bf16) if paged else S((1, n, 8, 128), bf16)
      pt = (S((1, nb), jnp.int32),) if paged else ()
      fn = lambda q, k, v, l, i, c, *pt, bps=bps: sparse_decode(
          q, k, v, l, i, pt[0] if pt else None, c, None, block_size=bs, num_splits=16,
          blocks_per_step=bps, prefetch_ids=True, merge_kernel=bps == 2)
      text = _cuda_mlir(fn, q, kv, kv, lens, idx, cnt, *pt)
      assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == bps, (bps, paged)


def _cuda_mlir(fn, *args):
  """MLIR text of jit(fn) exported for CUDA (on the CPU; Triton custom calls allowed)."""
  disabled = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  return jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=disabled)(
      *args).mlir_module()


def _bench_decode_shape():
  """The bench shape (B1, 128K tokens, 8 kv heads, D128, 64-token blocks):
  (tokens, block size, blocks, fp32 BlockSummaries of ShapeDtypeStructs)."""
  S = jax.ShapeDtypeStruct
  n, bs = 131072, 64
  nb = n // bs
  summ = sp.BlockSummaries(sums=S((1, nb, 8, 128), jnp.float32), lengths=S((1,), jnp.int32),
                           block_size=bs)
  return n, bs, nb, summ


def test_sparse_decode_triton_is_three_launches():
  """At the bench shape (B1, 128K, GQA 32:8, D128, bf16, 64-token blocks), the "triton"
  sparse decode lowers (for CUDA, on the CPU) to exactly three Triton kernels and nothing that
  XLA would launch between them besides (no memset: the selection kernel zeroes the arrival
  counters, which the attention kernel updates in place); contiguous and paged."""
  S = jax.ShapeDtypeStruct
  bf16 = jnp.bfloat16
  n, bs, nb, summ = _bench_decode_shape()
  kw = dict(top_k=387, implementation="triton", num_splits=33)      # the H200 default
  contiguous = lambda q, k, v, lens, s: sp.sparse_decode_attention(q, k, v, lens, s,
                                                                   block_size=bs, **kw)
  paged = lambda q, k, v, pt, lens, s: sp.sparse_paged_decode_attention(q, k, v, pt, lens, s,
                                                                        **kw)
  cases = [(contiguous, (S((1, 32, 128), bf16), S((1, n, 8, 128), bf16), S((1, n, 8, 128), bf16),
                         S((1,), jnp.int32), summ)),
           (paged, (S((1, 32, 128), bf16), S((nb + 4, bs, 8, 128), bf16),
                    S((nb + 4, bs, 8, 128), bf16), S((1, nb), jnp.int32), S((1,), jnp.int32),
                    summ))]
  for fn, args in cases:
    text = _cuda_mlir(fn, *args)
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 3
    assert "grid_z = 33" in text
    assert "output_operand_alias" in text                          # counters updated in place
    for op in ("stablehlo.broadcast", "stablehlo.constant dense<0> : tensor<1x8xi32>",
               "stablehlo.sort", "stablehlo.reduce"):
      assert op not in text, op


def test_sparse_decode_hnd_launches(monkeypatch):
  """The head-major Triton plan at the bench shape on a 132-SM GPU lowers (for CUDA, on the
  CPU) to scores + selection in one launch (32 score splits, so a [1, 8] counter memset) and
  the attention with its in-kernel merge: two Triton kernels; on sm90 three (the attention's
  partials, then the merge kernel). The selection's warps at 2048 blocks: 8."""
  from pallas_kernels import compat
  monkeypatch.setattr(compat, "gpu_core_count", lambda: 132)
  S = jax.ShapeDtypeStruct
  bf16 = jnp.bfloat16
  n, bs, nb, _ = _bench_decode_shape()
  q, lens = S((1, 32, 128), bf16), S((1,), jnp.int32)
  summ_h = sp.BlockSummaries(sums=S((1, 8, nb, 128), jnp.float32), lengths=S((1,), jnp.int32),
                             block_size=bs, layout="hnd")
  count = lambda text: text.count("stablehlo.custom_call @__gpu$xla.gpu.triton")
  hnd = lambda: _cuda_mlir(lambda q, k, v, l, s: sp.sparse_decode_attention(
      q, k, v, l, s, kv_layout="hnd", block_size=bs, top_k=387, implementation="triton"),
      q, S((1, 8, n, 128), bf16), S((1, 8, n, 128), bf16), lens, summ_h)
  for cc, launches in ((None, 2), ((9, 0), 3)):
    monkeypatch.setattr(compat, "gpu_compute_capability", lambda cc=cc: cc)
    text = hnd()
    assert count(text) == launches, cc
    assert "grid_z = 32 " in text and "grid_z = 16" in text       # score splits, attention
    assert "stablehlo.constant dense<0> : tensor<i32>" in text     # the counters' memset
    if cc is None:
      warps = re.findall(r"num_warps = (\d+) : i32", text)        # score + selection, attention
      assert warps == ["8", "4"], warps


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow)
                                  for c in SELECTION_CASES[:1] + SELECTION_CASES[2:]
                                  if isinstance(c[8], int)] + ["packed", "packed_noncausal", "ties"])
def test_selection_by_top_k_mask_kernel_matches_the_sort(case, monkeypatch):
  """On a GPU ``_select`` keeps the top-k as a mask (``pallas_kernels.sparse.topk``, a Pallas
  kernel, interpreted here) and compacts it instead of ``lax.top_k`` + a sort: the same lists,
  here forced through the mask path on the CPU, on plain, packed (per-document initial blocks)
  and tie-heavy scores (rounded to halves: ties at the k-th score go to the lower block)."""
  from pallas_kernels.sparse import topk
  seg = None
  if isinstance(case, str) and case.startswith("packed"):
    b, sq, sk, hq, hk, d, bs, qbs, top_k, ni, nl = 4, 300, 300, 4, 2, 8, 16, 32, 3, 2, 2
    causal = case == "packed"
    seg = jnp.asarray(np.array([_rows_from_docs(sq, r) for r in PACKED_ROWS], np.int32))
  elif case == "ties":
    b, sq, sk, hq, hk, d, bs, qbs, top_k, ni, nl, causal = 2, 256, 256, 2, 1, 8, 16, 16, 4, 1, 1, True
  else:
    b, sq, sk, hq, hk, d, bs, qbs, top_k, ni, nl, causal = case
  q, k, _ = _qkv(sq + top_k, b, sq, sk, hq, hk, d)
  if case == "ties":
    q, k = jnp.round(q), jnp.round(k * 0.5)
  kw = dict(block_size=bs, q_block_size=qbs, top_k=top_k, causal=causal, num_init_blocks=ni,
            num_local_blocks=nl)
  want = sp.select_blocks(q, k, segment_ids=seg, **kw)
  calls = []

  def by_mask(*args, **kwargs):
    calls.append(1)
    return sp.selection._selected_lists_by_mask(
        *args, keep_fn=functools.partial(topk.top_k_mask, interpret=True), **kwargs)
  monkeypatch.setattr(sp.selection, "_selected_lists_by_sort", by_mask)
  jax.clear_caches()   # select_blocks is one jitted program: trace it again, through the patch
  got = sp.select_blocks(q, k, segment_ids=seg, **kw)
  assert calls, "the mask path did not run"
  if case == "ties":   # the case has ties at the k-th score (else it tests nothing new)
    s = np.sort(np.asarray(want.scores).reshape(-1, want.scores.shape[-1]), axis=-1)
    assert (s[:, 1:] == s[:, :-1]).any()
  np.testing.assert_array_equal(np.asarray(got.indices), np.asarray(want.indices))
  np.testing.assert_array_equal(np.asarray(got.counts), np.asarray(want.counts))


@pytest.mark.parametrize("shape,k", [((3, 37), 5), ((2, 3, 64), 64), ((5, 17), 1), ((2, 300), 40)])
def test_top_k_mask_kernel_matches_lax_top_k(shape, k):
  """``top_k_mask`` (interpreted) keeps exactly ``lax.top_k``'s set, with -inf entries and
  ties (values rounded to halves)."""
  from pallas_kernels.sparse.topk import top_k_mask
  x = np.round(np.random.default_rng(k).standard_normal(shape) * 2) / 2
  x[..., ::5] = -np.inf
  x = jnp.asarray(x, jnp.float32)
  _, idx = jax.lax.top_k(x, k)
  want = np.zeros(shape, bool)
  np.put_along_axis(want, np.asarray(idx), True, axis=-1)
  np.testing.assert_array_equal(np.asarray(top_k_mask(x, k, interpret=True)), want)


def test_top_k_mask_rejects_bad_input():
  from pallas_kernels.sparse.topk import MAX_ROW, top_k_mask
  for x, k in [(jnp.zeros((2, 4)), 0), (jnp.zeros((2, 4)), 5), (jnp.zeros((2, 4), jnp.int32), 1),
               (jnp.zeros((1, MAX_ROW + 1)), 1)]:
    with pytest.raises(ValueError):
      top_k_mask(x, k, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("seq,top_k", [(16384, 40), (262144, 700)])
def test_gpu_selection_kernel_matches_lax_top_k(seq, top_k):
  """On the GPU ``select_blocks`` runs the top-k mask kernel: its lists equal those of the sort
  path (``lax.top_k``) on the same device, with 64-key blocks: 256 blocks per row at 16K
  tokens (4 warps per program), 4096 at 256K (8 warps)."""
  q, k, _ = _qkv(7, 1, seq, seq, 4, 2, 64, dtype=jnp.bfloat16)
  kw = dict(block_size=64, q_block_size=128, top_k=top_k)
  got = jax.jit(functools.partial(sp.select_blocks, **kw))(q, k)
  by_sort = sp.selection._selected_lists_by_sort
  import unittest.mock as mock
  with mock.patch.object(sp.selection, "_selected_lists_by_mask",
                         lambda *a, keep_fn, **kw: by_sort(*a, **kw)):
    want = jax.jit(functools.partial(sp.select_blocks, **kw))(q, k)
  assert "jattn_top_k_mask" in jax.jit(functools.partial(sp.select_blocks, **kw)).lower(
      q, k).as_text()
  np.testing.assert_array_equal(np.asarray(got.indices), np.asarray(want.indices))
  np.testing.assert_array_equal(np.asarray(got.counts), np.asarray(want.counts))


def test_selection_lowers_the_top_k_kernel_on_cuda_only():
  """``select_blocks`` lowered for "cuda" runs the top-k mask kernel and no sort; for "tpu"
  (and the CPU) ``lax.top_k`` and the sort, as before."""
  from jax import export
  q = jax.ShapeDtypeStruct((1, 4096, 4, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 4096, 2, 64), jnp.bfloat16)
  f = jax.jit(functools.partial(sp.select_blocks, block_size=64, q_block_size=128, top_k=8))
  checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  for plat, kernel in (("cuda", True), ("tpu", False), ("cpu", False)):
    text = export.export(f, platforms=[plat], disabled_checks=checks)(q, k).mlir_module()
    assert ("jattn_top_k_mask" in text) == kernel, plat
    assert ("stablehlo.sort" in text) != kernel, plat


@pytest.mark.parametrize("top_k", [0.0, -0.1, 1.5, float("nan"), float("inf"), "0.2", True])
def test_fractional_top_k_refused(top_k):
  q = jnp.zeros((1, 64, 2, 8))
  with pytest.raises(ValueError, match="top_k"):
    select(q, q, block_size=16, q_block_size=16, top_k=top_k)
  with pytest.raises(ValueError, match="top_k"):
    sp.sparse_decode_plan(q[:, 0], q, q, block_size=16, top_k=top_k, implementation="xla")


def test_fractional_top_k_decode_selects_in_xla():
  """A fractional top_k never runs the Triton selection: None resolves to "xla" on a GPU, an
  explicit "triton" is refused by name."""
  q, k = jnp.zeros((1, 4, 8)), jnp.zeros((1, 64, 2, 8))
  with pytest.raises(ValueError, match="fractional top_k"):
    sp.sparse_decode_plan(q, k, k, block_size=16, top_k=0.2, implementation="triton")
  with mock.patch.object(sp_decode.compat, "default_backend", return_value="gpu"):
    assert sp.sparse_decode_plan(q, k, k, block_size=16, top_k=0.2).implementation == "xla"
    assert sp.sparse_decode_plan(q, k, k, block_size=16, top_k=2).implementation == "triton"


def test_block_summaries_check_the_page_table():
  """``init_block_summaries`` / ``update_block_summaries`` check a page table as the paged decode
  calls do: shape and dtype, and the page ids a sequence uses (concrete, or under
  ``debug_checks``), never clamping one silently."""
  k = jax.random.normal(jax.random.key(0), (8, 16, 2, 8))
  table, lens = jnp.array([[0, 1], [2, 3]], jnp.int32), jnp.array([20, 30])
  init = lambda t: sp_decode.init_block_summaries(k, lens, block_size=16, page_table=t)
  s = init(table)
  for bad, err, match in ((jnp.array([[0, 99], [2, 3]]), ValueError, r"page_table\[0, 1\] = 99"),
                         (jnp.array([[0, -1], [2, 3]]), ValueError, r"page_table\[0, 1\] = -1"),
                         (table.astype(jnp.float32), TypeError, "page_table must be an integer"),
                         (table[0], ValueError, r"page_table must be \[batch, max_pages\]")):
    with pytest.raises(err, match=match):
      init(bad)
  with pytest.raises(ValueError, match=r"page_table\[1, 1\] = 99"):
    sp_decode.update_block_summaries(s, k, lens + 1, page_table=jnp.array([[0, 1], [2, 99]]))
  with pytest.raises(ValueError, match=r"page_table\[0, 1\] = 99"), debug_checks():
    jax.jit(lambda t: init(t).sums)(jnp.array([[0, 99], [2, 3]]))
  np.testing.assert_array_equal(init([[0, 1], [2, 3]]).sums, s.sums)   # a list is an array


def test_a_hand_built_selection_is_checked():
  """Out-of-range block ids or counts, float ids and mismatched counts raise naming the field
  (eagerly; under ``debug_checks`` when traced), never dropped silently."""
  import dataclasses
  q = jax.random.normal(jax.random.key(0), (1, 64, 2, 16))
  sel = sp.select_blocks(q, q, block_size=16, q_block_size=16, top_k=1)
  run = lambda **bad: sp.block_sparse_attention(q, q, q, dataclasses.replace(sel, **bad))
  for bad, err, match in (
      (dict(indices=sel.indices.at[0, 0, 3, 0].set(4)), ValueError, r"indices\[0, 0, 3, 0\] = 4"),
      (dict(indices=sel.indices.at[0, 1, 2, 0].set(-2)), ValueError, r"indices\[0, 1, 2, 0\]"),
      (dict(counts=sel.counts.at[0, 0, 1].set(9)), ValueError, r"selection.counts\[0, 0, 1\]"),
      (dict(indices=sel.indices.astype(jnp.float32)), TypeError, "selection.indices"),
      (dict(counts=sel.counts[..., :2]), ValueError, "selection.counts")):
    with pytest.raises(err, match=match):
      run(**bad)
  f = jax.jit(lambda idx: sp.block_sparse_attention(q, q, q, dataclasses.replace(sel, indices=idx)))
  with pytest.raises(ValueError, match="selection.indices"), debug_checks():
    f(sel.indices.at[0, 0, 3, 0].set(4))
