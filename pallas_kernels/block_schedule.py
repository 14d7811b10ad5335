"""Masks as block schedules (docs/design.md): per query tile, the key/value tiles to visit, each
full or partial, and the transpose."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.common.util import check_flags, check_int, one_program, pad_axis
from pallas_kernels.masks import normalize_window

__all__ = ["BlockSchedule", "compact_true", "make_schedule", "mask_tile_classes",
           "schedule_to_mask", "check_schedule_args"]

_INT32_MAX, _INT32_MIN = np.iinfo(np.int32).max, np.iinfo(np.int32).min


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockSchedule:
  """Per-tile visit lists for a forward pass and its transpose; a kernel never touches a tile
  that is not in them. Leading axes [Bs, Hs]: Bs in {1, batch}, Hs in {1, kv_heads} (broadcast).

  Attributes:
    kv_indices, kv_counts, kv_partial: forward schedule, int32 [Bs, Hs, nq, max_kv] / [Bs, Hs, nq]:
      the kv tiles query tile qi visits in increasing order (entries past the count repeat the
      last valid index, so a pipelined TPU kernel issues no new copy, and are not computed), and
      1 where a tile needs the element mask (diagonal, window edge, segment boundary, padding, a
      mask array with both values in it), 0 where all is visible.
    q_indices, q_counts, q_partial: the transpose, int32 [Bs, Hs, nk, max_q] / [Bs, Hs, nk]: the
      query tiles visiting each kv tile (walked by the dK/dV backward kernels).
    block_q, block_k: tile sizes (static).
    q_len, kv_len: unpadded sequence lengths (static).

  Example:
    >>> s = make_schedule(100, 100, 32, 32, causal=True)
    >>> s.num_q_blocks, s.kv_counts[0, 0].tolist()
    (4, [1, 2, 3, 4])
  """
  kv_indices: jax.Array
  kv_counts: jax.Array
  kv_partial: jax.Array
  q_indices: jax.Array
  q_counts: jax.Array
  q_partial: jax.Array
  block_q: int = dataclasses.field(metadata=dict(static=True))
  block_k: int = dataclasses.field(metadata=dict(static=True))
  q_len: int = dataclasses.field(metadata=dict(static=True))
  kv_len: int = dataclasses.field(metadata=dict(static=True))

  @property
  def num_q_blocks(self) -> int:
    return -(-self.q_len // self.block_q)

  @property
  def num_kv_blocks(self) -> int:
    return -(-self.kv_len // self.block_k)

  @property
  def max_kv_blocks(self) -> int:
    return self.kv_indices.shape[-1]

  @property
  def max_q_blocks(self) -> int:
    return self.q_indices.shape[-1]

  def visited_tiles(self):
    """Number of (q tile, kv tile) pairs visited, per [Bs, Hs] (a jnp array)."""
    return jnp.sum(self.kv_counts, axis=-1)

  def density(self):
    """Fraction of all tiles visited, averaged over [Bs, Hs]."""
    return jnp.mean(self.visited_tiles()) / (self.num_q_blocks * self.num_kv_blocks)


def _static_tile_classes(q_len, kv_len, block_q, block_k, causal, window):
  """numpy (any_visible, all_visible) bool [nq, nk] for the static part of the mask."""
  nq, nk, off = -(-q_len // block_q), -(-kv_len // block_k), kv_len - q_len
  q0 = np.arange(nq)[:, None] * block_q + off            # first query position of tile
  q1 = np.minimum(q0 - off + block_q, q_len) - 1 + off   # last (valid) query position
  k0 = np.arange(nk)[None, :] * block_k
  k1 = np.minimum(k0 + block_k, kv_len) - 1              # last valid key of tile
  any_ = np.ones((nq, nk), bool)
  all_ = np.ones((nq, nk), bool) & ((k0 + block_k) <= kv_len)   # padding keys: partial
  # Query rows past q_len are padding (discarded): only valid rows decide visibility.
  if causal:
    any_ &= k0 <= q1
    all_ &= k1 <= q0
  if window is not None:
    left, right = window
    if left is not None:
      any_ &= k1 >= q0 - left
      all_ &= k0 >= q1 - left
    if right is not None:
      any_ &= k0 <= q1 + right
      all_ &= k1 <= q0 + right
  all_ &= any_
  return any_, all_


def segment_tile_classes(seg, length, block):
  """(lo, hi, pure) [b, n] per tile of segment ids int [b, length]: the smallest and largest
  nonzero id (int32; INT32_MAX, INT32_MIN when none: id 0 and positions past ``length`` are
  padding) and whether every position holds that one nonzero id (bool)."""
  n = -(-length // block)
  s = pad_axis(seg.astype(jnp.int32), 1, n * block).reshape(seg.shape[0], n, block)
  real = s != 0
  lo = jnp.min(jnp.where(real, s, _INT32_MAX), axis=-1)
  hi = jnp.max(jnp.where(real, s, _INT32_MIN), axis=-1)
  return lo, hi, jnp.all(real, axis=-1) & (lo == hi)


def segment_tile_pairs(q_classes, kv_classes):
  """(visit, full) bool of (query tile, kv tile) pairs from broadcastable ``segment_tile_classes``:
  visit where the id ranges [lo, hi] intersect (a superset of the visible pairs), full where both
  tiles hold one and the same nonzero id everywhere."""
  (qlo, qhi, qpure), (klo, khi, kpure) = q_classes, kv_classes
  visit = (qlo <= qhi) & (klo <= khi) & (qlo <= khi) & (klo <= qhi)
  return visit, qpure & kpure & (qlo == klo)


def mask_tile_classes(mask, block_q: int, block_k: int):
  """(any, all) visible per tile of a boolean element mask, on device (traced values are fine).

  Args:
    mask: bool [..., q_len, kv_len]; a 5-D mask [Bs, Hs, G, q_len, kv_len] also reduces its G
      axis (query heads sharing a kv head): any of them visible / all of them fully visible.
    block_q, block_k: tile sizes; tile padding past the mask's end decides nothing.

  Returns:
    (any_, all_): bool [..., nq, nk] (without the G axis of a 5-D mask).

  Example:
    >>> m = jnp.tril(jnp.ones((4, 4), bool))
    >>> [x.tolist() for x in mask_tile_classes(m, 2, 2)]
    [[[True, False], [True, True]], [[False, False], [True, False]]]
  """
  mask = jax.lax.optimization_barrier(mask)   # no slow constant folding of a constant mask
  q_len, kv_len = mask.shape[-2:]
  nq, nk = -(-q_len // block_q), -(-kv_len // block_k)
  pad = [(0, 0)] * (mask.ndim - 2) + [(0, nq * block_q - q_len), (0, nk * block_k - kv_len)]
  tiles = mask.shape[:-2] + (nq, block_q, nk, block_k)
  axes = (-3, -1) if mask.ndim < 5 else (2, -3, -1)
  count = jnp.sum(jnp.pad(mask, pad).reshape(tiles), axis=axes, dtype=jnp.int32)  # one pass
  size = (np.minimum(block_q, q_len - block_q * np.arange(nq))[:, None]   # real entries per tile
          * np.minimum(block_k, kv_len - block_k * np.arange(nk)) * np.prod(mask.shape[2:-2]))
  return count > 0, count == size


@one_program("width")
def compact_true(keep, width: int):
  """Positions of the True entries of ``keep`` along its last axis, in increasing order.

  On GPU and CPU a running count and one scatter; on TPU a stable argsort (the same result).

  Args:
    keep, width: bool [..., n]; slots per row (True entries past the first ``width`` dropped).

  Returns:
    (order, count): int32 [..., width], order[..., j] the position of the row's j-th True entry
    for j < min(count, width) and 0 past it; int32 [...] count, the row's True entries (not
    capped at ``width``).

  Example:
    >>> order, count = compact_true(jnp.array([[False, True, False, True]]), 3)
    >>> order.tolist(), count.tolist()
    ([[1, 3, 0]], [2])
  """
  keep = jnp.asarray(keep, bool)
  rows = int(np.prod(keep.shape[:-1], dtype=np.int64))
  if rows * max(width, 1) >= _INT32_MAX:
    raise ValueError(f"compact_true: {rows} rows x {width} slots do not fit int32 indices")
  return jax.lax.platform_dependent(keep, tpu=functools.partial(_compact_by_sort, width=width),
                                    default=functools.partial(_compact_by_scatter, width=width))


def scatter_rows(index, values, ok, width):
  """int32 [..., width] zeros with ``values`` put at ``index`` along the last axis where ``ok``
  (each slot written at most once per row). The others go to one trash slot, sliced off after:
  every index is in bounds (no reliance on how a backend drops out-of-bounds scatter updates)."""
  lead = values.shape[:-1]
  rows = int(np.prod(lead, dtype=np.int64))
  base = jnp.arange(rows, dtype=jnp.int32).reshape(lead + (1,)) * width
  dest = jnp.where(ok, base + index, rows * width)
  out = jnp.zeros((rows * width + 1,), jnp.int32).at[dest.reshape(-1)].set(
      values.reshape(-1).astype(jnp.int32), mode="promise_in_bounds")
  return out[:rows * width].reshape(lead + (width,))


def _compact_by_scatter(keep, width):
  """``compact_true`` by a running count and one scatter."""
  keep = jax.lax.optimization_barrier(keep)   # no constant folding: seconds per op at 64K tokens
  n = keep.shape[-1]
  slot = jnp.cumsum(keep.astype(jnp.int32), axis=-1) - 1        # [..., n]
  count = slot[..., -1] + 1 if n else jnp.zeros(keep.shape[:-1], jnp.int32)
  src = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), keep.shape)
  return scatter_rows(slot, src, keep & (slot < width), width), count.astype(jnp.int32)


def _compact_by_sort(keep, width, xp=jnp):
  """``compact_true`` by a sort of the positions (True entries first; the keys are distinct).
  ``xp``: jnp, or np for static masks at trace time."""
  n = keep.shape[-1]
  pos = xp.arange(n, dtype=xp.int32)
  order = xp.argsort(xp.where(keep, pos, n + pos), axis=-1).astype(xp.int32)
  if width > n:
    order = xp.pad(order, [(0, 0)] * (keep.ndim - 1) + [(0, width - n)])
  count = xp.sum(keep, axis=-1, dtype=xp.int32)
  j = xp.arange(width, dtype=xp.int32)
  return xp.where(j < count[..., None], order[..., :width], 0), count


def _compact(visit, partial, max_count, xp=jnp):
  """Sorted visit lists from bool masks [..., n_rows, n_cols] -> (indices, counts, partial);
  entries past a row's count repeat its last listed column (column 0 for an empty row).
  ``xp``: jnp (traced masks, ``compact_true``) or np (static masks, at trace time)."""
  order, counts = (_compact_by_sort(visit, max_count, np) if xp is np
                   else compact_true(visit, max_count))
  last = xp.take_along_axis(order, xp.maximum(xp.minimum(counts, max_count) - 1, 0)[..., None],
                            axis=-1)
  valid = xp.arange(max_count, dtype=xp.int32) < counts[..., None]
  indices = xp.where(valid, order, last).astype(xp.int32)
  part = xp.take_along_axis(partial, indices, axis=-1) & valid
  return indices, counts, part.astype(xp.int32)


def check_schedule_args(schedule, q_shape, k_shape) -> None:
  """Check that ``schedule`` is a ``BlockSchedule`` for q [B, Sq, Hq, D] and k [B, Sk, Hk, D].

  Args:
    schedule, q_shape, k_shape: the schedule a kernel was given; the shapes of q and k.

  Returns:
    None; TypeError / ValueError unless the lengths match and leading axes are [1|B, 1|Hk].

  Example:
    >>> s = make_schedule(100, 100, 32, 32, causal=True)
    >>> check_schedule_args(s, (2, 100, 4, 64), (2, 100, 2, 64))
  """
  if not isinstance(schedule, BlockSchedule):
    raise TypeError(f"schedule must be a BlockSchedule, got {type(schedule).__name__}")
  (b, sq, _, _), (_, sk, hk, _) = q_shape, k_shape
  if (schedule.q_len, schedule.kv_len) != (sq, sk):
    raise ValueError(f"schedule is for lengths ({schedule.q_len}, {schedule.kv_len}), inputs "
                     f"have ({sq}, {sk})")
  lead = schedule.kv_indices.shape[:2]
  if lead[0] not in (1, b) or lead[1] not in (1, hk):
    raise ValueError(f"schedule leading dims must be [1|{b}, 1|{hk}], got {lead}")


def make_schedule(q_len: int, kv_len: int, block_q: int, block_k: int, *, causal=False,
                  local_window_size=None, q_segment_ids=None, kv_segment_ids=None,
                  block_mask=None, mask=None, max_kv_blocks: int | None = None,
                  max_q_blocks: int | None = None) -> BlockSchedule:
  """Build the block schedule of a mask.

  Args:
    q_len, kv_len, block_q, block_k: unpadded sequence lengths; the walking kernel's tiles.
    causal, local_window_size: bottom-right aligned causal mask; None, int or (left, right).
    q_segment_ids, kv_segment_ids: None or int32 [batch, len] (both or neither); 0 = padding.
    block_mask: None or bool [Bs, Hs, nq, nk] (tile level, e.g. a top-K selection): tiles where
      it is False are never visited. Traced values are fine.
    mask: None or a boolean element mask (``mask_tile_classes``), [Bs, Hs, q_len, kv_len] or
      [Bs, Hs, G, q_len, kv_len] for G query heads per kv head: all-False tiles are skipped,
      all-True ones full, the others partial (the kernel reads the mask there); traced is fine.
    max_kv_blocks, max_q_blocks: static bounds on the visit-list lengths; default: the exact
      maximum of the static (causal/window) part.

  Returns:
    A ``BlockSchedule``.

  Example:
    >>> s = make_schedule(1000, 1000, 128, 128, causal=True)
    >>> int(s.kv_counts[0, 0, -1]), s.max_kv_blocks
    (8, 8)
  """
  for name, n in (("q_len", q_len), ("kv_len", kv_len), ("block_q", block_q), ("block_k", block_k)):
    check_int(name, n)
  check_flags(causal=causal)
  window = normalize_window(local_window_size)
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("q_segment_ids and kv_segment_ids must be given together")
  any_s, all_s = _static_tile_classes(q_len, kv_len, block_q, block_k, causal, window)
  nq, nk = any_s.shape
  exact_kv, exact_q = (max(int(any_s.sum(axis=a).max()), 1) for a in (1, 0))
  max_kv_blocks = min(exact_kv if max_kv_blocks is None else max_kv_blocks, nk)
  max_q_blocks = min(exact_q if max_q_blocks is None else max_q_blocks, nq)
  # Without traced inputs, build the lists in numpy at trace time (XLA constant-folds slowly).
  xp = np if q_segment_ids is None and block_mask is None and mask is None else jnp
  visit, full = xp.asarray(any_s)[None, None], xp.asarray(all_s)[None, None]   # [1, 1, nq, nk]
  if q_segment_ids is not None:
    qc = segment_tile_classes(q_segment_ids, q_len, block_q)    # 3 x [b, nq]
    kc = segment_tile_classes(kv_segment_ids, kv_len, block_k)   # 3 x [b, nk]
    seg_any, seg_all = segment_tile_pairs([x[:, :, None] for x in qc],
                                           [x[:, None, :] for x in kc])   # [b, nq, nk]
    visit, full = visit & seg_any[:, None], full & seg_all[:, None]
  if block_mask is not None:
    bm = jnp.asarray(block_mask, bool)
    if bm.ndim != 4 or bm.shape[-2:] != (nq, nk):
      raise ValueError(f"block_mask must be [Bs, Hs, {nq}, {nk}], got {bm.shape}")
    visit = visit & bm
  if mask is not None:
    m = jnp.asarray(mask, bool)
    if m.ndim not in (4, 5) or m.shape[-2:] != (q_len, kv_len):
      raise ValueError(f"mask must be [Bs, Hs, (G,) {q_len}, {kv_len}], got {m.shape}")
    m_any, m_all = mask_tile_classes(m, block_q, block_k)
    visit, full = visit & m_any, full & m_all
  partial = visit & ~full
  kv = _compact(visit, partial, max_kv_blocks, xp=xp)
  q = _compact(xp.swapaxes(visit, -1, -2), xp.swapaxes(partial, -1, -2), max_q_blocks, xp=xp)
  return BlockSchedule(*(jnp.asarray(x) for x in kv + q), block_q=block_q, block_k=block_k,
                       q_len=q_len, kv_len=kv_len)


def schedule_to_mask(schedule: BlockSchedule):
  """Expand a schedule's forward lists to a bool tile mask [Bs, Hs, nq, nk] (for tests/plots).

  Args:
    schedule: a ``BlockSchedule``.

  Returns:
    bool [Bs, Hs, num_q_blocks, num_kv_blocks], True where a tile is visited.

  Example:
    >>> m = schedule_to_mask(make_schedule(256, 256, 64, 64, causal=True))
    >>> int(m.sum())
    10
  """
  valid = jnp.arange(schedule.max_kv_blocks) < schedule.kv_counts[..., None]
  onehot = jax.nn.one_hot(schedule.kv_indices, schedule.num_kv_blocks, dtype=jnp.int32)
  return jnp.sum(onehot * valid[..., None], axis=-2) > 0
