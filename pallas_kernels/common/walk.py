"""Walks of the Hopper (Mosaic GPU) flash kernels: block-schedule rows and segment-id ranges.

A program owns two warpgroup tiles along one axis (forward and dQ: query rows; dK/dV: keys)
and streams tiles along the other through a ring of shared-memory slots. For a block schedule
each program gets one row ``[count, entry_0, ...]``: the union of its warpgroups' walked tiles,
in increasing order, each entry packing the tile and what each warpgroup does with it::

  entry = tile << WALK_SHIFT | code(warpgroup 0) | code(warpgroup 1) << 2

with a code of SKIP (drain the ring slot: none of the warpgroup's real rows sees the tile), FULL
(every element visible: no element mask) or PARTIAL (apply the element mask). The memory
warpgroup loads entry j into slot j mod stages; each compute warpgroup walks every entry and
branches on its code (``entry_tile``, ``entry_code``)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.block_schedule import (compact_true, scatter_rows, segment_tile_classes,
                                           segment_tile_pairs)

WALK_SHIFT = 4
SKIP, FULL, PARTIAL = 0, 1, 2
WARPGROUPS = 2   # compute warpgroups per program: the two codes of an entry

# The documented API; the entry codes serve the Mosaic GPU kernels.
__all__ = ["list_walk", "range_codes", "segment_bounds"]


def entry_tile(entry):
  """The walked tile of an entry (int32 scalar or array)."""
  return lax.shift_right_logical(entry, jnp.int32(WALK_SHIFT))


def entry_code(entry, wg):
  """Compute warpgroup ``wg``'s code (SKIP, FULL or PARTIAL) of an entry."""
  return lax.bitwise_and(lax.shift_right_logical(entry, 2 * jnp.asarray(wg, jnp.int32)),
                         jnp.int32(3))


def range_codes(tiles, valid, ranges, own_seg, own_block, walk_seg, walk_block):
  """Codes (SKIP, FULL, PARTIAL) of listed walk tiles from each own tile's static ranges.

  Args:
    tiles, valid: int32 [Bs, Hs, n_own, L] walk tiles listed for each own tile, and bool: the
      entries that are listed (the others get SKIP).
    ranges: (lo, flo, fhi, hi) int32 [n_own]: own tile i may see walk tiles [lo, hi) and sees
      [flo, fhi) in full under the static mask (causal, window, padding).
    own_seg, walk_seg, own_block, walk_block: None or int32 segment ids [B, S'] along the own /
      walked axis (padded with 0 to whole tiles), and the own / walk tile sizes.

  Returns:
    int32 [B', Hs, n_own, L] codes (B' = B with segment ids, else Bs): SKIP where the static
    mask or the tiles' segment id classes (``block_schedule.segment_tile_pairs``) rule every
    pair out, FULL where both allow every element, else PARTIAL.

  Example:
    >>> r = tuple(jnp.array([x]) for x in (0, 1, 2, 3))      # one own tile: [0, 3), full [1, 2)
    >>> t = jnp.arange(4).reshape(1, 1, 1, 4)
    >>> range_codes(t, t >= 0, r, None, 64, None, 64).tolist()
    [[[[2, 1, 2, 0]]]]
  """
  lo, flo, fhi, hi = (x[:, None] for x in ranges)                           # [n_own, 1]
  visible, full = valid & (tiles >= lo) & (tiles < hi), (tiles >= flo) & (tiles < fhi)
  if own_seg is not None:
    n_own = tiles.shape[2]
    oc = [x[:, :n_own] for x in segment_tile_classes(own_seg, own_seg.shape[1], own_block)]
    wc = segment_tile_classes(walk_seg, walk_seg.shape[1], walk_block)     # 3 x [B, n_walk]
    t = jnp.broadcast_to(jnp.clip(tiles, 0, wc[0].shape[1] - 1),
                         (own_seg.shape[0],) + tiles.shape[1:])
    wc_t = [jax.vmap(lambda x, i: x[i])(x, t) for x in wc]                   # [B, Hs, n_own, L]
    seg_any, seg_all = segment_tile_pairs([x[:, None, :, None] for x in oc], wc_t)
    visible, full = visible & seg_any, full & seg_all
  return jnp.where(visible, jnp.where(full, FULL, PARTIAL), SKIP).astype(jnp.int32)


def list_walk(idx, cnt, s_own, s_walk, own_block, walk_block, n_own, n_walk, codes_fn):
  """Per-program walk rows of a list schedule (forward, dQ: ``kv_indices``; dK/dV: ``q_indices``).

  Warpgroup tile i lies in schedule row ``i * own_block // s_own``; each listed schedule tile
  becomes its ``s_walk // walk_block`` kernel tiles. Entries neither warpgroup needs are dropped
  (kept as drains where ``s_own == 2 * own_block`` and ``s_walk == walk_block``).

  Args:
    idx, cnt: int32 [Bs, Hs, R, M] / [Bs, Hs, R]: per schedule tile of ``s_own`` along the own
      axis, the listed tiles of ``s_walk`` along the other and their count.
    s_own, s_walk, own_block, walk_block: the schedule's tile sizes and the kernel's (divisors).
    n_own, n_walk: the kernel's warpgroup tiles (2 per program; those past the schedule list
      nothing) and walk tiles (listed tiles from ``n_walk`` on are dropped).
    codes_fn: ``(tiles [Bs, Hs, n_own, L], valid) -> codes [B', Hs, n_own, L]`` (SKIP, FULL,
      PARTIAL per own tile), e.g. ``range_codes`` with the kernel's static ranges.

  Returns:
    int32 [B', Hs, n_own // 2, 1 + W] rows ``[count, entry_0, ..., entry_{W-1}]``, in
    increasing tile order; entries past count are 0 and never read.

  Example:
    >>> idx, cnt = jnp.array([[[[0, 2]]]]), jnp.array([[[2]]])    # one 128-row tile: kv 0, 2
    >>> codes = lambda t, ok: jnp.where(ok, FULL, SKIP)
    >>> list_walk(idx, cnt, 128, 64, 64, 64, 2, 4, codes).tolist()
    [[[[2, 5, 37]]]]
  """
  bq, sbq, rk, nq_s = own_block, s_own, s_walk // walk_block, idx.shape[2]
  idx, cnt = idx.astype(jnp.int32), cnt.astype(jnp.int32)     # [Bs, Hs, nq_s, M], [Bs, Hs, nq_s]
  rows = np.arange(n_own) * bq // sbq                          # schedule row of each wg tile
  real = jnp.asarray(rows < nq_s)                              # the others: padding, nothing
  rows = np.minimum(rows, nq_s - 1)
  j = np.arange(idx.shape[-1] * rk)
  tiles = idx[:, :, rows][..., j // rk] * rk + jnp.asarray(j % rk, jnp.int32)  # [Bs, Hs, n_own, L]
  cnt_w = jnp.where(real, cnt[:, :, rows], 0)
  valid = (jnp.asarray(j // rk) < cnt_w[..., None]) & (tiles < n_walk)
  codes = codes_fn(tiles, valid)                               # [B', Hs, n_own, L]
  tiles = jnp.broadcast_to(tiles, codes.shape)
  t0, t1 = tiles[:, :, 0::2], tiles[:, :, 1::2]                # [B', Hs, P, L]
  c0, c1 = codes[:, :, 0::2], codes[:, :, 1::2]
  take = lambda order, *xs: [jnp.take_along_axis(x, order, axis=-1) for x in xs]
  if sbq % (WARPGROUPS * bq) == 0:      # both warpgroups read the same row: one list
    if sbq == WARPGROUPS * bq and rk == 1:      # no compaction: the rows as they are
      return _walk_rows(t0, c0, c1, jnp.broadcast_to(cnt_w[:, :, 0::2], c0.shape[:-1]))
    order, count = compact_true((c0 | c1) != SKIP, min(t0.shape[-1], n_walk))
    return _walk_rows(*take(order, t0, c0, c1), count)
  # Two rows: their union, in increasing tile order. Each row's codes scattered over the walk
  # axis (a tile at most once per row), then the tiles either row lists, compacted (no sort).
  dense = [scatter_rows(tw, cw, cw != SKIP, n_walk)   # SKIP == 0 elsewhere
           for tw, cw in jax.lax.optimization_barrier(((t0, c0), (t1, c1)))]   # no const folding
  order, count = compact_true((dense[0] | dense[1]) != SKIP, min(2 * t0.shape[-1], n_walk))
  return _walk_rows(order, *take(order, *dense), count)


def _walk_rows(t, c0, c1, count):
  """Walk rows ``[count, entry_0, ...]`` from tiles and codes [..., W]; entries past count: 0."""
  j, count = jnp.arange(t.shape[-1], dtype=jnp.int32), jnp.minimum(count, t.shape[-1])
  entries = jnp.where(j < count[..., None], (t << WALK_SHIFT) | c0 | (c1 << 2), 0)
  return jnp.concatenate([count[..., None], entries], -1).astype(jnp.int32)


def segment_bounds(own_seg, own_block, n_own, walk_seg, walk_block, n_walk, static, *,
                   one_segment=False):
  """Per-(batch, program) walk ranges with segment ids (the range path's bounds rows): a
  warpgroup tile walks [lo, hi), from the first to the last tile the static mask and the tiles'
  segment ids allow (``block_schedule.segment_tile_pairs``; tiles between walked masked),
  unmasked on the first run [flo, fhi) of tiles statically full, one same nonzero id each side.

  Args:
    own_seg, walk_seg: int32 [B, S'] segment ids along the own / walked axis, padded with 0
      (which sees nothing) to whole tiles.
    own_block, walk_block, n_own, n_walk: the tile sizes; the warpgroup tiles (2 per program)
      and walk tiles.
    static: (lo, flo, fhi, hi) int32 [n_own]: each warpgroup tile's ranges under the static mask.
    one_segment: add each warpgroup's one-segment flag (two more columns).

  Returns:
    int32 [B, n_own // 2, 10 (12)] rows ``[plo, phi, lo0, flo0, fhi0, hi0, lo1, flo1, fhi1,
    hi1(, one0, one1)]``: the program walks [plo, phi), the union of its warpgroups' ranges,
    each clipped into it (an empty one becomes an empty range inside it, drained); ``one_w`` is
    1 where every tile of warpgroup w's [lo, hi) holds one and the same nonzero id on both sides.

  Example:
    >>> seg = jnp.array([[1] * 128 + [2] * 128])
    >>> static = tuple(jnp.array(x) for x in ([0, 0], [0, 0], [2, 2], [2, 2]))
    >>> segment_bounds(seg, 64, 2, seg, 128, 2, static)[0, 0, :6].tolist()
    [0, 1, 0, 0, 1, 1]
  """
  oc = [x[:, :n_own, None] for x in segment_tile_classes(own_seg, own_seg.shape[1], own_block)]
  wc = [x[:, None, :n_walk] for x in segment_tile_classes(walk_seg, walk_seg.shape[1], walk_block)]
  seg_any, seg_all = segment_tile_pairs(oc, wc)                     # [B, n_own, n_walk]
  lo, flo, fhi, hi = (jnp.broadcast_to(x, (n_own,))[:, None] for x in static)
  t = jnp.arange(n_walk, dtype=jnp.int32)
  visit = seg_any & ((t >= lo) & (t < hi))[None]
  full = visit & seg_all & ((t >= flo) & (t < fhi))[None]
  rows = _program_bounds(visit, full)                               # [B, programs, 10]
  if not one_segment:
    return rows
  b = rows.shape[0]
  lo, hi = (rows[..., 2 + j::4][..., :WARPGROUPS].reshape(b, n_own, 1) for j in (0, 3))
  walked = (t >= lo) & (t < hi)                                     # [B, n_own, n_walk]
  one = jnp.all(seg_all | ~walked, -1).reshape(b, n_own // WARPGROUPS, WARPGROUPS)
  return jnp.concatenate([rows, one.astype(jnp.int32)], -1)


def _program_bounds(visit, full):
  """``segment_bounds``'s rows [B, programs, 10] from its tile masks [B, 2 * programs, n] (no
  visited tile: lo = hi = n; no full one: flo = fhi = hi; then clipped into the program's)."""
  n = visit.shape[-1]
  t = jnp.arange(n, dtype=jnp.int32)
  any_visit, any_full = visit.any(-1), full.any(-1)
  lo = jnp.where(any_visit, jnp.argmax(visit, -1), n).astype(jnp.int32)
  hi = jnp.where(any_visit, n - jnp.argmax(visit[..., ::-1], -1), n).astype(jnp.int32)
  flo = jnp.where(any_full, jnp.argmax(full, -1), hi).astype(jnp.int32)
  after = (~full) & (t >= flo[..., None])
  fhi = jnp.where(after.any(-1), jnp.argmax(after, -1), n).astype(jnp.int32)
  fhi = jnp.where(any_full, jnp.minimum(fhi, hi), flo)
  b = lo.shape[0]
  shape = (b, lo.shape[1] // WARPGROUPS, WARPGROUPS)
  lo, flo, fhi, hi = (x.reshape(shape) for x in (lo, flo, fhi, hi))
  empty = lo >= hi
  plo = jnp.min(jnp.where(empty, jnp.iinfo(jnp.int32).max, lo), -1)
  phi = jnp.max(jnp.where(empty, 0, hi), -1)
  plo = jnp.where(phi > 0, plo, 0)                        # no warpgroup sees anything: [0, 0)
  phi = jnp.maximum(phi, plo)
  lo = jnp.where(empty, plo[..., None], jnp.clip(lo, plo[..., None], phi[..., None]))
  hi = jnp.where(empty, lo, jnp.clip(hi, lo, phi[..., None]))
  flo = jnp.clip(flo, lo, hi)
  fhi = jnp.clip(fhi, flo, hi)
  wgs = jnp.stack([lo, flo, fhi, hi], -1).reshape(b, shape[1], 4 * WARPGROUPS)
  return jnp.concatenate([plo[..., None], phi[..., None], wgs], -1).astype(jnp.int32)
