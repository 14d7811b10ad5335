"""The Hopper (sm90) flash attention forward kernel in Pallas Mosaic GPU: FlashAttention-3's
forward (design: docs/flash.md, "The Hopper kernels"); the wrapper is
``pallas_kernels.flash.mosaic_gpu``. Each compute warpgroup walks kv tiles [lo, hi), masked on
[lo, flo) and [fhi, hi); the program's range [plo, phi) is their union (``_static_ranges``,
``seg_bounds`` or ``schedule_walk``).
"""
from __future__ import annotations

import dataclasses
import functools
import typing

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from pallas_kernels import compat
from pallas_kernels.common import walk
from pallas_kernels.common.softmax import LOG2E
from pallas_kernels.common.softmax import finalize as _finalize

__all__ = []   # the documented entry point is pallas_kernels.flash.mosaic_gpu

# Finite initial running max: exp2(m - m) = 1 instead of NaN for a row with nothing visible yet.
_M_INIT = -1e30
COMPUTE_WGS = walk.WARPGROUPS
# setmaxnreg: 2 * 232 + 40 = 3 x 168, the CTA's launch allocation.
_COMPUTE_REGISTERS = 232
_MEMORY_REGISTERS = 40


class Protocol(typing.NamedTuple):
  """How the compute warpgroups share the tensor cores and the ring (``PROTOCOLS``).

  Attributes:
    handoff: one barrier per compute warpgroup: arrive on the other's after Q K^T, wait on
      its own before P V. Off: one shared barrier met twice per kv tile.
    k_wait: wait for the next ring entry's K while the P V wgmma runs, not at the next step.
    fence: an optimization barrier on (acc, m, l, p) after each tile's softmax (none of it in
      the other warpgroup's wgmma window).
    overlap: tile t's softmax runs while P V(t - 1) is on the tensor cores; needs ``handoff``.
    early_k: the memory warpgroup refills a slot's K as soon as K is released, before V.
  """
  handoff: bool = False
  k_wait: bool = False
  fence: bool = False
  overlap: bool = False
  early_k: bool = False


# The protocols the tuning tables use (``BlockSizes.protocol``).
PROTOCOLS = {
    "pingpong": Protocol(),
    "pingpong_kwait": Protocol(k_wait=True),
    "handoff_kwait": Protocol(handoff=True, k_wait=True),
    "handoff_kwait_fence": Protocol(handoff=True, k_wait=True, fence=True),
    "overlap": Protocol(handoff=True, overlap=True, early_k=True),
}


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Everything static about one forward call (``mosaic_gpu._static_config``), backward too."""
  block_q: int         # rows per compute warpgroup
  block_k: int
  num_stages: int
  q_len: int           # unpadded
  kv_len: int          # unpadded
  num_q_programs: int  # padded q_len // (2 * block_q): query tiles of 2 * block_q rows
  num_kv_tiles: int    # padded kv_len // block_k
  head_dim: int
  group: int           # query heads per kv head
  causal: bool
  scale: float
  dtype: jnp.dtype
  window: tuple | None = None   # (left, right) from masks.normalize_window; a side None = unbounded
  soft_cap: float | None = None
  has_seg: bool = False         # segment ids: per-(batch, q tile) kv ranges from ``seg_bounds``
  protocol: str = "pingpong"    # a key of PROTOCOLS
  q_tiles_per_program: int = 1  # BlockSizes.q_tiles_per_program (> 1: range path only)
  one_seg_mask: bool = False    # BlockSizes.one_segment_static_mask
  tail_batch: int = -1     # tail_kv_splits: this batch row's last program is skipped (-1: none)
  tail_kv_splits: int = 0  # BlockSizes.tail_kv_splits (0: off)
  # Block schedule: each program walks its row of ``schedule_walk`` (from GMEM), no ranges.
  has_sched: bool = False
  sched_batch: bool = False     # the walk has a batch axis (else one row shared by all batches)
  sched_heads: bool = False     # the walk has a kv-head axis (else shared by all heads)
  interpret: bool = False    # the backward's Triton kernels in interpret mode (the forward raises)
  bwd_block_sizes: object = None   # the backward's BlockSizes (triton or mosaic_gpu_bwd) or None
  backward: str = "triton"         # "triton" or "mosaic" (the kernels of the custom_vjp backward)
  prefix_tiles: int = 0   # kv tiles [0, P) from the k/v prefix refs, tile t >= P from k/v's t - P

  @property
  def offset(self) -> int:
    """kv position of query row 0 (bottom-right causal alignment)."""
    return self.kv_len - self.q_len

  @property
  def num_full_tiles(self) -> int:
    """kv tiles without padded keys."""
    return self.kv_len // self.block_k

  @property
  def num_programs(self) -> int:
    """Programs per (batch, head): query tiles / ``q_tiles_per_program``, rounded up."""
    return -(-self.num_q_programs // self.q_tiles_per_program)

  @property
  def proto(self) -> Protocol:
    return PROTOCOLS[self.protocol]


def _bounds(st: KernelConfig):
  """(left, right): a row at qpos sees keys in [qpos - left, qpos + right] (None: unbounded)."""
  left = None if st.window is None else st.window[0]
  return left, 0 if st.causal else (None if st.window is None else st.window[1])


def _static_ranges(row0, n, st: KernelConfig):
  """kv tile ranges (lo, flo, fhi, hi) int32 (elementwise in ``row0``) of the real query rows
  (< q_len) in [row0, row0 + n) under the static mask: [flo, fhi) fully visible, [lo, flo) and
  [fhi, hi) masked, others invisible; lo <= flo <= fhi <= hi, hi == lo when no row sees a key."""
  bk, nk = st.block_k, st.num_kv_tiles
  row0 = jnp.asarray(row0, jnp.int32)
  last = jnp.minimum(row0 + n, st.q_len) - 1          # last real row
  q_first = row0 + st.offset                           # kv position of the first row
  q_last = last + st.offset
  left, right = _bounds(st)
  zero = jnp.int32(0)
  if left is None:
    lo = flo = jnp.zeros_like(row0)
  else:
    lo = lax.div(jnp.maximum(zero, q_first - left), jnp.int32(bk))
    flo = lax.div(jnp.maximum(zero, q_last - left) + (bk - 1), jnp.int32(bk))
  lo = jnp.minimum(lo, nk)
  if right is None:
    hi = jnp.full_like(row0, nk)
    fhi = jnp.full_like(row0, st.num_full_tiles)
  else:
    hi = jnp.minimum(lax.div(jnp.maximum(zero, q_last + right + bk), jnp.int32(bk)), nk)
    fhi = jnp.minimum(lax.div(jnp.maximum(zero, q_first + right + 1), jnp.int32(bk)),
                      st.num_full_tiles)
  hi = jnp.where(last < row0, lo, jnp.maximum(hi, lo))
  flo = jnp.clip(flo, lo, hi)
  fhi = jnp.clip(fhi, flo, hi)
  return lo, flo, fhi, hi


def _clip_to_program(plo, phi, lo, flo, fhi, hi):
  """A warpgroup's ranges clipped into its program's [plo, phi) (an empty one stays empty)."""
  lo = jnp.clip(lo, plo, phi)
  hi = jnp.clip(hi, lo, phi)
  flo = jnp.clip(flo, lo, hi)
  fhi = jnp.clip(fhi, flo, hi)
  return lo, flo, fhi, hi


def seg_bounds(q_seg, kv_seg, st: KernelConfig):
  """``walk.segment_bounds`` rows [B, num_q_programs, 10 (12 with ``st.one_seg_mask``)]: the
  ``_static_ranges`` cut to segment ids q_seg [B, Sq'], kv_seg [B, Sk'] (int32, 0-padded)."""
  n_tiles = st.num_q_programs * COMPUTE_WGS
  static = _static_ranges(jnp.arange(n_tiles, dtype=jnp.int32) * st.block_q, st.block_q, st)
  return walk.segment_bounds(q_seg, st.block_q, n_tiles, kv_seg, st.block_k, st.num_kv_tiles,
                             static, one_segment=st.one_seg_mask)


class _Mask(typing.NamedTuple):
  """A masked tile: ``seg``: with the segment compare; ``edge``: ``_edge_bounds``' edge."""
  seg: bool
  edge: str | None


def _walk_codes(tiles, valid, st: KernelConfig, q_seg=None, kv_seg=None):
  """``walk.range_codes`` [B', Hs, n_wg, L] of the listed kv tiles of each warpgroup tile."""
  n_wg = tiles.shape[2]
  ranges = _static_ranges(jnp.arange(n_wg, dtype=jnp.int32) * st.block_q, st.block_q, st)
  return walk.range_codes(tiles, valid, ranges, q_seg, st.block_q, kv_seg, st.block_k)


def schedule_walk(schedule, st: KernelConfig, q_seg=None, kv_seg=None):
  """The kernel's ``walk.list_walk`` rows [B', Hs, num_q_programs, 1 + W] (B' = B with segment
  ids or a per-batch schedule, else 1) of a ``BlockSchedule``, coded by ``_walk_codes``."""
  return walk.list_walk(schedule.kv_indices, schedule.kv_counts, schedule.block_q,
                        schedule.block_k, st.block_q, st.block_k,
                        COMPUTE_WGS * st.num_q_programs, st.num_kv_tiles,
                        lambda tiles, valid: _walk_codes(tiles, valid, st, q_seg, kv_seg))


def _edge_bounds(st: KernelConfig, edge):
  """Which static bounds a masked tile applies: bools (padded keys, right / causal, left).
  ``edge``: None (every bound the mask has), "left" or "right" (a tile of a warpgroup's [lo, flo)
  or [fhi, hi)): on the range path, the bounds that cannot mask a real row's key there drop."""
  left, right = _bounds(st)
  pad, r_on, l_on = True, right is not None, left is not None
  if not st.has_seg and not st.has_sched:
    pad = st.kv_len % st.block_k != 0
    if edge == "right":
      l_on = False
    elif edge == "left" and r_on and l_on and left + right >= st.block_q + st.block_k:
      r_on = False
  return pad, r_on, l_on


def _tile_visible(rows, cols, row0, t, st: KernelConfig, q_seg=None, kv_seg=None, edge=None):
  """Element mask bool [bq, bk] (None: nothing to mask) of kv tile ``t`` for the rows from ``row0``
  (rows/cols: [bq, bk] iotas): padded keys, the bounds ``_edge_bounds`` keeps for ``edge`` and,
  with q_seg [bq] / kv_seg [bk], keys of another segment or of segment 0."""
  pad, r_on, l_on = _edge_bounds(st, edge)
  left, right = _bounds(st)
  visible = None
  both = lambda a, b: b if a is None else jnp.logical_and(a, b)
  if pad or r_on or l_on:
    k_pos = cols + t * st.block_k                             # [bq, bk]
  if pad:
    visible = k_pos < st.kv_len
  if r_on or l_on:
    q_pos = rows + (row0 + st.offset)
    if r_on:
      visible = both(visible, k_pos <= q_pos + right)
    if l_on:
      visible = both(visible, k_pos >= q_pos - left)
  if q_seg is not None:
    qs = lax.broadcast_in_dim(q_seg, rows.shape, [0])
    ks = lax.broadcast_in_dim(kv_seg, rows.shape, [1])
    visible = both(visible, jnp.logical_and(qs == ks, ks != 0))
  return visible


def _apply_mask(s, visible):
  """s where ``visible`` (from ``_tile_visible``), -inf elsewhere; s unchanged for None."""
  return s if visible is None else jnp.where(visible, s, -jnp.inf)


def _cap_logits(s, st: KernelConfig):
  """cap * tanh(scale * s / cap) of raw logits s = q.k; without a cap, s (scaled by the softmax)."""
  if st.soft_cap is None:
    return s
  return jnp.tanh(s * (st.scale / st.soft_cap)) * st.soft_cap


def _online_softmax(s, m, l, st: KernelConfig):
  """``softmax.online_softmax_step(s, m, l, factor=c)`` of s [bq, bk] fp32 (masked -inf), no empty
  guard (m starts finite); c = log2(e), times the scale unless ``_cap_logits`` applied it."""
  c = LOG2E if st.soft_cap is not None else st.scale * LOG2E
  m_new = jnp.maximum(m, s.max(axis=1) * c)                   # [bq]
  alpha = jnp.exp2(m - m_new)                                 # [bq]
  p = jnp.exp2(s * c - lax.broadcast_in_dim(m_new, s.shape, [0]))   # [bq, bk]
  return p, alpha, m_new, l * alpha + p.sum(axis=1)


def _program_ranges(b, tile, wg, bounds_ref, st: KernelConfig):
  """(plo, phi) of the program and, for compute warpgroup ``wg`` (None: the memory warpgroup,
  program range only), its (lo, flo, fhi, hi) clipped into it: from ``_static_ranges`` or, with
  segment ids, read from the ``seg_bounds`` row of (batch, program) in GMEM."""
  bq = st.block_q
  if st.has_seg:
    plo, phi = bounds_ref[b, tile, 0], bounds_ref[b, tile, 1]
    if wg is None:
      return plo, phi, None
    base = 2 + 4 * wg
    return plo, phi, tuple(bounds_ref[b, tile, base + j] for j in range(4))
  row0_program = tile * (COMPUTE_WGS * bq)
  plo, _, _, phi = _static_ranges(row0_program, COMPUTE_WGS * bq, st)
  if st.tail_batch >= 0:   # tail_kv_splits: the last program of that row walks nothing
    skip = jnp.logical_and(b == st.tail_batch, tile == st.num_q_programs - 1)
    phi = jnp.where(skip, plo, phi)
  if wg is None:
    return plo, phi, None
  return plo, phi, _clip_to_program(plo, phi, *_static_ranges(row0_program + wg * bq, bq, st))


_SEG_BOUNDS_ONE = 2 + 4 * COMPUTE_WGS   # column of warpgroup 0's one-segment flag


def _turn_skips(wg, k, n, first_tile, last_tile):
  """(skip the wait, skip the hand-over) of warpgroup ``wg``'s turn ``k`` of ``n + 1`` in a query
  tile (overlap protocol): warpgroup 0 skips only the program's first wait (on its
  ``first_tile``), warpgroup 1 only its last hand-over (on its ``last_tile``)."""
  wg, k, n = (jnp.asarray(x, jnp.int32) for x in (wg, k, n))
  skip_wait = jnp.logical_and(jnp.logical_and(first_tile, k == 0), wg == 0)
  skip_hand = jnp.logical_and(jnp.logical_and(last_tile, k == n), wg == 1)
  return skip_wait, skip_hand


def _program_tiles(g, st: KernelConfig):
  """q_tiles_per_program = P > 1: program ``g``'s query tiles as (count, i -> the i-th tile):
  g * P + i for i < count = min(P, tiles - g * P); causal counts from the last tile."""
  n_q = st.num_q_programs
  first = jnp.asarray(g, jnp.int32) * st.q_tiles_per_program
  count = jnp.minimum(jnp.int32(st.q_tiles_per_program), n_q - first)
  if st.causal:
    return count, lambda i: (n_q - 1) - (first + i)
  return count, lambda i: first + i


def _fwd_kernel(*refs, st: KernelConfig):
  """Refs: q [B, Sq, Hq, D], k/v [B, Sk, Hk, D] (GMEM), with segment ids q_seg [B, Sq], kv_seg
  [B, Sk] int32, then bounds [B, programs, 10 or 12] (``seg_bounds``) or, with a block schedule,
  the walk [B', Hs, programs, 1 + W] (``schedule_walk``) -> o [B, Sq, Hq, D], lse [B, Hq, Sq]
  (natural log). Scratch: smem (qo [2, bq, D], k/v [S, bk, D], lse [2, bq], with segment ids
  q_seg [2, bq], kv_seg [S, bk]); barriers q_loaded [2], k/v_loaded [S] (q/k_loaded also count
  the segment-id copies), k/v_free [S] (2 arrivals), rendezvous. With q_tiles_per_program > 1
  qo, lse and q_loaded have 4 entries (2 * set + warpgroup): see ``_compute_tiles``."""
  pre = 2 if st.prefix_tiles else 0   # k/v prefix refs after v (``KernelConfig.prefix_tiles``)
  n_in = 3 + pre + (2 if st.has_seg else 0) + (1 if st.has_seg or st.has_sched else 0)
  ins = refs[:n_in]
  o_ref, lse_ref, smem, q_loaded, k_loaded, v_loaded, k_free, v_free, rendezvous = refs[n_in:]
  q_ref, k_ref, v_ref = ins[:3]
  kp_ref, vp_ref = ins[3:3 + pre] or (None, None)
  ins = ins[:3] + ins[3 + pre:]
  q_seg_ref = kv_seg_ref = bounds_ref = walk_ref = q_seg_smem = kv_seg_smem = None
  qo_smem, k_smem, v_smem, lse_smem = smem[:4]
  if st.has_seg:
    q_seg_ref, kv_seg_ref = ins[3:5]
    q_seg_smem, kv_seg_smem = smem[4:]
  if st.has_sched:
    walk_ref = ins[-1]
  elif st.has_seg:
    bounds_ref = ins[-1]
  bq, bk, stages = st.block_q, st.block_k, st.num_stages
  multi = st.q_tiles_per_program > 1   # several query tiles per program (range path only)
  b = lax.axis_index("batch")
  h = lax.axis_index("heads")
  tile = lax.axis_index("q_tiles")
  if multi:
    n_sub, tile_of = _program_tiles(tile, st)
  elif st.causal:
    tile = (st.num_q_programs - 1) - tile   # longest kv ranges first: a shorter tail
  wg = lax.axis_index("wg")
  kv_h = lax.div(h, jnp.int32(st.group))
  if not multi:
    row0_program = tile * (COMPUTE_WGS * bq)
  slot_of = lambda t: lax.rem(t, jnp.int32(stages))
  if st.has_sched:   # this program's row of the walk: [count, entries...] (``schedule_walk``)
    walk_b = b if st.sched_batch else 0
    walk_h = kv_h if st.sched_heads else 0
    walk_count = lambda: walk_ref[walk_b, walk_h, tile, 0]
    walk_entry = lambda j: walk_ref[walk_b, walk_h, tile, 1 + j]

    def walk_at(j, shift):   # entry j: (kv tile, this warpgroup's 2-bit code, ring slot)
      entry = walk_entry(j)
      t = walk.entry_tile(entry)
      return t, lax.bitwise_and(lax.shift_right_logical(entry, shift), jnp.int32(3)), slot_of(j)

  def meet():
    plgpu.barrier_arrive(rendezvous)
    plgpu.barrier_wait(rendezvous)

  # handoff: rendezvous is one barrier per compute warpgroup (1 arrival each)
  handoff = st.proto.handoff
  hand_over = lambda: plgpu.barrier_arrive(rendezvous.at[1 - wg])   # the other may run P V
  take_turn = lambda: plgpu.barrier_wait(rendezvous.at[wg])         # the other issued Q K^T

  def _compute_tiles():
    # q_tiles_per_program > 1: the program's query tiles one after the other, tile i in Q/O
    # buffer, LSE row and q_loaded barrier 2 * (i mod 2) + wg; the ring position
    # (``ring_base``) and the overlap protocol's turns (``_turn_skips``) run on across tiles.
    row0_of = lambda i: tile_of(i) * (COMPUTE_WGS * bq) + wg * bq
    buf_of = lambda i: lax.rem(i, jnp.int32(2)) * COMPUTE_WGS + wg

    def load_q(i):
      buf = buf_of(i)
      plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0_of(i), bq), h], qo_smem.at[buf],
                              q_loaded.at[buf])

    load_q(jnp.int32(0))                                      # every program has tile 0

    def sub_tile(i, ring_base):
      def prefetch_next_q():   # after tile i's Q wait: tile i + 1's Q into the other buffer
        @pl.when(i + 1 < n_sub)
        def _():
          # that buffer (and LSE row) last held tile i - 1's O: wait until its TMA stores
          # have read shared memory
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          load_q(i + 1)
      buf = buf_of(i)
      n = _compute_tile(tile_of(i), row0_of(i), qo_smem.at[buf], q_loaded.at[buf],
                        lse_smem.at[buf], ring_base=ring_base, after_q_wait=prefetch_next_q,
                        tile_pos=(i == 0, i == n_sub - 1))
      return ring_base + n

    lax.fori_loop(jnp.int32(0), n_sub, sub_tile, jnp.int32(0))
    plgpu.wait_smem_to_gmem(0)

  def _compute_tile(tile, row0, q_smem, q_barrier, lse_dst, ring_base=None, after_q_wait=None,
                    tile_pos=None):
    """One query tile of this warpgroup (Q requested on ``q_barrier``): the kv walk and the
    epilogue (O into ``q_smem``, LSE into ``lse_dst``, TMA stores issued, not waited for).
    ``ring_base`` (q_tiles_per_program > 1): ring entries of the program's earlier tiles (entry
    t - plo in slot (ring_base + t - plo) mod stages); then returns this tile's entry count."""
    ring_slot = slot_of if ring_base is None else (
        lambda t: lax.rem(ring_base + (t - plo), jnp.int32(stages)))
    if not st.has_sched:
      plo, phi, (lo, flo, fhi, hi) = _program_ranges(b, tile, wg, bounds_ref, st)
    # one_segment_static_mask: a warpgroup walking one segment (``seg_bounds``' flag) masks
    # with the static mask only
    one_seg = None
    if st.has_seg and not st.has_sched and st.one_seg_mask:
      one_seg = bounds_ref[b, tile, _SEG_BOUNDS_ONE + wg] != 0

    def masked_loop(lo_, hi_, body_of, carry, edge=None):
      # tiles [lo_, hi_), masked: with the static mask only where one_seg, else segments too
      if one_seg is None:
        return lax.fori_loop(lo_, hi_, body_of(_Mask(True, edge)), carry)
      mid = jnp.where(one_seg, hi_, lo_)
      carry = lax.fori_loop(lo_, mid, body_of(_Mask(False, edge)), carry)
      return lax.fori_loop(mid, hi_, body_of(_Mask(True, edge)), carry)
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    m = plgpu.layout_cast(jnp.full((bq,), _M_INIT, jnp.float32), row_layout)   # base-2 max
    l = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), row_layout)       # running sum
    acc = plgpu.layout_cast(jnp.full((bq, st.head_dim), 0.0, jnp.float32), wgmma_layout)
    plgpu.barrier_wait(q_barrier)
    if after_q_wait is not None:
      after_q_wait()
    q_seg = None
    if st.has_seg:
      q_seg = compat.mosaic_gpu_load(q_seg_smem.at[wg], layout=row_layout)            # [bq] int32
    if not st.proto.overlap:   # (overlap: the turns of ``overlap_walk``)
      pl.when(wg == 1)(take_turn if handoff else meet)
    if st.proto.k_wait:   # the first entry's K; each step or drain then waits for the next one
      if st.has_sched:
        n_walk = walk_count()
        pl.when(n_walk > 0)(lambda: plgpu.barrier_wait(k_loaded.at[0]))
      else:
        pl.when(plo < phi)(lambda: plgpu.barrier_wait(k_loaded.at[ring_slot(plo)]))

    def next_k(t):   # k_wait: (slot, whether there is one) of the ring entry after t's
      return (ring_slot(t + 1), t + 1 < phi) if st.proto.k_wait else None

    def wait_next_k(nxt):   # k_wait (else nxt is None): the K of ``next_k``'s entry
      if nxt is not None:
        pl.when(nxt[1])(lambda: plgpu.barrier_wait(k_loaded.at[nxt[0]]))

    def release(slot, wait_k=True):   # an entry this warpgroup does not need
      if wait_k:
        plgpu.barrier_wait(k_loaded.at[slot])
      plgpu.barrier_wait(v_loaded.at[slot])
      plgpu.barrier_arrive(k_free.at[slot])
      plgpu.barrier_arrive(v_free.at[slot])

    def tile_kv_seg(slot, masked):   # the tile's kv segment ids, read before k_free
      if masked and masked.seg and st.has_seg:
        return compat.mosaic_gpu_load(kv_seg_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
      return None

    def qk_gemm(slot, after):   # Q K^T [bq, bk] fp32; after() runs once it is issued
      def gemm(s_ref):
        plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
        after()
        return s_ref[...]
      return pl.run_scoped(gemm, plgpu.ACC((bq, bk), jnp.float32))

    def pv_gemm(acc, p, slot, after):   # acc + P V [bq, D] fp32, once the wgmma is done
      def gemm(acc_ref):
        plgpu.wgmma(acc_ref, p, v_smem.at[slot])
        after()
      return pl.run_state(gemm)(plgpu.ACC.init(acc))

    def softmax(s, t, m, l, masked, kv_seg=None):   # cap, mask, online softmax (p in fp32)
      s = _cap_logits(s, st)
      if masked:
        rows = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 0, layout=wgmma_layout)
        cols = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=wgmma_layout)
        s = _apply_mask(s, _tile_visible(rows, cols, row0, t, st, q_seg if masked.seg else None,
                                         kv_seg, edge=masked.edge))
      return _online_softmax(s, m, l, st)

    def step_at(slot, t, carry, *, masked, nxt=None):
      # kv tile t, in ring slot ``slot`` (t mod stages for ranges, the list position for walks);
      # nxt: (slot, has) of the next entry, whose K this step waits for (k_wait)
      acc, m, l = carry
      if not st.proto.k_wait:
        plgpu.barrier_wait(k_loaded.at[slot])
      kv_seg = tile_kv_seg(slot, masked)
      s = qk_gemm(slot, hand_over if handoff else meet)
      plgpu.barrier_arrive(k_free.at[slot])
      p, alpha, m_new, l = softmax(s, t, m, l, masked, kv_seg)
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      p = p.astype(st.dtype)
      if st.proto.fence:   # all of the softmax before the other warpgroup's wgmma window
        acc, m_new, l, p = lax.optimization_barrier((acc, m_new, l, p))
      if not handoff:
        plgpu.barrier_arrive(rendezvous)   # softmax done; the other warpgroup may issue wgmma
      plgpu.barrier_wait(v_loaded.at[slot])
      if handoff:
        take_turn()
      else:
        plgpu.barrier_wait(rendezvous)
      acc = pv_gemm(acc, p, slot, lambda: wait_next_k(nxt))   # k_wait: while the wgmma runs
      plgpu.barrier_arrive(v_free.at[slot])
      return acc, m_new, l

    def step(t, carry, *, masked):
      return step_at(ring_slot(t), t, carry, masked=masked, nxt=next_k(t))

    def drain_at(slot, nxt=None):
      # Tiles the other warpgroup needs and this one does not: keep the ring and the rendezvous
      # count in step. Waiting for the load first means this warpgroup can never arrive on a
      # slot's "free" barrier for a later use of the slot (k_wait: K waited for already).
      release(slot, wait_k=not st.proto.k_wait)
      if handoff:
        hand_over()
        take_turn()
      else:
        meet()
        meet()
      # k_wait, after the meetings: the next K may need the other warpgroup's release of this
      # entry's predecessor, which its P V gives only once this warpgroup has met it
      wait_next_k(nxt)

    def drain(t, _):
      drain_at(ring_slot(t), next_k(t))

    def overlap_walk(carry):
      # The overlap protocol: each compute warpgroup runs n + 1 turns for the program's n ring
      # entries: per entry a drain (a tile it does not need) or a tile (Q K^T of the tile, then
      # P V of its previous tile, if any), and a last turn for the last P V. A turn waits for
      # its loads and its own barrier (not warpgroup 0's turn 0), issues, and arrives on the
      # other's (not warpgroup 1's turn n), so the hand-overs pair up for any ranges; a tile's
      # P V runs during the next tile's softmax. (Slots and turns are thunks, evaluated late.)
      acc, m, l = carry
      n = walk_count() if st.has_sched else phi - plo
      if not st.has_sched:
        has = lo < hi
      turn_skips = lambda k: _turn_skips(wg, k, n, *(tile_pos or (True, True)))

      def begin(k):
        pl.when(jnp.logical_not(turn_skips(k)[0]))(take_turn)

      def end(k):
        pl.when(jnp.logical_not(turn_skips(k)[1]))(hand_over)

      def empty_turn(k):
        begin(k)
        end(k)

      def drain_turn(slot_of_turn, k):
        release(slot_of_turn())
        empty_turn(k)

      def qk_turn(slot_of_turn, t, k, carry, masked, rescale=False):   # Q K^T only
        # (the first tile; on a walk also a tile after a skip that flushed the pending P V,
        # where acc is not zero and must follow the new max: ``rescale``)
        acc, m, l, _ = carry
        slot = slot_of_turn()
        plgpu.barrier_wait(k_loaded.at[slot])
        kv_seg = tile_kv_seg(slot, masked)
        begin(k())
        s = qk_gemm(slot, lambda: end(k()))
        plgpu.barrier_arrive(k_free.at[slot])
        p, alpha, m, l = softmax(s, t, m, l, masked, kv_seg)
        if rescale:
          acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        return acc, m, l, p.astype(st.dtype)

      def pair_turn(slots_of_turn, t, k, carry, masked):   # Q K^T(t), then the pending P V
        acc, m, l, p = carry
        k_slot, v_slot = slots_of_turn()
        plgpu.barrier_wait(k_loaded.at[k_slot])
        plgpu.barrier_wait(v_loaded.at[v_slot])
        kv_seg = tile_kv_seg(k_slot, masked)
        begin(k())

        def body(refs):
          acc_ref, s_ref, m_ref, l_ref, p32_ref, a_ref = refs
          plgpu.wgmma(s_ref, q_smem, k_smem.at[k_slot].transpose((1, 0)))
          plgpu.wgmma(acc_ref, p, v_smem.at[v_slot])   # the pending P stays untouched until done
          end(k())
          s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)    # Q K^T done, P V may still run
          plgpu.barrier_arrive(k_free.at[k_slot])
          p32, alpha, m_new, l_new = softmax(s, t, m_ref[...], l_ref[...], masked, kv_seg)
          m_ref[...] = m_new
          l_ref[...] = l_new
          p32_ref[...] = p32
          a_ref[...] = alpha
        s0 = plgpu.layout_cast(jnp.full((bq, bk), 0.0, jnp.float32), wgmma_layout)
        acc, _, m, l, p32, alpha = pl.run_state(body)(
            (plgpu.ACC.init(acc), plgpu.ACC.init(s0), m, l, s0, m))   # returns after P V
        plgpu.barrier_arrive(v_free.at[v_slot])
        # the new P in 16 bits only now: written while the P V was in flight, the loop-carried
        # P registers (that wgmma's operand) would make ptxas serialize every wgmma (C7513)
        p = lax.optimization_barrier(p32).astype(st.dtype)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        return acc, m, l, p

      def pv_turn(slot_of_turn, k, carry, drain_slot=None):   # the pending P V only
        acc, m, l, p = carry
        slot = slot_of_turn()
        plgpu.barrier_wait(v_loaded.at[slot])
        if drain_slot is not None:
          release(drain_slot)
        begin(k())
        acc = pv_gemm(acc, p, slot, lambda: end(k()))
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m, l, p

      zero_p = lambda: plgpu.layout_cast(jnp.full((bq, bk), 0.0, st.dtype), wgmma_layout)
      if st.has_sched:
        # the program's list; carry: (acc, m, l, p, whether a P V is pending, its ring slot)
        shift = 2 * wg                                 # this warpgroup's code: entry >> shift

        def walk_turn(j, c):
          state, pending, prev = c[:4], c[4], c[5]
          t, code, slot = walk_at(j, shift)
          no, yes = jnp.int32(0), jnp.int32(1)
          turn = lambda: j

          def skip(state):
            return lax.cond(
                pending == 1,
                lambda st_: (*pv_turn(lambda: prev, turn, st_, drain_slot=slot), no, prev),
                lambda st_: (drain_turn(lambda: slot, j), (*st_, no, prev))[1], state)

          def run(masked):
            return lambda state: lax.cond(
                pending == 1,
                lambda st_: (*pair_turn(lambda: (slot, prev), t, turn, st_, masked), yes, slot),
                lambda st_: (*qk_turn(lambda: slot, t, turn, st_, masked, rescale=True),
                             yes, slot), state)
          return lax.cond(code == walk.SKIP, skip, lambda st_: lax.cond(
              code == walk.FULL, run(False), run(_Mask(True, None)), st_), state)

        c = lax.fori_loop(jnp.int32(0), n, walk_turn, (acc, m, l, zero_p(), jnp.int32(0),
                                                       jnp.int32(0)))
        state, pending, prev = c[:4], c[4], c[5]
        acc, m, l, _ = lax.cond(pending == 1, lambda st_: pv_turn(lambda: prev, lambda: n, st_),
                                lambda st_: (empty_turn(n), st_)[1], state)
        return acc, m, l

      # Range path: the drains of [plo, lo), a Q K^T-only turn for lo, a pair turn per tile in
      # (lo, hi), a P V-only turn, the drains of [hi, phi), and an empty turn when the
      # warpgroup has no tile (lo == hi).
      lax.fori_loop(plo, lo, lambda e, c: drain_turn(lambda: ring_slot(e), e - plo), None)
      carry = (acc, m, l, zero_p())
      one = has.astype(jnp.int32)
      carry = masked_loop(lo, lo + one, lambda masked: lambda e, c: qk_turn(
          lambda: ring_slot(e), e, lambda: e - plo, c, masked), carry)   # edge or not: exact mask
      a = lo + 1
      b1 = jnp.maximum(flo, a)
      b2 = jnp.maximum(fhi, a)

      def pair(masked):
        return lambda e, c: pair_turn(lambda: (ring_slot(e), ring_slot(e - 1)), e,
                                      lambda: e - plo, c, masked)
      carry = masked_loop(a, b1, pair, carry, edge="left")
      carry = lax.fori_loop(b1, b2, pair(False), carry)
      carry = masked_loop(b2, hi, pair, carry, edge="right")
      carry = lax.fori_loop(hi, hi + one, lambda e, c: pv_turn(
          lambda: ring_slot(e - 1), lambda: e - plo, c), carry)
      lax.fori_loop(hi, phi, lambda e, c: drain_turn(lambda: ring_slot(e), e - plo + one), None)
      pl.when(jnp.logical_not(has))(lambda: empty_turn(n))   # the empty turn n
      acc, m, l, _ = carry
      return acc, m, l

    carry = (acc, m, l)
    if st.proto.overlap:
      carry = overlap_walk(carry)
    elif st.has_sched:
      # the program's list: this warpgroup's code of entry j picks drain, unmasked or masked step
      shift = 2 * wg

      def walk_step(j, carry):
        t, code, slot = walk_at(j, shift)
        nxt = (slot_of(j + 1), j + 1 < n_walk) if st.proto.k_wait else None

        def skip(carry):
          drain_at(slot, nxt)
          return carry

        def run(carry):
          return lax.cond(code == walk.FULL,
                          functools.partial(step_at, slot, t, masked=False, nxt=nxt),
                          functools.partial(step_at, slot, t, masked=_Mask(True, None), nxt=nxt),
                          carry)
        return lax.cond(code == walk.SKIP, skip, run, carry)
      carry = lax.fori_loop(jnp.int32(0), walk_count(), walk_step, carry)
    else:
      lax.fori_loop(plo, lo, drain, None)
      step_of = lambda masked: functools.partial(step, masked=masked)
      carry = masked_loop(lo, flo, step_of, carry, edge="left")
      carry = lax.fori_loop(flo, fhi, step_of(False), carry)
      carry = masked_loop(fhi, hi, step_of, carry, edge="right")
      lax.fori_loop(hi, phi, drain, None)
    if not st.proto.overlap:
      pl.when(wg == 0)(hand_over if handoff else meet)
    acc, m, l = carry

    out, lse = _finalize(acc, m, l)
    q_smem[...] = out.astype(st.dtype)                        # Q is dead: reuse its tile for O
    lse_dst[...] = lse
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, o_ref.at[b, pl.ds(row0, bq), h])
    plgpu.copy_smem_to_gmem(lse_dst, lse_ref.at[b, h, pl.ds(row0, bq)])
    return None if ring_base is None else phi - plo

  @pl.when(wg < COMPUTE_WGS)
  def _compute():
    plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")
    if multi:
      _compute_tiles()
      return
    row0 = row0_program + wg * bq
    q_smem = qo_smem.at[wg]                                   # [bq, D]
    plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, bq), h], q_smem, q_loaded.at[wg])
    if st.has_seg:
      plgpu.copy_gmem_to_smem(q_seg_ref.at[b, pl.ds(row0, bq)], q_seg_smem.at[wg], q_loaded.at[wg])
    _compute_tile(tile, row0, q_smem, q_loaded.at[wg], lse_smem.at[wg])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == COMPUTE_WGS)
  def _memory():
    plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")

    def load_from(k_src, v_src, t, slot, part):
      rows = (b, pl.ds(t * bk, bk), kv_h)
      if "k" in part:
        plgpu.copy_gmem_to_smem(k_src.at[rows], k_smem.at[slot], k_loaded.at[slot])
        if st.has_seg:
          plgpu.copy_gmem_to_smem(kv_seg_ref.at[b, pl.ds(t * bk, bk)], kv_seg_smem.at[slot],
                                  k_loaded.at[slot])
      if "v" in part:
        plgpu.copy_gmem_to_smem(v_src.at[rows], v_smem.at[slot], v_loaded.at[slot])

    def load(t, slot, part="kv"):   # tiles [0, prefix_tiles) from the prefix refs
      if not st.prefix_tiles:
        return load_from(k_ref, v_ref, t, slot, part)
      n = jnp.int32(st.prefix_tiles)
      pl.when(t < n)(lambda: load_from(kp_ref, vp_ref, t, slot, part))
      pl.when(t >= n)(lambda: load_from(k_ref, v_ref, t - n, slot, part))

    def refill(tile_fn, slot):
      # a later use of a ring slot: wait for its release by both compute warpgroups, then load
      # kv tile tile_fn() (early_k: K as soon as its Q K^T is done, V after the P V)
      plgpu.barrier_wait(k_free.at[slot])
      if st.proto.early_k:
        t = tile_fn()
        load(t, slot, "k")
        plgpu.barrier_wait(v_free.at[slot])
        load(t, slot, "v")
      else:
        plgpu.barrier_wait(v_free.at[slot])
        load(tile_fn(), slot)

    if st.has_sched:   # the walk's entries in order, entry j into slot j mod S
      n = walk_count()
      tile_at = lambda j: walk.entry_tile(walk_entry(j))
      for i in range(stages):                                 # fill the ring
        pl.when(i < n)(lambda: load(tile_at(i), i))
      pl.loop(jnp.int32(stages), jnp.maximum(n, stages))(
          lambda j: refill(lambda: tile_at(j), slot_of(j)))
      return

    if multi:
      # The program's query tiles' kv ranges one after the other in one ring: entry c (counted
      # across tiles) in slot c mod stages, the first ``stages`` loaded at once, each later one
      # once both compute warpgroups released entry c - stages (maybe of the previous tile).
      def sub_tile(i, ring_base):
        plo, phi, _ = _program_ranges(b, tile_of(i), None, bounds_ref, st)

        @pl.loop(jnp.int32(0), phi - plo)
        def _(j):
          c = ring_base + j
          slot = slot_of(c)
          pl.when(c < stages)(lambda: load(plo + j, slot))
          pl.when(c >= stages)(lambda: refill(lambda: plo + j, slot))
        return ring_base + (phi - plo)

      lax.fori_loop(jnp.int32(0), n_sub, sub_tile, jnp.int32(0))
      return

    plo, phi, _ = _program_ranges(b, tile, None, bounds_ref, st)
    for i in range(stages):                                   # fill the ring
      pl.when(plo + i < phi)(lambda: load(plo + i, slot_of(plo + i)))
    pl.loop(plo + stages, jnp.maximum(phi, plo + stages))(lambda t: refill(lambda: t, slot_of(t)))


def fwd_call(q, k, v, st: KernelConfig, q_seg=None, kv_seg=None, bounds=None, walk_rows=None,
             kv_prefix=()):
  """Padded q, k, v (segment ids 0-padded with ``seg_bounds``' bounds, or ``schedule_walk``'s
  walk_rows; ``kv_prefix``: (k, v) of ``st.prefix_tiles`` whole tiles that precede k, v) ->
  (o [B, Sq', Hq, D], lse [B, Hq, Sq']); the CPU tests replay it in jnp."""
  if st.interpret:
    raise NotImplementedError("the Mosaic GPU flash attention forward cannot run in interpret "
                              "mode (interpret=True): jax's GPU interpreter has no wgmma with "
                              "transposed or register operands")
  b, sq_pad, hq, d = q.shape
  bq, bk, stages = st.block_q, st.block_k, st.num_stages
  tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))   # 64 x 16-bit = 128 bytes
  # q_tiles_per_program > 1: two sets of Q/O tiles and LSE rows (index 2 * set + warpgroup)
  n_q_bufs = COMPUTE_WGS * (2 if st.q_tiles_per_program > 1 else 1)
  smem = (
      plgpu.SMEM((n_q_bufs, bq, d), q.dtype, transforms=tiled),         # Q, then O
      plgpu.SMEM((stages, bk, d), k.dtype, transforms=tiled),           # K ring
      plgpu.SMEM((stages, bk, d), v.dtype, transforms=tiled),           # V ring
      plgpu.SMEM((n_q_bufs, bq), jnp.float32),                          # LSE staging
  )
  seg_copies = 1
  args = (q, k, v, *kv_prefix)
  if st.has_seg:
    smem += (plgpu.SMEM((COMPUTE_WGS, bq), jnp.int32),                # q segment ids
             plgpu.SMEM((stages, bk), jnp.int32))                      # kv segment ids ring
    seg_copies = 2       # Q + its ids on q_loaded, K + its ids on k_loaded
    args += (q_seg, kv_seg)
  if st.has_sched or st.has_seg:
    args += (walk_rows if st.has_sched else bounds,)
  call = plgpu.kernel(
      functools.partial(_fwd_kernel, st=st),
      out_type=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct((b, hq, sq_pad), jnp.float32)),
      scratch_types=(
          smem,
          plgpu.Barrier(num_arrivals=seg_copies, num_barriers=n_q_bufs),      # q_loaded
          plgpu.Barrier(num_arrivals=seg_copies, num_barriers=stages),        # k_loaded
          plgpu.Barrier(num_barriers=stages),                              # v_loaded
          plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),   # k_free
          plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),   # v_free
          (plgpu.Barrier(num_barriers=COMPUTE_WGS)                        # rendezvous
           if st.proto.handoff else plgpu.Barrier(num_arrivals=COMPUTE_WGS)),
      ),
      # heads on CUDA's x, launched fastest; "q_tiles" counts programs (of P query tiles)
      grid=(hq, st.num_programs, b), grid_names=("heads", "q_tiles", "batch"),
      num_threads=COMPUTE_WGS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )
  return call(*args)

