"""Block schedules against brute-force element masks (hypothesis over mask layouts).

The hypothesis tests build each drawn schedule and brute-force mask under ``jax.jit`` (one XLA
compile per drawn shape instead of one per eager op, as the kernels call ``make_schedule``) and
walk the results as numpy arrays (CI time); the values checked are the same.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from pallas_kernels.block_schedule import compact_true, make_schedule, schedule_to_mask
from pallas_kernels.masks import element_mask


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3),
                   static_argnames=("causal", "local_window_size"))
def _jit_schedule(q_len, kv_len, bq, bk, q_segment_ids=None, kv_segment_ids=None, *, causal,
                  local_window_size):
  """``make_schedule`` and its ``schedule_to_mask`` in one jit (hypothesis draws many shapes)."""
  s = make_schedule(q_len, kv_len, bq, bk, causal=causal, local_window_size=local_window_size,
                    q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
  return s, schedule_to_mask(s)


def _np_schedule(s):
  """The schedule's arrays as numpy (cheap indexing in the per-tile loops)."""
  return jax.tree.map(np.asarray, s)


@functools.partial(jax.jit, static_argnames=("causal", "window"))
def _jit_element_mask(q_pos, k_pos, q_seg=None, kv_seg=None, *, causal, window):
  return element_mask(q_pos, k_pos, causal=causal, window=window, q_seg=q_seg, kv_seg=kv_seg)


def _tile_truth(q_len, kv_len, bq, bk, causal, window, qseg=None, kseg=None, block_mask=None):
  """Brute force: (any_visible, all_visible) per tile [B?, nq, nk] from the element mask."""
  qp = jnp.arange(q_len) + (kv_len - q_len)
  kp = jnp.arange(kv_len)
  if qseg is not None:
    m = np.asarray(_jit_element_mask(qp, kp, jnp.asarray(qseg), jnp.asarray(kseg),
                                     causal=causal, window=window))
  else:
    m = np.asarray(_jit_element_mask(qp, kp, causal=causal, window=window))[None]
  nq, nk = -(-q_len // bq), -(-kv_len // bk)
  pad = np.zeros((m.shape[0], nq * bq, nk * bk), bool)
  pad[:, :q_len, :kv_len] = m
  valid = np.zeros((nq * bq, nk * bk), bool)
  valid[:q_len, :kv_len] = True
  t = pad.reshape(m.shape[0], nq, bq, nk, bk)
  any_ = t.any(axis=(2, 4))
  # "all visible" over valid query rows and over all (even padded) key columns.
  rows_valid = np.zeros((nq * bq,), bool)
  rows_valid[:q_len] = True
  rv = rows_valid.reshape(nq, bq)[:, :, None, None]
  all_ = np.where(rv[None], t, True).all(axis=(2, 4))
  if block_mask is not None:
    any_ = any_ & block_mask
  return any_, all_


windows = st.one_of(st.none(), st.integers(0, 40).map(lambda w: (w, w)),
                    st.tuples(st.integers(0, 40), st.just(0)),
                    st.tuples(st.none(), st.integers(0, 30)))


@given(q_len=st.integers(1, 90), kv_len=st.integers(1, 90), bq=st.sampled_from([8, 16, 32]),
       bk=st.sampled_from([8, 16, 32]), causal=st.booleans(), window=windows)
def test_static_schedule_is_exact(q_len, kv_len, bq, bk, causal, window):
  s, visited = _jit_schedule(q_len, kv_len, bq, bk, causal=causal, local_window_size=window)
  s, visited = _np_schedule(s), np.asarray(visited)[0]
  any_, all_ = _tile_truth(q_len, kv_len, bq, bk, causal, window)
  np.testing.assert_array_equal(visited[0], any_[0])
  # Entries flagged "full" must have every element visible; partial ones must not all be.
  for qi in range(s.num_q_blocks):
    for j in range(int(s.kv_counts[0, 0, qi])):
      ki = int(s.kv_indices[0, 0, qi, j])
      assert bool(s.kv_partial[0, 0, qi, j]) == (not all_[0, qi, ki])
  # Indices are increasing and the transposed schedule lists the same tiles.
  visited_t = np.zeros_like(visited[0])
  for ki in range(s.num_kv_blocks):
    idx = np.asarray(s.q_indices[0, 0, ki, :int(s.q_counts[0, 0, ki])])
    assert np.all(np.diff(idx) > 0)
    visited_t[idx, ki] = True
  np.testing.assert_array_equal(visited_t, visited[0])


def _draw_segment_row(data, length, kinds=("right_pad", "left_pad", "negative", "arbitrary")):
  """Segment ids of one row: packed documents (non-decreasing ids) with padding (0) at the end
  or at the start, the same with negated ids, or arbitrary ids (not monotone, 0 anywhere,
  negative and int32-extreme ids)."""
  kind = data.draw(st.sampled_from(kinds))
  if kind == "arbitrary":
    ids = st.one_of(st.integers(-3, 3), st.sampled_from([np.iinfo(np.int32).min,
                                                         np.iinfo(np.int32).max]))
    return np.array(data.draw(st.lists(ids, min_size=length, max_size=length)), np.int32)
  cuts = sorted(data.draw(st.lists(st.integers(0, length), max_size=5)))
  row = np.zeros(length, np.int32)
  for i, c in enumerate(cuts):
    row[c:] = i + 1
  pad = data.draw(st.integers(0, length))   # pad == length: an all-padding row
  if kind == "left_pad":
    return np.concatenate([np.zeros(pad, np.int32), row[:length - pad]])
  row[length - pad:] = 0
  return -row if kind == "negative" else row


@given(data=st.data(), causal=st.booleans(), window=windows)
def test_segment_schedule_covers_every_visible_element(data, causal, window):
  length = data.draw(st.integers(1, 80))
  b = 2
  seg = np.stack([_draw_segment_row(data, length) for _ in range(b)])
  bq = data.draw(st.sampled_from([8, 16]))
  bk = data.draw(st.sampled_from([8, 16]))
  s, visited = _jit_schedule(length, length, bq, bk, jnp.asarray(seg), jnp.asarray(seg),
                             causal=causal, local_window_size=window)
  s, visited = _np_schedule(s), np.asarray(visited)[:, 0]
  any_, all_ = _tile_truth(length, length, bq, bk, causal, window, seg, seg)
  assert np.all(visited | ~any_), "a tile with a visible element was skipped"
  for bi in range(b):
    for qi in range(s.num_q_blocks):
      for j in range(int(s.kv_counts[bi, 0, qi])):
        ki = int(s.kv_indices[bi, 0, qi, j])
        if not s.kv_partial[bi, 0, qi, j]:
          assert all_[bi, qi, ki], "a tile marked full has masked elements"


@given(data=st.data())
def test_segment_schedule_is_exact_for_packed_rows(data):
  """Self-attention over packed rows (non-decreasing ids, padding at either end): the tiles
  visited are exactly those with a visible element. Padding (id 0) widens no tile's id range,
  so a tile straddling the last document and the padding visits only that document's tiles."""
  length = data.draw(st.integers(1, 80))
  seg = np.stack([_draw_segment_row(data, length, ("right_pad", "left_pad")) for _ in range(2)])
  bq = data.draw(st.sampled_from([8, 16]))
  bk = data.draw(st.sampled_from([8, 16]))
  _, visited = _jit_schedule(length, length, bq, bk, jnp.asarray(seg), jnp.asarray(seg),
                             causal=False, local_window_size=None)
  any_, _ = _tile_truth(length, length, bq, bk, False, None, seg, seg)
  np.testing.assert_array_equal(np.asarray(visited)[:, 0], any_)


def test_right_padded_packed_row_visits_only_needed_tiles():
  """Query tile 6 (tokens 96..111) holds the end of document 3 and padding: it visits document
  3's kv tiles only (it visited every earlier kv tile when the id ranges included 0); tile 7 is
  all padding and visits nothing."""
  seg = np.repeat(np.array([1, 2, 3, 0], np.int32), [40, 40, 30, 10])[None]   # 120 tokens
  s = make_schedule(120, 120, 16, 16, causal=True, q_segment_ids=jnp.asarray(seg),
                    kv_segment_ids=jnp.asarray(seg))
  visited = np.asarray(schedule_to_mask(s))[0, 0]
  any_, _ = _tile_truth(120, 120, 16, 16, True, None, seg, seg)
  np.testing.assert_array_equal(visited, any_[0])
  np.testing.assert_array_equal(np.flatnonzero(visited[6]), [5, 6])   # doc 3: keys 80..109
  assert not visited[7].any()


def test_block_mask_restricts_and_bounds():
  rng = np.random.default_rng(0)
  bm = rng.random((2, 3, 4, 4)) < 0.5
  s = make_schedule(64, 64, 16, 16, causal=True, block_mask=jnp.asarray(bm), max_kv_blocks=4)
  visited = np.asarray(schedule_to_mask(s))
  causal_tiles = np.tril(np.ones((4, 4), bool))
  np.testing.assert_array_equal(visited, bm & causal_tiles)
  assert s.kv_indices.shape == (2, 3, 4, 4)


def test_window_schedule_is_a_small_fraction_of_causal():
  causal = make_schedule(16384, 16384, 128, 128, causal=True)
  window = make_schedule(16384, 16384, 128, 128, causal=True, local_window_size=(511, 0))
  ratio = float(window.visited_tiles()[0, 0]) / float(causal.visited_tiles()[0, 0])
  assert ratio < 0.08, ratio
  assert window.max_kv_blocks == 5


def test_packed_documents_cost_like_separate_rows():
  seg = jnp.repeat(jnp.arange(1, 5, dtype=jnp.int32), 4096)[None]
  packed = make_schedule(16384, 16384, 128, 128, causal=True, q_segment_ids=seg, kv_segment_ids=seg)
  single = make_schedule(4096, 4096, 128, 128, causal=True)
  assert int(packed.visited_tiles()[0, 0]) == 4 * int(single.visited_tiles()[0, 0])


def test_mismatched_segments_raise():
  with pytest.raises(ValueError, match="together"):
    make_schedule(8, 8, 8, 8, q_segment_ids=jnp.ones((1, 8), jnp.int32))


@pytest.mark.parametrize("shape,width,p", [((3, 5, 17), 17, 0.3), ((2, 40), 6, 0.5),
                                           ((4, 9), 9, 0.0), ((2, 3, 8), 4, 1.0),
                                           ((2, 5), 8, 0.7)])
@pytest.mark.parametrize("fn", ["compact_true", "_compact_by_sort"])
def test_compact_true_matches_numpy(shape, width, p, fn):
  """``compact_true`` (GPU/CPU: running count + scatter) and its TPU branch (a stable argsort)
  against numpy's positions of the True entries: increasing order, 0 past the count, counts
  uncapped, rows longer than ``width`` cut."""
  from pallas_kernels import block_schedule
  keep = np.random.default_rng(width).random(shape) < p
  f = getattr(block_schedule, fn)
  order, count = jax.jit(f, static_argnums=1)(jnp.asarray(keep), width)
  order, count = np.asarray(order), np.asarray(count)
  for idx in np.ndindex(shape[:-1]):
    pos = np.flatnonzero(keep[idx])
    want = np.zeros(width, np.int32)
    want[:min(len(pos), width)] = pos[:width]
    np.testing.assert_array_equal(order[idx], want, err_msg=str(idx))
    assert count[idx] == len(pos)


def test_compact_true_lowers_by_platform():
  """The TPU lowering sorts (XLA's TPU scatter is serial); GPU and CPU scatter, no sort."""
  from jax import export
  f = jax.jit(lambda k: compact_true(k, 5))
  x = jax.ShapeDtypeStruct((3, 9), jnp.bool_)
  for plat, sorts in (("tpu", True), ("cuda", False), ("cpu", False)):
    text = export.export(f, platforms=[plat])(x).mlir_module()
    assert ("stablehlo.sort" in text) == sorts and ("stablehlo.scatter" in text) != sorts, plat
