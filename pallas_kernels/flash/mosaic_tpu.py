"""Flash attention for TPU in Pallas (Mosaic): a forward and a backward that walk a block schedule
(docs/flash.md, "The portable kernels"). The schedule's lists are scalar-prefetched into SMEM and
read by the K/V index maps, so skipped tiles are never copied; entries past a row's count repeat
its last index (no copy) and skip the body. Inputs ``[B, S, H, D]`` are padded (head_dim to 128
lanes) and viewed as ``[B, S, H * D]``; row statistics travel as ``[B, H, 1, S]``, segment ids
lane- and sublane-broadcast, as in splash attention. dK/dV accumulate a GQA group on ``[bk, bq]``
tiles. fp16 is computed in fp32, fp32 at ``Precision.HIGHEST``.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import compat
from pallas_kernels.block_schedule import BlockSchedule, check_schedule_args
from pallas_kernels.common import softmax
from pallas_kernels.common.util import cdiv, check_float, pad_axis, round_up
from pallas_kernels.masks import normalize_window, visible

NUM_LANES = 128
NUM_SUBLANES = 8
# Finite "minus infinity" for masked logits: exp(MASK_VALUE - anything reasonable) == 0 and
# MASK_VALUE - MASK_VALUE == 0 never produces NaN (splash attention uses the same value).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
NT_DIMS = (((1,), (1,)), ((), ()))  # a @ b.T
NN_DIMS = (((1,), (0,)), ((), ()))  # a @ b


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes of the TPU kernels (forward and backward use the same schedule tiles).

  Attributes:
    block_q: query rows per tile; a multiple of 128 (lse/delta and segment ids travel as
      lane-dense rows of this length).
    block_k: keys per tile; a multiple of 128 lanes.

  Example:
    >>> BlockSizes(block_q=256, block_k=512).block_k
    512
  """
  block_q: int = 128
  block_k: int = 128

  def __post_init__(self):
    for name in ("block_q", "block_k"):
      val = getattr(self, name)
      if not isinstance(val, int) or val <= 0 or val % NUM_LANES:
        raise ValueError(f"BlockSizes.{name} must be a positive multiple of {NUM_LANES}, got {val!r}")


def default_block_sizes(head_dim: int, dtype) -> BlockSizes:
  """Default TPU tiles for a head dimension and input dtype: the largest whose fp32 tile
  intermediates and double-buffered inputs stay well inside the default scoped VMEM (16 MiB on
  v5e); estimates from that budget, not timed on TPU hardware.

  Args:
    head_dim, dtype: the (unpadded) head dimension and the input dtype.

  Returns:
    A ``BlockSizes``.

  Example:
    >>> default_block_sizes(128, jnp.bfloat16)
    BlockSizes(block_q=256, block_k=512)
  """
  d_pad = round_up(head_dim, NUM_LANES)
  itemsize = 4 if jnp.dtype(dtype) == jnp.float16 else jnp.dtype(dtype).itemsize
  if d_pad <= 128 and itemsize == 2:
    return BlockSizes(block_q=256, block_k=512)
  if d_pad <= 256:
    return BlockSizes(block_q=256, block_k=256)
  return BlockSizes(block_q=128, block_k=128)


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static description of one call (hashable: it is a custom_vjp non-differentiable argument)."""
  batch: int
  q_heads: int
  kv_heads: int
  q_len: int
  kv_len: int
  head_dim: int
  head_dim_v: int
  block_q: int
  block_k: int
  causal: bool
  window: tuple | None
  scale: float
  soft_cap: float | None
  segmented: bool
  interpret: bool

  @property
  def group(self):
    return self.q_heads // self.kv_heads

  @property
  def nq(self):
    return cdiv(self.q_len, self.block_q)

  @property
  def nk(self):
    return cdiv(self.kv_len, self.block_k)

  @property
  def d_pad(self):
    return round_up(self.head_dim, NUM_LANES)

  @property
  def dv_pad(self):
    return round_up(self.head_dim_v, NUM_LANES)


@dataclasses.dataclass(frozen=True)
class _SchedShape:
  """Static shape of a schedule's visit lists: [Bs, Hs, rows, cols], flattened to 1-D in SMEM."""
  bs: int
  hs: int
  rows: int
  cols: int

  def row(self, b, h_kv, i):
    """Flat index of (b, h_kv, i) in the [Bs, Hs, rows] counts array."""
    return ((b if self.bs > 1 else 0) * self.hs + (h_kv if self.hs > 1 else 0)) * self.rows + i

  def entry(self, b, h_kv, i, j):
    """Flat index of (b, h_kv, i, j) in the [Bs, Hs, rows, cols] index/partial arrays."""
    return self.row(b, h_kv, i) * self.cols + j

  def read(self, idx_ref, cnt_ref, part_ref, b, h_kv, i, j):
    """(row (b, h_kv, i)'s count, its entry j's tile index and partial flag) from SMEM."""
    e = self.entry(b, h_kv, i, j)
    return cnt_ref[self.row(b, h_kv, i)], idx_ref[e], part_ref[e]


def _dot(a, b, dims):
  """fp32 ``dot_general``; fp32 operands (all of a call's share its compute dtype) at HIGHEST."""
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32,
                         precision=lax.Precision.HIGHEST if a.dtype == jnp.float32 else None)


def _logits(s, cfg: _Config):
  """Scale and soft-cap raw q.k products; returns (logits, tanh or None) in fp32."""
  s = s * cfg.scale
  if cfg.soft_cap is None:
    return s, None
  t = jnp.tanh(s / cfg.soft_cap)
  return cfg.soft_cap * t, t


def _lane_tile(x, n):
  """[r, 128] -> [r, n] by repeating lanes (n a multiple of 128)."""
  assert x.shape[-1] == NUM_LANES and n % NUM_LANES == 0, (x.shape, n)
  return x if n == NUM_LANES else jnp.tile(x, (1, n // NUM_LANES))


def _qk_mask(cfg, q_blk, kv_blk, q_seg_ref, kv_seg_ref, kv_rows=False):
  """Visibility of query tile q_blk x key tile kv_blk: bool [bq, bk], or [bk, bq] (``kv_rows``);
  the row side's segment ids tiled along lanes, the column side's as one row."""
  bq, bk = cfg.block_q, cfg.block_k
  shape, qa = ((bk, bq), 1) if kv_rows else ((bq, bk), 0)
  q_pos = q_blk * bq + (cfg.kv_len - cfg.q_len) + lax.broadcasted_iota(jnp.int32, shape, qa)
  k_pos = kv_blk * bk + lax.broadcasted_iota(jnp.int32, shape, 1 - qa)
  q_ids = kv_ids = None
  if cfg.segmented and kv_rows:
    q_ids, kv_ids = q_seg_ref[0:1, :], _lane_tile(kv_seg_ref[...], bq)
  elif cfg.segmented:
    q_ids, kv_ids = _lane_tile(q_seg_ref[...], bk), kv_seg_ref[0:1, :]
  return visible(q_pos, k_pos, q_ids, kv_ids, causal=cfg.causal, window=cfg.window,
                 kv_len=cfg.kv_len)


def _run_tile(step, live, partial):
  """step(True) on a live tile with a mask, step(False) on a live full one."""
  pl.when(live & (partial != 0))(lambda: step(True))
  pl.when(live & (partial == 0))(lambda: step(False))


def _fwd_kernel(kv_idx_ref, kv_cnt_ref, kv_part_ref,  # scalar prefetch (SMEM)
                q_ref, k_ref, v_ref, *refs, cfg: _Config, sched: _SchedShape):
  q_seg_ref, kv_seg_ref = refs[:2] if cfg.segmented else (None, None)
  o_ref, lse_ref, m_sc, l_sc, acc_sc = refs[2 * cfg.segmented:]
  bq, bk, dv = cfg.block_q, cfg.block_k, cfg.dv_pad
  b, h, i, j = (pl.program_id(a) for a in range(4))
  h_kv = lax.div(h, cfg.group)
  assert q_ref.shape == (bq, cfg.d_pad) and k_ref.shape == (bk, cfg.d_pad), (q_ref.shape, k_ref.shape)
  assert v_ref.shape == (bk, dv) and acc_sc.shape == (bq, dv)
  assert m_sc.shape == l_sc.shape == (bq, NUM_LANES)

  @pl.when(j == 0)
  def _init():
    m_sc[...] = jnp.full_like(m_sc, MASK_VALUE)
    l_sc[...] = jnp.zeros_like(l_sc)
    acc_sc[...] = jnp.zeros_like(acc_sc)

  count, kv_blk, partial = sched.read(kv_idx_ref, kv_cnt_ref, kv_part_ref, b, h_kv, i, j)

  def step(masked):
    q, k, v = q_ref[...], k_ref[...], None                # [bq, D], [bk, D]
    if masked:   # a non-finite value: NaN logits (masked for the rows that cannot see it)
      k, v = softmax.hide_nonfinite_values(k, v_ref[...])
    s, _ = _logits(_dot(q, k, NT_DIMS), cfg)              # [bq, bk]
    if masked:
      mask = _qk_mask(cfg, i, kv_blk, q_seg_ref, kv_seg_ref)  # [bq, bk]
      s = jnp.where(mask, s, MASK_VALUE)
    m_prev = m_sc[...]                                    # [bq, 128]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [bq, 128]
    p = jnp.exp(s - _lane_tile(m_next, bk))               # [bq, bk]
    if masked:
      # A row with nothing visible yet has m == MASK_VALUE, so exp(s - m) == 1 there.
      p = jnp.where(mask, p, 0.0)
    alpha = jnp.exp(m_prev - m_next)                      # [bq, 128]
    l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
    m_sc[...] = m_next
    v = v_ref[...] if v is None else v                    # [bk, Dv]
    pv = _dot(p.astype(v.dtype), v, NN_DIMS)              # [bq, Dv]
    acc_sc[...] = acc_sc[...] * _lane_tile(alpha, dv) + pv

  _run_tile(step, (j < count), partial)

  @pl.when(j == sched.cols - 1)
  def _finish():
    l = l_sc[...]                                         # [bq, 128]
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    o_ref[...] = (acc_sc[...] * _lane_tile(1.0 / l_safe, dv)).astype(o_ref.dtype)
    lse = jnp.where(empty, -jnp.inf, m_sc[...] + jnp.log(l_safe))  # [bq, 128]
    lse_ref[...] = lse.T[0:1, :]                          # [1, bq]


def _seg_layouts(seg, length_pad):
  """int32 [B, S] -> (lane-broadcast [B, S_pad, 128], sublane-broadcast [B, 8, S_pad])."""
  seg = pad_axis(seg.astype(jnp.int32), 1, length_pad)
  lanes = jnp.broadcast_to(seg[:, :, None], seg.shape + (NUM_LANES,))
  rows = jnp.broadcast_to(seg[:, None, :], (seg.shape[0], NUM_SUBLANES, seg.shape[1]))
  return lanes, rows


def _to_tiles(x, s_pad, d_pad):
  """[B, S, H, D] -> [B, S_pad, H * D_pad] (zero padding; a free reshape when aligned)."""
  b, _, h, _ = x.shape
  return pad_axis(pad_axis(x, 1, s_pad), 3, d_pad).reshape(b, s_pad, h * d_pad)


def _qkv_tiles(q, k, v, cfg):
  """(compute dtype: fp32 for fp16 inputs, else theirs; q, k, v in it as [B, S_pad, H * D_pad])."""
  dt = jnp.result_type(q.dtype, k.dtype, v.dtype)
  dt = jnp.dtype(jnp.float32) if dt == jnp.float16 else jnp.dtype(dt)
  sq_pad, sk_pad = cfg.nq * cfg.block_q, cfg.nk * cfg.block_k
  return (dt, _to_tiles(q.astype(dt), sq_pad, cfg.d_pad),
          _to_tiles(k.astype(dt), sk_pad, cfg.d_pad), _to_tiles(v.astype(dt), sk_pad, cfg.dv_pad))


def _from_tiles(x, s, h, d):
  """[B, S_pad, H * D_pad] -> [B, S, H, D]."""
  b, s_pad, hd = x.shape
  return x.reshape(b, s_pad, h, hd // h)[:, :s, :, :d]


def _fwd_walk(cfg, sched):
  """(q_map, q/k/v specs, segment id specs or []) of the grid (B, Hq, nq, cols) walking it."""
  bq, bk, g = cfg.block_q, cfg.block_k, cfg.group
  q_map = lambda b, h, i, j, *_: (b, i, h)
  kv_blk = lambda b, h, i, j, idx: idx[sched.entry(b, lax.div(h, g), i, j)]
  kv_map = lambda b, h, i, j, idx, *_: (b, kv_blk(b, h, i, j, idx), lax.div(h, g))
  kv_seg_map = lambda b, h, i, j, idx, *_: (b, 0, kv_blk(b, h, i, j, idx))
  qkv_specs = [pl.BlockSpec((None, bq, cfg.d_pad), q_map),
               pl.BlockSpec((None, bk, cfg.d_pad), kv_map),
               pl.BlockSpec((None, bk, cfg.dv_pad), kv_map)]
  seg_specs = [pl.BlockSpec((None, bq, NUM_LANES), lambda b, h, i, j, *_: (b, i, 0)),
               pl.BlockSpec((None, NUM_SUBLANES, bk), kv_seg_map)]
  return q_map, qkv_specs, seg_specs if cfg.segmented else []


def _call(kernel, cfg, lists, operands, *, grid, in_specs, out_specs, scratch, out_shape, name):
  """pallas_call of a kernel whose last grid axis walks ``lists`` (scalar-prefetched, flat)."""
  return pl.pallas_call(
      kernel, out_shape=out_shape, name=name,
      grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=3, grid=grid, in_specs=in_specs,
                                             out_specs=out_specs, scratch_shapes=scratch),
      compiler_params=compat.tpu_compiler_params(("parallel",) * 3 + ("arbitrary",)),
      interpret=compat.tpu_interpret_params() if cfg.interpret else False,
  )(*(x.reshape(-1) for x in lists), *operands)


def _fwd(q, k, v, q_seg, kv_seg, schedule: BlockSchedule, cfg: _Config):
  """Runs the forward kernel. Returns (out [B,Sq,Hq,Dv] in q.dtype, lse [B,Hq,Sq] fp32)."""
  bq, bk = cfg.block_q, cfg.block_k
  sq_pad, sk_pad = cfg.nq * bq, cfg.nk * bk
  dt, q3, k3, v3 = _qkv_tiles(q, k, v, cfg)
  sched = _SchedShape(*schedule.kv_indices.shape)
  q_map, qkv_specs, seg_specs = _fwd_walk(cfg, sched)
  operands = [q3, k3, v3]
  if cfg.segmented:
    operands += [_seg_layouts(q_seg, sq_pad)[0], _seg_layouts(kv_seg, sk_pad)[1]]
  # Results are stored in the compute dtype (no fp16 inside a TPU kernel) and cast outside.
  out3, lse4 = _call(
      functools.partial(_fwd_kernel, cfg=cfg, sched=sched), cfg,
      (schedule.kv_indices, schedule.kv_counts, schedule.kv_partial), operands,
      grid=(cfg.batch, cfg.q_heads, cfg.nq, sched.cols), in_specs=qkv_specs + seg_specs,
      out_specs=[pl.BlockSpec((None, bq, cfg.dv_pad), q_map),
                 pl.BlockSpec((None, None, 1, bq), lambda b, h, i, j, *_: (b, h, 0, i))],
      scratch=[pltpu.VMEM((bq, NUM_LANES), jnp.float32),
               pltpu.VMEM((bq, NUM_LANES), jnp.float32),
               pltpu.VMEM((bq, cfg.dv_pad), jnp.float32)],
      out_shape=[jax.ShapeDtypeStruct((cfg.batch, sq_pad, cfg.q_heads * cfg.dv_pad), dt),
                 jax.ShapeDtypeStruct((cfg.batch, cfg.q_heads, 1, sq_pad), jnp.float32)],
      name="jattn_flash_fwd_tpu")
  return (_from_tiles(out3, cfg.q_len, cfg.q_heads, cfg.head_dim_v).astype(q.dtype),
          lse4[:, :, 0, :cfg.q_len])


def _dq_kernel(kv_idx_ref, kv_cnt_ref, kv_part_ref,  # scalar prefetch (SMEM)
               q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, *refs, cfg: _Config,
               sched: _SchedShape):
  q_seg_ref, kv_seg_ref = refs[:2] if cfg.segmented else (None, None)
  dq_ref, dq_sc = refs[2 * cfg.segmented:]
  bq = cfg.block_q
  b, h, i, j = (pl.program_id(a) for a in range(4))
  h_kv = lax.div(h, cfg.group)
  assert lse_ref.shape == di_ref.shape == (1, bq), lse_ref.shape

  @pl.when(j == 0)
  def _init():
    dq_sc[...] = jnp.zeros_like(dq_sc)

  count, kv_blk, partial = sched.read(kv_idx_ref, kv_cnt_ref, kv_part_ref, b, h_kv, i, j)

  def step(masked):
    q, k = q_ref[...], k_ref[...]                         # [bq, D], [bk, D]
    v, do = v_ref[...], do_ref[...]                       # [bk, Dv], [bq, Dv]
    lse = jnp.expand_dims(lse_ref[0], -1)                 # [bq, 1]
    di = jnp.expand_dims(di_ref[0], -1)                   # [bq, 1]
    if masked:   # non-finite entries -> 0 (rows that see them have a NaN lse)
      k, v = softmax.zero_nonfinite(k), softmax.zero_nonfinite(v)
    s, t = _logits(_dot(q, k, NT_DIMS), cfg)              # [bq, bk]
    if masked:
      s = jnp.where(_qk_mask(cfg, i, kv_blk, q_seg_ref, kv_seg_ref), s, MASK_VALUE)
    p = jnp.exp(s - lse)                                  # [bq, bk]
    dp = _dot(do, v, NT_DIMS)                             # [bq, bk]
    ds = p * (dp - di)                                    # [bq, bk]
    if t is not None:
      ds = ds * (1.0 - t * t)
    dq_sc[...] += _dot(ds.astype(k.dtype), k, NN_DIMS)  # [bq, D]

  _run_tile(step, (j < count), partial)

  @pl.when(j == sched.cols - 1)
  def _finish():
    dq_ref[...] = (dq_sc[...] * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(q_idx_ref, q_cnt_ref, q_part_ref,  # scalar prefetch (SMEM)
                q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, *refs, cfg: _Config,
                sched: _SchedShape):
  kv_seg_ref, q_seg_ref = refs[:2] if cfg.segmented else (None, None)
  dk_ref, dv_ref, dk_sc, dv_sc = refs[2 * cfg.segmented:]
  bq = cfg.block_q
  b, h_kv, ki, t_step = (pl.program_id(a) for a in range(4))
  jq = lax.rem(t_step, sched.cols)
  assert lse_ref.shape == di_ref.shape == (1, bq), lse_ref.shape

  @pl.when(t_step == 0)
  def _init():
    dk_sc[...] = jnp.zeros_like(dk_sc)
    dv_sc[...] = jnp.zeros_like(dv_sc)

  count, q_blk, partial = sched.read(q_idx_ref, q_cnt_ref, q_part_ref, b, h_kv, ki, jq)

  def step(masked):
    q, k = q_ref[...], k_ref[...]                         # [bq, D], [bk, D]
    v, do = v_ref[...], do_ref[...]                       # [bk, Dv], [bq, Dv]
    lse, di = lse_ref[...], di_ref[...]                   # [1, bq]
    s, t = _logits(_dot(k, q, NT_DIMS), cfg)              # [bk, bq] (transposed tile)
    p = jnp.exp(s - lse)                                  # [bk, bq]
    if masked:   # p and dS are 0 where hidden, even with a NaN lse, delta or key
      mask = _qk_mask(cfg, q_blk, ki, q_seg_ref, kv_seg_ref, kv_rows=True)   # [bk, bq]
      p = jnp.where(mask, p, 0.0)
    dv_sc[...] += _dot(p.astype(do.dtype), do, NN_DIMS)  # [bk, Dv]
    dp = _dot(v, do, NT_DIMS)                             # [bk, bq]
    ds = p * (dp - di)                                    # [bk, bq]
    if masked:
      ds = jnp.where(mask, ds, 0.0)
    if t is not None:
      ds = ds * (1.0 - t * t)
    dk_sc[...] += _dot(ds.astype(q.dtype), q, NN_DIMS)  # [bk, D]

  _run_tile(step, (jq < count), partial)

  @pl.when(t_step == cfg.group * sched.cols - 1)
  def _finish():
    dk_ref[...] = (dk_sc[...] * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _bwd(q, k, v, q_seg, kv_seg, schedule: BlockSchedule, out, lse, dout, dlse, cfg: _Config):
  """Runs the dQ and dK/dV kernels. Returns (dq, dk, dv) in the input dtypes."""
  bq, bk, g = cfg.block_q, cfg.block_k, cfg.group
  sq_pad, sk_pad = cfg.nq * bq, cfg.nk * bk
  dt, q3, k3, v3 = _qkv_tiles(q, k, v, cfg)
  do3 = _to_tiles(dout.astype(dt), sq_pad, cfg.dv_pad)     # [B, Sq_p, Hq*Dv]
  delta = softmax.delta_rows(out, dout, dlse)              # [B, Hq, Sq] fp32
  # Rows that see no key have lse = -inf; any finite value works there since every logit of
  # such a row is masked (p = exp(MASK_VALUE - 0) = 0). Padded rows have dO = 0 and delta = 0.
  # A NaN lse (a row that sees a non-finite key) stays NaN.
  lse_rows = pad_axis(jnp.where(lse == -jnp.inf, 0.0, lse), 2, sq_pad)[:, :, None, :]
  di_rows = pad_axis(delta, 2, sq_pad)[:, :, None, :]      # [B, Hq, 1, Sq_p]
  if cfg.segmented:
    q_lanes, q_rows = _seg_layouts(q_seg, sq_pad)
    kv_lanes, kv_rows = _seg_layouts(kv_seg, sk_pad)

  # ---- dQ: walk the forward schedule.
  fs = _SchedShape(*schedule.kv_indices.shape)
  q_map, qkv_specs, seg_specs = _fwd_walk(cfg, fs)
  row_spec = pl.BlockSpec((None, None, 1, bq), lambda b, h, i, j, *_: (b, h, 0, i))
  dq3 = _call(
      functools.partial(_dq_kernel, cfg=cfg, sched=fs), cfg,
      (schedule.kv_indices, schedule.kv_counts, schedule.kv_partial),
      [q3, k3, v3, do3, lse_rows, di_rows] + ([q_lanes, kv_rows] if cfg.segmented else []),
      grid=(cfg.batch, cfg.q_heads, cfg.nq, fs.cols),
      in_specs=[*qkv_specs, pl.BlockSpec((None, bq, cfg.dv_pad), q_map), row_spec, row_spec,
                *seg_specs],
      out_specs=pl.BlockSpec((None, bq, cfg.d_pad), q_map),
      scratch=[pltpu.VMEM((bq, cfg.d_pad), jnp.float32)],
      out_shape=jax.ShapeDtypeStruct(q3.shape, dt), name="jattn_flash_bwd_dq_tpu")

  # ---- dK/dV: walk the transposed schedule; last grid axis = (group head, q step).
  ts = _SchedShape(*schedule.q_indices.shape)

  head = lambda h_kv, t: h_kv * g + lax.div(t, ts.cols)
  q_blk = lambda b, hk, ki, t, idx: idx[ts.entry(b, hk, ki, lax.rem(t, ts.cols))]
  qt_map = lambda b, hk, ki, t, idx, *_: (b, q_blk(b, hk, ki, t, idx), head(hk, t))
  k_map = lambda b, hk, ki, t, *_: (b, ki, hk)
  rowt_map = lambda b, hk, ki, t, idx, *_: (b, head(hk, t), 0, q_blk(b, hk, ki, t, idx))

  in_specs = [pl.BlockSpec((None, bq, cfg.d_pad), qt_map),
              pl.BlockSpec((None, bk, cfg.d_pad), k_map),
              pl.BlockSpec((None, bk, cfg.dv_pad), k_map),
              pl.BlockSpec((None, bq, cfg.dv_pad), qt_map),
              pl.BlockSpec((None, None, 1, bq), rowt_map),
              pl.BlockSpec((None, None, 1, bq), rowt_map)]
  operands = [q3, k3, v3, do3, lse_rows, di_rows]
  if cfg.segmented:
    in_specs += [pl.BlockSpec((None, bk, NUM_LANES), lambda b, hk, ki, t, *_: (b, ki, 0)),
                 pl.BlockSpec((None, NUM_SUBLANES, bq),
                              lambda b, hk, ki, t, idx, *_: (b, 0, q_blk(b, hk, ki, t, idx)))]
    operands += [kv_lanes, q_rows]
  dk3, dv3 = _call(
      functools.partial(_dkv_kernel, cfg=cfg, sched=ts), cfg,
      (schedule.q_indices, schedule.q_counts, schedule.q_partial), operands,
      grid=(cfg.batch, cfg.kv_heads, cfg.nk, g * ts.cols), in_specs=in_specs,
      out_specs=[pl.BlockSpec((None, bk, cfg.d_pad), k_map),
                 pl.BlockSpec((None, bk, cfg.dv_pad), k_map)],
      scratch=[pltpu.VMEM((bk, cfg.d_pad), jnp.float32),
               pltpu.VMEM((bk, cfg.dv_pad), jnp.float32)],
      out_shape=[jax.ShapeDtypeStruct(k3.shape, dt), jax.ShapeDtypeStruct(v3.shape, dt)],
      name="jattn_flash_bwd_dkv_tpu")
  return (_from_tiles(dq3, cfg.q_len, cfg.q_heads, cfg.head_dim).astype(q.dtype),
          _from_tiles(dk3, cfg.kv_len, cfg.kv_heads, cfg.head_dim).astype(k.dtype),
          _from_tiles(dv3, cfg.kv_len, cfg.kv_heads, cfg.head_dim_v).astype(v.dtype))


_flash = jax.custom_vjp(_fwd, nondiff_argnums=(6,))


def _flash_fwd(q, k, v, q_seg, kv_seg, schedule, cfg):
  out, lse = _fwd(q, k, v, q_seg, kv_seg, schedule, cfg)
  return (out, lse), (q, k, v, q_seg, kv_seg, schedule, out, lse)


def _flash_bwd(cfg, res, cts):
  q, k, v, q_seg, kv_seg, schedule, out, lse = res
  # Segment ids and the schedule are integer arrays: no cotangent.
  return (*_bwd(q, k, v, q_seg, kv_seg, schedule, out, lse, *cts, cfg), None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q, k, v, q_segment_ids, kv_segment_ids, schedule: BlockSchedule, *,
                    causal: bool, local_window_size, scale: float | None,
                    logits_soft_cap: float | None, interpret: bool = False):
  """Flash attention on TPU (Pallas Mosaic), differentiable (custom VJP), walking a block schedule.

  Args:
    q, k, v, q_segment_ids, kv_segment_ids, causal, local_window_size, scale, logits_soft_cap:
      as for ``reference.attention_reference`` (segment ids: both or neither); fp32, bf16 or
      fp16 (K/V never repeated for GQA).
    schedule: ``make_schedule(q_len, kv_len, block_q, block_k, ...)`` of the same mask (causal,
      window, segment ids, optional block mask), tiles multiples of 128 (``default_block_sizes``).
      Tiles not in it are never read.
    interpret: run the kernels on the CPU with ``pltpu.InterpretParams()``.

  Returns:
    (out, lse) as ``reference.attention_reference``, differentiable in q, k, v through both.

  Example:
    >>> from pallas_kernels.block_schedule import make_schedule
    >>> q = jax.random.normal(jax.random.key(0), (1, 200, 2, 64))
    >>> bs = default_block_sizes(64, q.dtype)
    >>> sched = make_schedule(200, 200, bs.block_q, bs.block_k, causal=True)
    >>> out, lse = flash_attention(q, q, q, None, None, sched, causal=True, local_window_size=None,
    ...                            scale=None, logits_soft_cap=None, interpret=True)
    >>> out.shape, lse.shape
    ((1, 200, 2, 64), (1, 2, 200))
  """
  for name, x in (("q", q), ("k", k), ("v", v)):
    if getattr(x, "ndim", None) != 4:
      raise ValueError(f"{name} must be [batch, seq, heads, head_dim], got shape "
                       f"{getattr(x, 'shape', None)}")
    check_float(name, x)
  b, sq, hq, d = q.shape
  _, sk, hk, dv = v.shape
  if k.shape != (b, sk, hk, d):
    raise ValueError(f"k must be [batch, kv_len, kv_heads, head_dim] = {(b, sk, hk, d)}, "
                     f"got {k.shape} (q {q.shape}, v {v.shape})")
  if hq % hk:
    raise ValueError(f"q_heads ({hq}) must be a multiple of kv_heads ({hk})")
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("q_segment_ids and kv_segment_ids must be given together")
  for p, ids, n in (("q", q_segment_ids, sq), ("kv", kv_segment_ids, sk)):
    if ids is not None and ids.shape != (b, n):
      raise ValueError(f"{p}_segment_ids must be [batch, {p}_len] = {(b, n)}, got {ids.shape}")
    if ids is not None and not jnp.issubdtype(ids.dtype, jnp.integer):
      raise TypeError("segment ids must be integer arrays")
  check_schedule_args(schedule, q.shape, k.shape)
  BlockSizes(schedule.block_q, schedule.block_k)  # validates the tile sizes
  for arr, rows, lead in ((schedule.kv_indices, schedule.num_q_blocks, "kv"),
                          (schedule.q_indices, schedule.num_kv_blocks, "q")):
    bs_, hs_, r_, _ = arr.shape
    if bs_ not in (1, b) or hs_ not in (1, hk) or r_ != rows:
      raise ValueError(f"schedule {lead}_indices has shape {arr.shape}; expected "
                       f"[1 or {b}, 1 or {hk}, {rows}, n]")
  scale = 1.0 / math.sqrt(d) if scale is None else scale
  cfg = _Config(batch=b, q_heads=hq, kv_heads=hk, q_len=sq, kv_len=sk, head_dim=d, head_dim_v=dv,
                block_q=schedule.block_q, block_k=schedule.block_k, causal=bool(causal),
                window=normalize_window(local_window_size), scale=float(scale),
                soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
                segmented=q_segment_ids is not None, interpret=bool(interpret))
  q_seg, kv_seg = (None if x is None else x.astype(jnp.int32)
                   for x in (q_segment_ids, kv_segment_ids))
  return _flash(q, k, v, q_seg, kv_seg, schedule, cfg)


__all__ = ["BlockSizes", "default_block_sizes", "flash_attention"]
