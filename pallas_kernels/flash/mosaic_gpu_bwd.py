"""Flash attention backward for Hopper (sm90), Pallas Mosaic GPU (docs/flash.md, "The Hopper
kernels"): a dK/dV kernel (a program per 2 * block_k_dkv keys, streaming Q/dO over the GQA group)
and a dQ kernel (a program per 2 * block_q_dq rows, streaming K/V), each with two compute
warpgroups and a TMA memory warpgroup; head_dim 64 and 128.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import compat, tuning
from pallas_kernels.block_schedule import check_schedule_args
from pallas_kernels.common import walk
from pallas_kernels.common.softmax import LOG2E, delta_rows, lse_base2
from pallas_kernels.common.util import check_qkv_shapes, check_segment_ids, pad_axis
from pallas_kernels.masks import normalize_window

# The documented API; the checks serve the forward's wrapper.
__all__ = ["BlockSizes", "default_block_sizes", "call_block_sizes", "fit_block_sizes",
           "flash_attention_bwd"]


_COMPUTE_WGS = walk.WARPGROUPS
# setmaxnreg: 2 * 232 + 40 = 3 x 168, the CTA's launch allocation.
_COMPUTE_REGISTERS = 232
_MEMORY_REGISTERS = 40
HEAD_DIMS = (64, 128)
_TILES = ("block_q_dkv", "block_k_dkv", "block_q_dq", "block_k_dq")   # [:7]: the schedule's tile


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles and pipeline depths of the two backward kernels.

  Attributes:
    block_q_dkv, block_k_dkv: the dK/dV kernel's query rows per ring step and keys per compute
      warpgroup (multiples of 64, wgmma's M); a program covers ``2 * block_k_dkv`` keys.
    block_q_dq, block_k_dq: the dQ kernel's query rows per compute warpgroup and keys per ring
      step (multiples of 64); a program covers ``2 * block_q_dq`` rows.
    num_stages_dkv, num_stages_dq: slots (>= 2) of the dK/dV kernel's Q/dO/lse/delta TMA ring
      and of the dQ kernel's K/V ring.

  Example:
    >>> BlockSizes().keys_per_dkv_program
    128
  """
  block_q_dkv: int = 64
  block_k_dkv: int = 64
  block_q_dq: int = 64
  block_k_dq: int = 64
  num_stages_dkv: int = 2
  num_stages_dq: int = 2

  def __post_init__(self):
    for name in _TILES:
      val = getattr(self, name)
      if val <= 0 or val % 64:
        raise ValueError(f"{name} must be a positive multiple of 64, got {val}")
    for name in ("num_stages_dkv", "num_stages_dq"):
      if getattr(self, name) < 2:
        raise ValueError(f"{name} must be >= 2, got {getattr(self, name)}")

  @property
  def keys_per_dkv_program(self) -> int:
    return _COMPUTE_WGS * self.block_k_dkv

  @property
  def rows_per_dq_program(self) -> int:
    return _COMPUTE_WGS * self.block_q_dq


@functools.lru_cache(maxsize=None)
def _tuned_block_sizes(head_dim: int, device_kind: str | None, mask: str) -> BlockSizes:
  return BlockSizes(**tuning.required_params("mosaic_gpu_bwd", head_dim, "16bit", device_kind,
                                             mask=mask))


def default_block_sizes(head_dim: int, dtype=jnp.bfloat16, device_kind: str | None = None,
                        mask: str = "all") -> BlockSizes:
  """Default ``BlockSizes`` for head_dim 64/128 and a mask kind, from ``pallas_kernels.tuning``.

  Args:
    head_dim, dtype: the head dimension of q, k and v; the input dtype (only checked).
    device_kind: jax ``device_kind`` whose table to read (default: the first device's).
    mask: a ``pallas_kernels.tuning.mask_kind`` ("block_sparse" for schedules) or "all".

  Returns:
    A ``BlockSizes``.

  Example:
    >>> default_block_sizes(64, device_kind="NVIDIA H200", mask="causal_window").block_k_dq
    64
  """
  check_dtype(dtype)
  check_head_dim(head_dim)
  return _tuned_block_sizes(head_dim, tuning.resolve_kind(device_kind), mask)   # cached


def check_dtype(dtype, what: str = "flash attention backward") -> None:
  """NotImplementedError unless ``dtype`` is bf16 or fp16 (``what``: the kernel, for messages)."""
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise NotImplementedError(f"the Mosaic GPU {what} supports bfloat16 and float16 inputs, got "
                              f"{jnp.dtype(dtype)}")


def check_head_dim(d: int) -> None:
  """NotImplementedError unless this backward supports head_dim ``d`` (64 or 128)."""
  if d == 256:
    raise NotImplementedError(
        "the Mosaic GPU flash attention backward does not support head_dim 256 (its dK/dV "
        "accumulators need 256 registers a thread, of 255); use the Triton backward")
  if d not in HEAD_DIMS:
    raise NotImplementedError(f"the Mosaic GPU flash attention backward supports head_dim 64 or "
                              f"128, got head_dim {d}")


def check_call_args(sq, sk, local_window_size, logits_soft_cap):
  """ValueError for an empty sequence or a soft cap <= 0; -> the window (None: unbounded)."""
  if sq < 1 or sk < 1:
    raise ValueError(f"sequence lengths must be >= 1, got q {sq}, kv {sk}")
  if logits_soft_cap is not None and not float(logits_soft_cap) > 0:
    raise ValueError(f"logits_soft_cap must be > 0, got {logits_soft_cap}")
  window = normalize_window(local_window_size)
  return None if window == (None, None) else window


@dataclasses.dataclass(frozen=True)
class _Static:
  bs: BlockSizes
  q_len: int            # unpadded
  kv_len: int           # unpadded
  q_pad: int            # padded q_len (a multiple of 2 * block_q_dq and of block_q_dkv)
  kv_pad: int           # padded kv_len (a multiple of 2 * block_k_dkv and of block_k_dq)
  head_dim: int
  group: int            # query heads per kv head
  causal: bool
  scale: float
  dtype: jnp.dtype
  window: tuple | None = None       # normalized (left, right), a side None = unbounded
  soft_cap: float | None = None     # logits = cap * tanh(scale * s / cap)
  has_seg: bool = False             # segment ids: ranges per (batch, program) from ``_seg_bounds``
  has_sched: bool = False           # block schedule: programs walk ``_sched_walks`` lists

  @property
  def offset(self) -> int:   # kv position of query row 0 (bottom-right causal alignment)
    return self.kv_len - self.q_len

  @property
  def lo_reach(self) -> int | None:
    """A query at kv position p sees no key before p - lo_reach (None: unbounded)."""
    return None if self.window is None else self.window[0]

  @property
  def hi_reach(self) -> int | None:
    """A query at kv position p sees no key after p + hi_reach (None: unbounded; causal: <= 0)."""
    right = None if self.window is None else self.window[1]
    if self.causal:
      return 0 if right is None else min(right, 0)
    return right

  @property
  def c(self) -> float:   # logit multiplier of the base-2 domain
    return self.scale * LOG2E

  @property
  def num_dkv_programs(self) -> int:
    return -(-self.kv_len // self.bs.keys_per_dkv_program)

  @property
  def num_q_tiles_dkv(self) -> int:   # query tiles (of block_q_dkv rows) holding a real row
    return -(-self.q_len // self.bs.block_q_dkv)

  @property
  def num_dq_programs(self) -> int:
    return -(-self.q_len // self.bs.rows_per_dq_program)

  @property
  def num_kv_tiles_dq(self) -> int:   # kv tiles (of block_k_dq keys) holding a real key
    return -(-self.kv_len // self.bs.block_k_dq)

  @property
  def num_full_kv_tiles_dq(self) -> int:   # kv tiles without padded keys
    return self.kv_len // self.bs.block_k_dq


def _static_config(q_shape, k_shape, dtype, *, causal, scale, block_sizes, local_window_size=None,
                   logits_soft_cap=None, has_seg=False, schedule=None) -> _Static:
  _, sq, hq, d = q_shape
  _, sk, hk, _ = k_shape
  check_head_dim(d)
  window = check_call_args(sq, sk, local_window_size, logits_soft_cap)
  bs = block_sizes or call_block_sizes(d, dtype, causal=causal, window=window, has_seg=has_seg,
                                       schedule=schedule)
  if schedule is not None:
    check_schedule(schedule, q_shape, k_shape, bs)
  lq = math.lcm(bs.rows_per_dq_program, bs.block_q_dkv)
  lk = math.lcm(bs.keys_per_dkv_program, bs.block_k_dq)
  return _Static(bs=bs, q_len=sq, kv_len=sk, q_pad=-(-sq // lq) * lq, kv_pad=-(-sk // lk) * lk,
                 head_dim=d, group=hq // hk, causal=bool(causal), window=window,
                 scale=float(d ** -0.5 if scale is None else scale), dtype=jnp.dtype(dtype),
                 soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
                 has_seg=bool(has_seg), has_sched=schedule is not None)


def call_block_sizes(head_dim: int, dtype, *, causal: bool, window=None, has_seg: bool = False,
                     schedule=None) -> BlockSizes:
  """A call's default ``BlockSizes``: its mask kind's entry (a schedule: "block_sparse", fitted).

  Args:
    head_dim, dtype: as for ``default_block_sizes``.
    causal, window, has_seg, schedule: the call's mask (window: None or normalized (left,
      right); schedule: None or a ``BlockSchedule``).

  Returns:
    A ``BlockSizes``.

  Example:
    >>> call_block_sizes(128, jnp.bfloat16, causal=True).num_stages_dq
    2
  """
  if schedule is None:
    return default_block_sizes(head_dim, dtype,
                               mask=tuning.mask_kind(causal, window, segments=has_seg))
  return fit_block_sizes(default_block_sizes(head_dim, dtype, mask="block_sparse"), schedule)


def fit_block_sizes(bs: BlockSizes, schedule) -> BlockSizes:
  """``bs`` with each tile cut to the gcd with the schedule's tile along its axis.

  Args:
    bs, schedule: the backward's block sizes and a ``block_schedule.BlockSchedule``.

  Returns:
    A ``BlockSizes``; ValueError (from ``BlockSizes``) when a divisor is not a multiple of 64.

  Example:
    >>> from pallas_kernels.block_schedule import make_schedule
    >>> s = make_schedule(256, 256, 128, 64, causal=True)
    >>> fit_block_sizes(BlockSizes(block_k_dq=128), s).block_k_dq
    64
  """
  return dataclasses.replace(bs, **{n: math.gcd(getattr(bs, n), getattr(schedule, n[:7]))
                                    for n in _TILES})


def check_schedule(schedule, q_shape, k_shape, bs: BlockSizes) -> None:
  """TypeError / ValueError unless both kernels (tiles ``bs``) can walk ``schedule``."""
  check_schedule_args(schedule, q_shape, k_shape)
  bad = [f"{n}={getattr(bs, n)} does not divide the schedule's {n[:7]}={getattr(schedule, n[:7])}"
         for n in ("block_q_dkv", "block_q_dq", "block_k_dkv", "block_k_dq")
         if getattr(schedule, n[:7]) % getattr(bs, n)]
  if bad:
    raise ValueError("the Mosaic GPU backward walks a schedule with tiles inside its tiles: "
                     + "; ".join(bad) + " (fit_block_sizes(bs, schedule) cuts them)")


def _ceil_div_nonneg(n, d: int):
  """ceil(max(n, 0) / d) for int32 scalars (d > 0)."""
  return lax.div(jnp.maximum(n, 0) + (d - 1), jnp.int32(d))


def _floor_div_nonneg(n, d: int):
  """floor(max(n, 0) / d) for int32 scalars (d > 0)."""
  return lax.div(jnp.maximum(n, 0), jnp.int32(d))


def _dq_kv_range(row0, st: _Static):
  """dQ kernel, query rows [row0, row0 + block_q_dq): (start, full_lo, full_hi, steps) int32
  scalars: tiles [full_lo, full_hi) unmasked, the rest of [start, steps) masked, others skipped."""
  bq, bk = st.bs.block_q_dq, st.bs.block_k_dq
  nk, n_full = st.num_kv_tiles_dq, st.num_full_kv_tiles_dq
  p0 = row0 + st.offset                                   # kv positions of the first and last
  p1 = p0 + (bq - 1)                                      # row (padded rows included)
  lo, hi = st.lo_reach, st.hi_reach
  if hi is None:
    steps, full_hi = jnp.int32(nk), jnp.int32(n_full)
  else:
    steps = jnp.minimum(_ceil_div_nonneg(p1 + (hi + 1), bk), nk)
    full_hi = jnp.minimum(_floor_div_nonneg(p0 + (hi + 1), bk), n_full)
  if lo is None:
    start, full_lo = jnp.int32(0), jnp.int32(0)
  else:
    start = _floor_div_nonneg(p0 - lo, bk)
    full_lo = _ceil_div_nonneg(p1 - lo, bk)
  start = jnp.minimum(start, steps)
  full_lo = jnp.clip(full_lo, start, steps)
  return start, full_lo, jnp.clip(full_hi, full_lo, steps), steps


def _dq_visible(rows, cols, row0, t, st: _Static):
  """dQ element mask of kv tile ``t`` for rows from ``row0`` (rows/cols: [bq, bk] iotas)."""
  k_pos = cols + t * st.bs.block_k_dq
  return _within_reach(rows + (row0 + st.offset), k_pos, st, k_pos < st.kv_len)


def _within_reach(q_pos, k_pos, st: _Static, visible=None):
  """``visible`` (None: no condition) and k_pos in [q_pos - lo_reach, q_pos + hi_reach]."""
  if st.hi_reach is not None:
    visible = _both(visible, k_pos <= q_pos + st.hi_reach)
  if st.lo_reach is not None:
    visible = _both(visible, k_pos >= q_pos - st.lo_reach)
  return visible


def _dkv_q_bounds(k0, st: _Static):
  """dK/dV kernel, keys [k0, k0 + block_k_dkv): (first, full_lo, full_hi, last) as
  ``_dq_kv_range`` over query tiles (padded keys and rows need no mask here)."""
  nq = st.num_q_tiles_dkv
  bq, bk = st.bs.block_q_dkv, st.bs.block_k_dkv
  k1 = k0 + (bk - 1)
  lo, hi = st.lo_reach, st.hi_reach
  if hi is None:
    first, full_lo = jnp.int32(0), jnp.int32(0)
  else:                                                   # rows at kv positions >= k - hi
    first = jnp.minimum(_floor_div_nonneg(k0 - (hi + st.offset), bq), nq)
    full_lo = _ceil_div_nonneg(k1 - (hi + st.offset), bq)
  if lo is None:
    last, full_hi = jnp.int32(nq), jnp.int32(nq)
  else:                                                   # rows at kv positions <= k + lo
    last = jnp.minimum(_ceil_div_nonneg(k1 + (lo - st.offset + 1), bq), nq)
    full_hi = _floor_div_nonneg(k0 + (lo - st.offset + 1), bq)
  first = jnp.minimum(first, last)
  full_lo = jnp.clip(full_lo, first, last)
  return first, full_lo, jnp.clip(full_hi, full_lo, last), last


def _dkv_visible(rows, cols, k0, i, st: _Static):
  """dK/dV element mask of query tile ``i`` for keys from ``k0`` on the transposed [bk, bq] tile."""
  visible = _within_reach(cols + (i * st.bs.block_q_dkv + st.offset), rows + k0, st)
  if visible is None:   # no bound: every tile runs unmasked, so kernels never get here
    return jnp.full(jnp.broadcast_shapes(jnp.shape(rows), jnp.shape(cols)), True)
  return visible


def _seg_visible(q_seg, kv_seg, shape, q_axis):
  """q_seg == kv_seg != 0 on a tile of ``shape`` with query axis ``q_axis`` (ids: vectors)."""
  qs = lax.broadcast_in_dim(q_seg, shape, [q_axis])
  ks = lax.broadcast_in_dim(kv_seg, shape, [1 - q_axis])
  return jnp.logical_and(qs == ks, ks != 0)


def _both(a, b):
  """a and b, either of which may be None (no condition)."""
  return b if a is None else a if b is None else jnp.logical_and(a, b)


def _seg_bounds(q_seg, kv_seg, st: _Static):
  """(dq_bounds, dkv_bounds): both kernels' ``walk.segment_bounds`` rows [B, programs, 10] for
  segment ids q_seg [B, Sq'], kv_seg [B, Sk'] (int32, padded with 0, which sees nothing)."""
  bs = st.bs
  n_q = st.num_dq_programs * _COMPUTE_WGS                 # query tiles of block_q_dq rows
  dq_bounds = walk.segment_bounds(
      q_seg, bs.block_q_dq, n_q, kv_seg, bs.block_k_dq, st.num_kv_tiles_dq,
      _dq_kv_range(jnp.arange(n_q, dtype=jnp.int32) * bs.block_q_dq, st))
  n_k = st.num_dkv_programs * _COMPUTE_WGS                # kv tiles of block_k_dkv keys
  dkv_bounds = walk.segment_bounds(
      kv_seg, bs.block_k_dkv, n_k, q_seg, bs.block_q_dkv, st.num_q_tiles_dkv,
      _dkv_q_bounds(jnp.arange(n_k, dtype=jnp.int32) * bs.block_k_dkv, st))
  return dq_bounds, dkv_bounds


def _sched_walks(schedule, st: _Static, q_seg=None, kv_seg=None):
  """(dq_walk, dkv_walk): both kernels' ``walk.list_walk`` rows of a schedule, coded by the mask."""
  bs = st.bs

  def rows(idx, cnt, s_own, s_walk, own_block, walk_block, n_programs, n_walk, ranges, own_seg,
           walk_seg):
    n_own = n_programs * _COMPUTE_WGS
    static = [jnp.broadcast_to(x, (n_own,))
              for x in ranges(jnp.arange(n_own, dtype=jnp.int32) * own_block, st)]
    return walk.list_walk(idx, cnt, s_own, s_walk, own_block, walk_block, n_own, n_walk,
                          lambda t, ok: walk.range_codes(t, ok, static, own_seg, own_block,
                                                         walk_seg, walk_block))

  dq_walk = rows(schedule.kv_indices, schedule.kv_counts, schedule.block_q, schedule.block_k,
                 bs.block_q_dq, bs.block_k_dq, st.num_dq_programs, st.num_kv_tiles_dq,
                 _dq_kv_range, q_seg, kv_seg)
  dkv_walk = rows(schedule.q_indices, schedule.q_counts, schedule.block_k, schedule.block_q,
                  bs.block_k_dkv, bs.block_q_dkv, st.num_dkv_programs, st.num_q_tiles_dkv,
                  _dkv_q_bounds, kv_seg, q_seg)
  return dq_walk, dkv_walk


def _probs(s, lse2, st: _Static, *, axis):
  """P = exp2(s * c - lse2), lse2 broadcast along ``axis`` of s (0: per row, the dQ tile; 1: per
  column, the transposed dK/dV tile); a soft cap makes the logit cap * tanh(scale * s / cap)."""
  x = s * st.c if st.soft_cap is None else (
      jnp.tanh(s * (st.scale / st.soft_cap)) * (st.soft_cap * LOG2E))
  return jnp.exp2(x - lax.broadcast_in_dim(lse2, s.shape, [axis]))


def _cap_grad(s, st: _Static):
  """d(capped logit) / d(scale * s) = 1 - tanh(scale * s / cap)^2 (None: no soft cap)."""
  if st.soft_cap is None:
    return None
  t = jnp.tanh(s * (st.scale / st.soft_cap))
  return 1.0 - t * t


def _dscores(p, dp, delta, *, axis, cap_grad=None):
  """dS = P * (dP - delta), delta broadcast along ``axis`` (as ``_probs``), times ``cap_grad``."""
  ds = p * (dp - lax.broadcast_in_dim(delta, p.shape, [axis]))
  return ds if cap_grad is None else ds * cap_grad


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, st: _Static):
  """Refs: q/do [B, Sq', Hq, D], k/v [B, Sk', Hk, D], lse2/delta [B, Hq, Sq'] fp32 (GMEM), with
  segment ids q_seg [B, Sq'], kv_seg [B, Sk'] int32, then the dK/dV walk of ``_sched_walks`` or
  bounds of ``_seg_bounds`` -> dk/dv [B, Sk', Hk, D]; scratch from ``_dkv_call`` / ``_launch``."""
  q_seg_ref = kv_seg_ref = bounds_ref = walk_ref = None
  if st.has_seg:
    q_seg_ref, kv_seg_ref, *refs = refs
  if st.has_sched:
    walk_ref, *refs = refs
  elif st.has_seg:
    bounds_ref, *refs = refs
  (dk_ref, dv_ref, smem, own_loaded, q_loaded, do_loaded, lse_loaded, delta_loaded, free,
   *seg_loaded) = refs                                    # with segment ids: own ids barriers
  k_own, v_own, q_smem, do_smem, lse_smem, delta_smem = smem[:6]
  kv_seg_own, q_seg_smem = smem[6:] if st.has_seg else (None, None)
  bq, bk, stages = st.bs.block_q_dkv, st.bs.block_k_dkv, st.bs.num_stages_dkv
  b, kv_h, prog, wg = (lax.axis_index(n) for n in ("batch", "heads", "kv_tiles", "wg"))
  k0_program = prog * (_COMPUTE_WGS * bk)
  if st.has_sched:   # this program's list of query tiles, shared by the group's query heads
    walk_row = (b if walk_ref.shape[0] > 1 else 0, kv_h if walk_ref.shape[1] > 1 else 0, prog)
    walk_tile = lambda j: walk.entry_tile(walk_ref[walk_row + (1 + j,)])
    first_program, last_program = jnp.int32(0), walk_ref[walk_row + (0,)]
  elif st.has_seg:
    first_program, last_program = bounds_ref[b, prog, 0], bounds_ref[b, prog, 1]
  else:
    first_program = _dkv_q_bounds(k0_program, st)[0]      # warpgroup 0's keys see the first
    last_program = _dkv_q_bounds(k0_program + (_COMPUTE_WGS - 1) * bk, st)[3]   # 1's the last
  per_head = last_program - first_program                 # ring steps per query head (>= 0)
  total = st.group * per_head
  slot_of = lambda j: lax.rem(j, jnp.int32(stages))
  two_edges = st.lo_reach is not None or st.has_seg       # masked tiles on both sides

  @pl.when(wg < _COMPUTE_WGS)
  def _compute():
    plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")
    k0 = k0_program + wg * bk
    kt, vt = k_own.at[wg], v_own.at[wg]                   # [bk, D]
    plgpu.copy_gmem_to_smem(k_ref.at[b, pl.ds(k0, bk), kv_h], kt, own_loaded.at[2 * wg])
    if st.has_seg:
      plgpu.copy_gmem_to_smem(kv_seg_ref.at[b, pl.ds(k0, bk)], kv_seg_own.at[wg],
                              seg_loaded[0].at[wg])
    plgpu.copy_gmem_to_smem(v_ref.at[b, pl.ds(k0, bk), kv_h], vt, own_loaded.at[2 * wg + 1])
    if st.has_seg and not st.has_sched:
      base_col = 2 + 4 * wg
      first, full_lo, full_hi, last = (bounds_ref[b, prog, base_col + j] for j in range(4))
    elif not st.has_sched:
      first, full_lo, full_hi, last = _dkv_q_bounds(k0, st)
    wgmma_layout = plgpu.Layout.WGMMA
    col_layout = plgpu.Layout.WGMMA.reduce(0)              # one value per query (column)
    row_layout = plgpu.Layout.WGMMA.reduce(1)              # one value per key (row)
    zeros = lambda shape: plgpu.layout_cast(jnp.full(shape, 0.0, jnp.float32), wgmma_layout)
    dk, dv = zeros((bk, st.head_dim)), zeros((bk, st.head_dim))
    plgpu.barrier_wait(own_loaded.at[2 * wg])
    plgpu.barrier_wait(own_loaded.at[2 * wg + 1])
    kv_seg = None
    if st.has_seg:
      plgpu.barrier_wait(seg_loaded[0].at[wg])
      kv_seg = compat.mosaic_gpu_load(kv_seg_own.at[wg], layout=row_layout)   # [bk] int32

    def step(i, carry, *, base, masked):
      return step_at(slot_of(base + i), i, carry, masked=masked)

    def step_at(slot, i, carry, *, masked):               # query tile i in ring slot ``slot``
      dk, dv = carry
      qs, dos = q_smem.at[slot], do_smem.at[slot]         # [bq, D]
      plgpu.barrier_wait(q_loaded.at[slot])
      plgpu.barrier_wait(do_loaded.at[slot])

      def st_dpt_gemm(refs):                              # S^T = K Q^T; dP^T = V dO^T [bk, bq]
        st_ref, dpt_ref = refs
        plgpu.wgmma(st_ref, kt, qs.transpose((1, 0)))
        plgpu.wgmma(dpt_ref, vt, dos.transpose((1, 0)))
      s_t, dp_t = pl.run_state(st_dpt_gemm)((plgpu.ACC.init(zeros((bk, bq))),
                                             plgpu.ACC.init(zeros((bk, bq)))))
      plgpu.barrier_wait(lse_loaded.at[slot])
      lse2 = compat.mosaic_gpu_load(lse_smem.at[slot], layout=col_layout)
      p_t = _probs(s_t, lse2, st, axis=1)
      cap_grad = _cap_grad(s_t, st)
      if masked:
        visible = None
        if st.lo_reach is not None or st.hi_reach is not None:
          rows = plgpu.broadcasted_iota(jnp.int32, (bk, bq), 0, layout=wgmma_layout)
          cols = plgpu.broadcasted_iota(jnp.int32, (bk, bq), 1, layout=wgmma_layout)
          visible = _dkv_visible(rows, cols, k0, i, st)
        if st.has_seg:
          q_seg = compat.mosaic_gpu_load(q_seg_smem.at[slot], layout=col_layout)   # [bq] int32
          visible = _both(visible, _seg_visible(q_seg, kv_seg, (bk, bq), 1))
        if visible is not None:   # (dense: there is no masked range, but it is traced)
          p_t = jnp.where(visible, p_t, 0.0)
      plgpu.barrier_wait(delta_loaded.at[slot])
      delta = compat.mosaic_gpu_load(delta_smem.at[slot], layout=col_layout)
      ds_t = _dscores(p_t, dp_t, delta, axis=1, cap_grad=cap_grad)
      if masked and visible is not None:   # a NaN delta row or value: dS = 0 where hidden
        ds_t = jnp.where(visible, ds_t, 0.0)

      def dv_dk_gemm(refs):                               # dV += P^T dO; dK += dS^T Q
        dv_ref, dk_ref = refs
        plgpu.wgmma(dv_ref, p_t.astype(st.dtype), dos)
        plgpu.wgmma(dk_ref, ds_t.astype(st.dtype), qs)
      dv, dk = pl.run_state(dv_dk_gemm)((plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
      plgpu.barrier_arrive(free.at[slot])
      return dk, dv

    def drain(i, carry, *, base):   # a step only the other warpgroup needs: keeps ring phases
      return drain_at(slot_of(base + i), carry)

    def drain_at(slot, carry):
      for bar in (q_loaded, lse_loaded, do_loaded, delta_loaded):
        plgpu.barrier_wait(bar.at[slot])
      plgpu.barrier_arrive(free.at[slot])
      return carry

    def walk_head(g, carry):   # the list's entries in order: drain, unmasked or masked step
      def walk_step(j, carry):
        entry = walk_ref[walk_row + (1 + j,)]
        i, code = walk.entry_tile(entry), walk.entry_code(entry, wg)
        slot = slot_of(g * per_head + j)
        run = lambda c: lax.cond(code == walk.FULL,
                                 functools.partial(step_at, slot, i, masked=False),
                                 functools.partial(step_at, slot, i, masked=True), c)
        return lax.cond(code == walk.SKIP, functools.partial(drain_at, slot), run, carry)
      return lax.fori_loop(jnp.int32(0), per_head, walk_step, carry)

    def head(g, carry):
      base = g * per_head - first_program                 # ring step of query tile i: base + i
      carry = lax.fori_loop(first_program, first, functools.partial(drain, base=base), carry)
      carry = lax.fori_loop(first, full_lo, functools.partial(step, base=base, masked=True), carry)
      carry = lax.fori_loop(full_lo, full_hi, functools.partial(step, base=base, masked=False),
                            carry)
      if two_edges:                                       # a window's left edge, segments
        carry = lax.fori_loop(full_hi, last, functools.partial(step, base=base, masked=True), carry)
        carry = lax.fori_loop(last, last_program, functools.partial(drain, base=base), carry)
      return carry

    dk, dv = lax.fori_loop(0, st.group, walk_head if st.has_sched else head, (dk, dv))
    kt[...] = (dk * st.scale).astype(st.dtype)            # K/V are dead: reuse them for dK/dV
    vt[...] = dv.astype(st.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(kt, dk_ref.at[b, pl.ds(k0, bk), kv_h])
    plgpu.copy_smem_to_gmem(vt, dv_ref.at[b, pl.ds(k0, bk), kv_h])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == _COMPUTE_WGS)
  def _memory():
    plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")

    def load(j, slot):
      g = lax.div(j, jnp.maximum(per_head, 1))
      i = first_program + (j - g * per_head)
      if st.has_sched:
        i = walk_tile(i)
      h = kv_h * st.group + g
      rows = pl.ds(i * bq, bq)
      plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem.at[slot], q_loaded.at[slot])
      if st.has_seg:
        plgpu.copy_gmem_to_smem(q_seg_ref.at[b, rows], q_seg_smem.at[slot], q_loaded.at[slot])
      plgpu.copy_gmem_to_smem(lse_ref.at[b, h, rows], lse_smem.at[slot], lse_loaded.at[slot])
      plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_smem.at[slot], do_loaded.at[slot])
      plgpu.copy_gmem_to_smem(delta_ref.at[b, h, rows], delta_smem.at[slot], delta_loaded.at[slot])

    _load_ring(load, total, stages, free)


def _load_ring(load, n, stages, free):
  """Memory warpgroup: ``load(e, e % stages)`` for e < n, past the fill once that slot is free."""
  for e in range(stages):
    @pl.when(e < n)
    def _():
      load(e, e)

  @pl.loop(stages, jnp.maximum(n, stages))
  def _(e):
    slot = lax.rem(e, jnp.int32(stages))
    plgpu.barrier_wait(free.at[slot])
    load(e, slot)


def _dkv_call(q, k, v, do, lse2, delta, st: _Static, seg=None):
  """``_dkv_kernel``'s inputs -> (dk, dv) [B, Sk', Hk, D], padded rows garbage (CPU: replayed)."""
  b, _, _, d = q.shape
  _, _, hk, _ = k.shape
  bq, bk, stages = st.bs.block_q_dkv, st.bs.block_k_dkv, st.bs.num_stages_dkv
  tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))   # 64 x 16-bit = 128 B
  smem = (
      plgpu.SMEM((_COMPUTE_WGS, bk, d), k.dtype, transforms=tiled),     # own K, then dK
      plgpu.SMEM((_COMPUTE_WGS, bk, d), v.dtype, transforms=tiled),     # own V, then dV
      plgpu.SMEM((stages, bq, d), q.dtype, transforms=tiled),           # Q ring
      plgpu.SMEM((stages, bq, d), do.dtype, transforms=tiled),          # dO ring
      plgpu.SMEM((stages, bq), jnp.float32),                            # lse2 ring
      plgpu.SMEM((stages, bq), jnp.float32),                            # delta ring
  )
  out_type = (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype))
  # barriers: own_loaded [2 wgs x (k, v)], q/do/lse/delta_loaded [S], free[, own kv ids loaded]
  return _launch(_dkv_kernel, st, out_type, smem, bk, bq, stages, (hk, st.num_dkv_programs, b),
                 ("heads", "kv_tiles", "batch"), (q, k, v, do, lse2, delta, *(seg or ())),
                 n_own=2, n_ring=4)


def _launch(kernel, st: _Static, out_type, smem, own_block, ring_block, stages, grid, grid_names,
            args, *, n_own, n_ring):
  """Runs ``kernel`` on ``args`` with 2 compute warpgroups and a memory one. Scratch: smem (with
  segment ids, own ids and an id ring), barriers n_own per compute warpgroup, n_ring ring ones
  (the first completed by 2 copies with segment ids: tile and ids), free[, own ids loaded]."""
  copies, seg_barriers = 1, ()
  if st.has_seg:
    smem += (plgpu.SMEM((_COMPUTE_WGS, own_block), jnp.int32),
             plgpu.SMEM((stages, ring_block), jnp.int32))
    copies, seg_barriers = 2, (plgpu.Barrier(num_barriers=_COMPUTE_WGS),)
  scratch = (smem, plgpu.Barrier(num_barriers=n_own * _COMPUTE_WGS),
             plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
             *(plgpu.Barrier(num_barriers=stages) for _ in range(n_ring - 1)),
             plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages), *seg_barriers)
  call = plgpu.kernel(functools.partial(kernel, st=st), out_type=out_type, scratch_types=scratch,
                      grid=grid, grid_names=grid_names, num_threads=_COMPUTE_WGS + 1,
                      thread_name="wg", compiler_params=plgpu.CompilerParams(approx_math=True))
  return call(*args)


def _zero_nonfinite(ref):
  """A ring slot's non-finite entries 0 in place (64 x 64 blocks), then the fence for wgmma."""
  for r in range(0, ref.shape[0], 64):
    for c in range(0, ref.shape[1], 64):
      blk = ref.at[pl.ds(r, 64), pl.ds(c, 64)]
      x = compat.mosaic_gpu_load(blk, layout=plgpu.Layout.WGMMA)
      blk[...] = jnp.where(x * 0 == 0, x, 0)
  plgpu.commit_smem()


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, st: _Static):
  """Refs as ``_dkv_kernel`` (the dQ bounds / walk) -> dq [B, Sq', Hq, D]; scratch: ``_dq_call``.
  A barrier that two TMA copies complete needs 2 arrivals: with 1 the first copy ends the phase."""
  q_seg_ref = kv_seg_ref = bounds_ref = walk_ref = None
  if st.has_seg:
    q_seg_ref, kv_seg_ref, *refs = refs
  if st.has_sched:
    walk_ref, *refs = refs
  elif st.has_seg:
    bounds_ref, *refs = refs
  dq_ref, smem, own_loaded, k_loaded, v_loaded, free, *seg_loaded = refs
  q_own, do_own, lse_own, delta_own, k_smem, v_smem = smem[:6]
  q_seg_own, kv_seg_smem = smem[6:] if st.has_seg else (None, None)
  bq, bk, stages = st.bs.block_q_dq, st.bs.block_k_dq, st.bs.num_stages_dq
  b, h, tile = (lax.axis_index(n) for n in ("batch", "heads", "q_tiles"))
  if st.causal:
    tile = (st.num_dq_programs - 1) - tile                # longest kv ranges first
  wg = lax.axis_index("wg")
  kv_h = lax.div(h, jnp.int32(st.group))
  row0_program = tile * (_COMPUTE_WGS * bq)
  if st.has_sched:   # this program's list of kv tiles (ring entry j: the list's entry j)
    walk_row = (b if walk_ref.shape[0] > 1 else 0, kv_h if walk_ref.shape[1] > 1 else 0, tile)
    walk_entry = lambda j: walk_ref[walk_row + (1 + j,)]
    program_start, program_steps = jnp.int32(0), walk_ref[walk_row + (0,)]
  elif st.has_seg:
    program_start, program_steps = bounds_ref[b, tile, 0], bounds_ref[b, tile, 1]
  else:
    program_start = _dq_kv_range(row0_program, st)[0]     # warpgroup 0's rows see the first
    program_steps = _dq_kv_range(row0_program + (_COMPUTE_WGS - 1) * bq, st)[3]   # 1's last
  slot_of = lambda t: lax.rem(t - program_start, jnp.int32(stages))
  two_edges = st.lo_reach is not None or st.has_seg       # masked tiles on both sides

  @pl.when(wg < _COMPUTE_WGS)
  def _compute():
    plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")
    row0 = row0_program + wg * bq
    rows_ds = pl.ds(row0, bq)
    qt, dot = q_own.at[wg], do_own.at[wg]                 # [bq, D]
    bars = [own_loaded.at[4 * wg + n] for n in range(4)]
    plgpu.copy_gmem_to_smem(q_ref.at[b, rows_ds, h], qt, bars[0])
    if st.has_seg:
      plgpu.copy_gmem_to_smem(q_seg_ref.at[b, rows_ds], q_seg_own.at[wg], seg_loaded[0].at[wg])
    plgpu.copy_gmem_to_smem(do_ref.at[b, rows_ds, h], dot, bars[1])
    plgpu.copy_gmem_to_smem(lse_ref.at[b, h, rows_ds], lse_own.at[wg], bars[2])
    plgpu.copy_gmem_to_smem(delta_ref.at[b, h, rows_ds], delta_own.at[wg], bars[3])
    if st.has_seg and not st.has_sched:
      start, full_lo, full_hi, steps = (bounds_ref[b, tile, 2 + 4 * wg + j] for j in range(4))
    elif not st.has_sched:
      start, full_lo, full_hi, steps = _dq_kv_range(row0, st)
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)              # one value per query (row)
    zeros = lambda shape: plgpu.layout_cast(jnp.full(shape, 0.0, jnp.float32), wgmma_layout)
    dq = zeros((bq, st.head_dim))
    for bar in bars:
      plgpu.barrier_wait(bar)
    lse2 = compat.mosaic_gpu_load(lse_own.at[wg], layout=row_layout)
    delta = compat.mosaic_gpu_load(delta_own.at[wg], layout=row_layout)
    q_seg = None
    if st.has_seg:
      plgpu.barrier_wait(seg_loaded[0].at[wg])
      q_seg = compat.mosaic_gpu_load(q_seg_own.at[wg], layout=row_layout)     # [bq] int32

    def step(t, dq, *, masked):
      return step_at(slot_of(t), t, dq, masked=masked)

    def step_at(slot, t, dq, *, masked):                  # kv tile t in ring slot ``slot``
      ks, vs = k_smem.at[slot], v_smem.at[slot]           # [bk, D]
      plgpu.barrier_wait(k_loaded.at[slot])
      plgpu.barrier_wait(v_loaded.at[slot])
      if masked:   # K's non-finite entries 0 for dS K (a row that sees one has a NaN lse2)
        _zero_nonfinite(ks)

      def s_dp_gemm(refs):                                # S = Q K^T; dP = dO V^T [bq, bk]
        s_ref, dp_ref = refs
        plgpu.wgmma(s_ref, qt, ks.transpose((1, 0)))
        plgpu.wgmma(dp_ref, dot, vs.transpose((1, 0)))
      s, dp = pl.run_state(s_dp_gemm)((plgpu.ACC.init(zeros((bq, bk))),
                                       plgpu.ACC.init(zeros((bq, bk)))))
      p = _probs(s, lse2, st, axis=0)
      cap_grad = _cap_grad(s, st)
      if masked:
        rows = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 0, layout=wgmma_layout)
        cols = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=wgmma_layout)
        visible = _dq_visible(rows, cols, row0, t, st)
        if st.has_seg:
          kv_seg = compat.mosaic_gpu_load(kv_seg_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
          visible = jnp.logical_and(visible, _seg_visible(q_seg, kv_seg, (bq, bk), 0))
        p = jnp.where(visible, p, 0.0)
      ds = _dscores(p, dp, delta, axis=0, cap_grad=cap_grad)
      if masked:   # a NaN value (dP) or delta: dS = 0 where hidden
        ds = jnp.where(visible, ds, 0.0)

      def dq_gemm(acc_ref):                               # dQ += dS K
        plgpu.wgmma(acc_ref, ds.astype(st.dtype), ks)
      dq = pl.run_state(dq_gemm)(plgpu.ACC.init(dq))
      plgpu.barrier_arrive(free.at[slot])
      return dq

    def drain(t, carry):
      return drain_at(slot_of(t), carry)

    def drain_at(slot, carry):
      plgpu.barrier_wait(k_loaded.at[slot])
      plgpu.barrier_wait(v_loaded.at[slot])
      plgpu.barrier_arrive(free.at[slot])
      return carry

    def walk_step(j, dq):   # the list's entry j: drain, unmasked or masked step
      entry = walk_entry(j)
      t, code = walk.entry_tile(entry), walk.entry_code(entry, wg)
      slot = slot_of(j)
      run = lambda c: lax.cond(code == walk.FULL, functools.partial(step_at, slot, t, masked=False),
                               functools.partial(step_at, slot, t, masked=True), c)
      return lax.cond(code == walk.SKIP, functools.partial(drain_at, slot), run, dq)

    if st.has_sched:
      dq = lax.fori_loop(jnp.int32(0), program_steps, walk_step, dq)
    if two_edges and not st.has_sched:                    # a window's left edge, segments
      lax.fori_loop(program_start, start, drain, None)
      dq = lax.fori_loop(start, full_lo, functools.partial(step, masked=True), dq)
    if not st.has_sched:
      dq = lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), dq)
      dq = lax.fori_loop(full_hi, steps, functools.partial(step, masked=True), dq)
      lax.fori_loop(steps, program_steps, drain, None)
    qt[...] = (dq * st.scale).astype(st.dtype)            # Q is dead: reuse its tile for dQ
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(qt, dq_ref.at[b, rows_ds, h])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == _COMPUTE_WGS)
  def _memory():
    plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")

    def load(t, slot):
      rows = (b, pl.ds(t * bk, bk), kv_h)
      plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_loaded.at[slot])
      if st.has_seg:
        plgpu.copy_gmem_to_smem(kv_seg_ref.at[b, pl.ds(t * bk, bk)], kv_seg_smem.at[slot],
                                k_loaded.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_loaded.at[slot])

    n = program_steps - program_start                     # ring entries: kv tile start + e
    tile_at = lambda e: program_start + e                 # (a schedule: the list's entry e)
    if st.has_sched:
      tile_at = lambda e: walk.entry_tile(walk_entry(e))
    _load_ring(lambda e, slot: load(tile_at(e), slot), n, stages, free)


def _dq_call(q, k, v, do, lse2, delta, st: _Static, seg=None):
  """As ``_dkv_call`` (seg: the dQ bounds or walk) -> dq [B, Sq', Hq, D]."""
  b, _, hq, d = q.shape
  bq, bk, stages = st.bs.block_q_dq, st.bs.block_k_dq, st.bs.num_stages_dq
  tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  smem = (
      plgpu.SMEM((_COMPUTE_WGS, bq, d), q.dtype, transforms=tiled),     # own Q, then dQ
      plgpu.SMEM((_COMPUTE_WGS, bq, d), do.dtype, transforms=tiled),    # own dO
      plgpu.SMEM((_COMPUTE_WGS, bq), jnp.float32),                      # own lse2
      plgpu.SMEM((_COMPUTE_WGS, bq), jnp.float32),                      # own delta
      plgpu.SMEM((stages, bk, d), k.dtype, transforms=tiled),           # K ring
      plgpu.SMEM((stages, bk, d), v.dtype, transforms=tiled),           # V ring
  )
  # barriers: own_loaded [2 wgs x (q, do, lse, delta)], k/v_loaded [S], free[, own q ids loaded]
  return _launch(_dq_kernel, st, jax.ShapeDtypeStruct(q.shape, q.dtype), smem, bq, bk, stages,
                 (hq, st.num_dq_programs, b), ("heads", "q_tiles", "batch"),
                 (q, k, v, do, lse2, delta, *(seg or ())), n_own=4, n_ring=2)


def flash_attention_bwd(q, k, v, out, lse, do, *, causal: bool = False, scale: float | None = None,
                        block_sizes: BlockSizes | None = None, d_lse=None, local_window_size=None,
                        logits_soft_cap: float | None = None, q_segment_ids=None,
                        kv_segment_ids=None, schedule=None):
  """Gradients of flash attention with the Mosaic GPU (Hopper) backward kernels.

  Args:
    q, k, v, causal, scale, local_window_size, logits_soft_cap: the forward's, as for
      ``mosaic_gpu.flash_attention``; D in (64, 128).
    out, lse, do: the forward's output [B, Sq, Hq, D], log-sum-exp [B, Hq, Sq] fp32 (natural
      log, -inf for rows that see no key) and the cotangent of out.
    block_sizes: ``BlockSizes`` (None: ``default_block_sizes(D)``).
    d_lse: optional cotangent of lse [B, Hq, Sq] (None: zero).
    q_segment_ids: None or int [B, Sq]; query i sees key j only where the ids match and != 0.
    kv_segment_ids: int [B, Sk] (None: q_segment_ids, which then needs Sq == Sk).
    schedule: None, or the forward's ``block_schedule.BlockSchedule``.

  Returns:
    (dq [B, Sq, Hq, D], dk [B, Sk, Hk, D], dv [B, Sk, Hk, D]) in q.dtype, accumulated in fp32;
    dk/dv summed over each kv head's query heads.

  Example (on an H100/H200):
    >>> q = jax.random.normal(jax.random.key(0), (1, 1024, 8, 128), jnp.bfloat16)
    >>> from pallas_kernels.flash import mosaic_gpu
    >>> out, lse = mosaic_gpu.flash_attention(q, q, q, causal=True)  # doctest: +SKIP
    >>> dq, dk, dv = flash_attention_bwd(q, q, q, out, lse, out, causal=True)  # doctest: +SKIP
  """
  b, sq, hq, _, sk = check_qkv_shapes(q, k, v)[:5]
  if out.shape != q.shape or do.shape != q.shape:
    raise ValueError(f"out {out.shape} and do {do.shape} must have q's shape {q.shape}")
  if lse.shape != (b, hq, sq):
    raise ValueError(f"lse must be [batch, q_heads, q_len] = {(b, hq, sq)}, got {lse.shape}")
  if not (q.dtype == k.dtype == v.dtype == do.dtype):
    raise TypeError(f"q, k, v, do must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}, "
                    f"{do.dtype}")
  check_dtype(q.dtype)
  if q_segment_ids is not None and kv_segment_ids is None:   # the kv ids default to q's
    if sq != sk:
      raise ValueError(f"segment ids with q_len {sq} != kv_len {sk} need kv_segment_ids")
    kv_segment_ids = q_segment_ids
  check_segment_ids(q_segment_ids, kv_segment_ids, q.shape, k.shape)
  if q_segment_ids is not None:
    if not all(jnp.issubdtype(x.dtype, jnp.integer) for x in (q_segment_ids, kv_segment_ids)):
      raise TypeError(f"segment ids must be integers, got {q_segment_ids.dtype} and "
                      f"{kv_segment_ids.dtype}")
  st = _static_config(q.shape, k.shape, q.dtype, causal=causal, scale=scale,
                      block_sizes=block_sizes, local_window_size=local_window_size,
                      logits_soft_cap=logits_soft_cap, has_seg=q_segment_ids is not None,
                      schedule=schedule)
  # base-2 lse (padded rows +inf: p = 0) and delta = rowsum(dO * O) - d_lse (padded rows 0)
  lse2 = pad_axis(lse_base2(lse.astype(jnp.float32)), 2, st.q_pad, jnp.inf)
  delta = pad_axis(delta_rows(out, do, d_lse), 2, st.q_pad)
  q_p, do_p = pad_axis(q, 1, st.q_pad), pad_axis(do, 1, st.q_pad)
  k_p, v_p = pad_axis(k, 1, st.kv_pad), pad_axis(v, 1, st.kv_pad)
  seg_dq = seg_dkv = q_seg = kv_seg = None
  if st.has_seg:   # padding gets id 0 (sees nothing)
    q_seg = pad_axis(q_segment_ids.astype(jnp.int32), 1, st.q_pad, 0)
    kv_seg = pad_axis(kv_segment_ids.astype(jnp.int32), 1, st.kv_pad, 0)
  if st.has_sched or st.has_seg:   # the kernels' extra inputs: ids, then walk or bounds
    ids = (q_seg, kv_seg) if st.has_seg else ()
    dq_rows, dkv_rows = (_sched_walks(schedule, st, q_seg, kv_seg) if st.has_sched
                         else _seg_bounds(q_seg, kv_seg, st))
    seg_dq, seg_dkv = ids + (dq_rows,), ids + (dkv_rows,)
  dk, dv = _dkv_call(q_p, k_p, v_p, do_p, lse2, delta, st, seg_dkv)
  dq = _dq_call(q_p, k_p, v_p, do_p, lse2, delta, st, seg_dq)
  return dq[:, :sq], dk[:, :st.kv_len], dv[:, :st.kv_len]
