"""Split-KV decode attention in portable Pallas GPU (Triton lowering), contiguous and paged
(docs/decode.md, "Implementations"). A program per (batch, kv head, split) holds the GQA group's
query rows as one tile, walks its split ``block_k`` keys a step (paged: rows gathered through the
page table) and writes one partial (out, lse) that ``pallas_kernels.common.merge`` merges.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import compat
from pallas_kernels.common.util import next_pow2
from pallas_kernels.decode.checks import check_page_table, check_partials_args

__all__ = ["DecodeBlockSizes", "decode_partials", "default_block_sizes", "default_num_splits",
           "paged_decode_partials"]


@dataclasses.dataclass(frozen=True)
class DecodeBlockSizes:
  """Tiling of the Triton decode kernel.

  Attributes:
    block_k: keys per inner-loop step (a power of two >= 16).
    num_warps: warps per program.
    num_stages: software-pipelining depth of the K/V loads.

  Example:
    >>> DecodeBlockSizes(block_k=128).num_warps
    4
  """
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 3

  def __post_init__(self):
    if self.block_k < 16 or self.block_k & (self.block_k - 1):
      raise ValueError(f"block_k must be a power of two >= 16, got {self.block_k}")


def default_block_sizes(head_dim, dtype):
  """Block sizes used when none are given: num_stages=3 and the largest block_k <= 128 whose K
  tile fits 16 KiB.

  Args:
    head_dim, dtype: head dimension (padded to a power of two inside the kernel), cache dtype.

  Returns:
    A ``DecodeBlockSizes``.

  Example:
    >>> default_block_sizes(128, jnp.bfloat16).block_k
    64
  """
  d_pad = next_pow2(head_dim, minimum=16)
  itemsize = jnp.dtype(dtype).itemsize
  block_k = 128
  while block_k > 16 and block_k * d_pad * itemsize > 16 * 1024:
    block_k //= 2
  return DecodeBlockSizes(block_k=block_k, num_warps=4, num_stages=3)


def default_num_splits(batch, kv_heads, max_len, *, core_count=None, block_k=64,
                       tokens_per_split=1024, max_splits=32):
  """Heuristic split count for a cache of capacity ``max_len`` (docs/decode.md, "Implementations"):
  one wave for one sequence, two programs per multiprocessor and at most about
  ``tokens_per_split`` keys a split for a batch; >= 4 key blocks a split, a power of two.

  Args:
    batch, kv_heads, max_len: the (batch, kv head) pairs and the cache capacity in tokens.
    core_count: multiprocessors; default ``compat.gpu_core_count()``.
    block_k, tokens_per_split, max_splits: keys per step, split-size target, most splits.

  Returns:
    An int >= 1.

  Example:
    >>> [default_num_splits(b, 8, n, core_count=132) for b, n in ((1, 131072), (8, 32768))]
    [16, 32]
  """
  cores = compat.gpu_core_count() if core_count is None else int(core_count)
  pairs = max(1, batch * kv_heads)
  want = (-(-cores // pairs) if batch == 1
          else max(-(-2 * cores // pairs), -(-max_len // tokens_per_split)))
  splits = max(1, min(want, -(-max_len // (4 * block_k)), max_splits))   # >= 4 blocks a split
  if splits > 1:  # a power of two divides the block count of power-of-two caches evenly
    splits = 1 << (splits.bit_length() - 1)
  return splits


def load_group_query(q_ref, b, h, *, group, g_pad, head_dim, d_pad):
  """kv head ``h``'s GQA query rows as one zero-padded [g_pad, d_pad] tile, and (q_rows, cols,
  row_ok, col_ok or None when unpadded, q_mask) that also address the group's output rows."""
  rows = jnp.arange(g_pad, dtype=jnp.int32)                          # [g_pad]
  cols = jnp.arange(d_pad, dtype=jnp.int32)                          # [d_pad]
  row_ok = rows < group
  col_ok = cols < head_dim if d_pad != head_dim else None
  q_rows = h * group + rows
  q_mask = row_ok[:, None] if col_ok is None else row_ok[:, None] & col_ok[None, :]
  q = plgpu.load(q_ref.at[b, q_rows[:, None], cols[None, :]], mask=q_mask, other=0)
  assert q.shape == (g_pad, d_pad)                                   # [g_pad, d_pad]
  return q, (q_rows, cols, row_ok, col_ok, q_mask)


def _decode_kernel(*refs, scale, soft_cap, window_left, block_k, group, g_pad, head_dim, d_pad,
                   head_dim_v, dv_pad, num_splits, capacity, page_size, batch, scheduled,
                   unified, masked):
  """One (batch, kv head, split) program, or with ``scheduled`` one (unit, kv head) program.
  Refs: lens [B]; q [B, Hq, D]; k, v [B, N, Hk, D | Dv] (paged: [P * page_size, Hk, D | Dv]);
  then, as enabled, page table, the units' (row, first block, count) [U], m_hat [B, Hq] and the
  program mask [P0, P1, Hk]; outputs as ``decode_partials``' (o, lse) or (acc, l, mx)."""
  it = iter(refs)
  lens_ref, q_ref, k_ref, v_ref = (next(it) for _ in range(4))
  pt_ref = None if page_size is None else next(it)
  unit_refs = tuple(next(it) for _ in range(3)) if scheduled else None
  mhat_ref = next(it) if unified else None
  act_ref = next(it) if masked else None
  o_ref, lse_ref = next(it), next(it)
  mx_ref = next(it) if unified else None
  h = pl.program_id(1)
  if scheduled:
    pb, ps = jnp.int32(0), pl.program_id(0)
    b = jnp.clip(plgpu.load(unit_refs[0].at[ps]), 0, batch - 1)
  else:
    b, ps = pl.program_id(0), pl.program_id(2)
    pb = b

  length = jnp.maximum(jnp.minimum(plgpu.load(lens_ref.at[b]), capacity), 0)   # scalar
  lo = jnp.int32(0) if window_left is None else jnp.maximum(length - 1 - window_left, 0)
  if scheduled:   # the unit's key blocks [first, first + count) of the block grid
    base = plgpu.load(unit_refs[1].at[ps]) * block_k
    blk_begin, blk_end = jnp.int32(0), plgpu.load(unit_refs[2].at[ps])
  else:           # an equal share of the visible blocks, counted from lo
    base = lo
    n_blocks = pl.cdiv(jnp.maximum(length - lo, 0), block_k)
    per_split = pl.cdiv(n_blocks, num_splits)
    blk_begin = jnp.minimum(ps * per_split, n_blocks)
    blk_end = jnp.minimum(blk_begin + per_split, n_blocks)
  if masked:
    blk_end = jnp.where(plgpu.load(act_ref.at[pb, ps, h]) != 0, blk_end, blk_begin)

  q, (q_rows, cols, row_ok, col_ok, _) = load_group_query(
      q_ref, b, h, group=group, g_pad=g_pad, head_dim=head_dim, d_pad=d_pad)  # [g_pad, d_pad]
  q = q.astype(k_ref.dtype)          # the dots run in the cache dtype, accumulating in fp32
  precision = jax.lax.Precision.HIGHEST if k_ref.dtype == jnp.float32 else None
  offs = jnp.arange(block_k, dtype=jnp.int32)                        # [block_k]
  vcols = jnp.arange(dv_pad, dtype=jnp.int32)                        # [dv_pad]
  vcol_ok = vcols < head_dim_v if dv_pad != head_dim_v else None
  o_mask = row_ok[:, None] if vcol_ok is None else row_ok[:, None] & vcol_ok[None, :]
  inv_cap = None if soft_cap is None else 1.0 / soft_cap
  if unified:
    m_fix = plgpu.load(mhat_ref.at[b, q_rows], mask=row_ok, other=0.0)  # [g_pad]

  def rows_of(pos, valid):
    """Paged: cache rows of tokens ``pos`` through the page table (a small int32 gather)."""
    page = plgpu.load(pt_ref.at[b, pos // page_size], mask=valid, other=0)      # [block_k]
    page = jnp.clip(page, 0, k_ref.shape[0] // page_size - 1)   # ids outside the pool: clamped
    return page * page_size + pos % page_size

  def body(i, carry):
    acc, m_prev, l_prev, krow = carry
    pos = base + i * block_k + offs                                  # [block_k] token index
    valid = (pos >= lo) & (pos < length)
    kv_mask = valid[:, None] if col_ok is None else valid[:, None] & col_ok[None, :]
    v_mask = valid[:, None] if vcol_ok is None else valid[:, None] & vcol_ok[None, :]
    if pt_ref is None:
      at, krow_next = (b, pos[:, None], h), krow                     # K/V index, less the column
    else:
      # The rows of block i arrive through the loop carry and block i + 1's are looked up
      # here: the K/V addresses never wait on a table load of the same iteration, and Triton
      # double-buffers the K/V copies exactly as in the contiguous case.
      pos_next = pos + block_k
      krow_next = rows_of(pos_next, pos_next < length)
      at = (krow[:, None], h)
    k = plgpu.load(k_ref.at[(*at, cols[None, :])], mask=kv_mask, other=0)
    s = plgpu.dot(q, k, trans_b=True, precision=precision) * scale   # [g_pad, block_k] fp32
    if soft_cap is not None:
      s = soft_cap * jnp.tanh(s * inv_cap)
    s = jnp.where(valid[None, :], s, -jnp.inf)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))                   # [g_pad]
    if unified:   # one fixed reference: no rescaling; m only records the max logit
      p = jnp.exp(s - m_fix[:, None])                                # [g_pad, block_k]
      l_new = l_prev + jnp.sum(p, axis=1)
    else:         # every visited block holds >= 1 visible key: m_new is finite
      alpha = jnp.exp(m_prev - m_new)
      p = jnp.exp(s - m_new[:, None])                                # [g_pad, block_k]
      l_new = l_prev * alpha + jnp.sum(p, axis=1)
      acc = acc * alpha[:, None]
    v = plgpu.load(v_ref.at[(*at, vcols[None, :])], mask=v_mask, other=0)
    pv = plgpu.dot(p.astype(v.dtype), v, precision=precision)        # [g_pad, dv_pad]
    return acc + pv, m_new, l_new, krow_next

  acc0 = jnp.zeros((g_pad, dv_pad), jnp.float32)
  m0 = jnp.full((g_pad,), -jnp.inf, jnp.float32)
  l0 = jnp.zeros((g_pad,), jnp.float32)
  if pt_ref is None:
    krow0 = jnp.zeros((), jnp.int32)                                 # unused
  else:
    pos0 = base + blk_begin * block_k + offs
    krow0 = rows_of(pos0, (pos0 < length) & (blk_begin < blk_end))
  acc, m, l, _ = jax.lax.fori_loop(blk_begin, blk_end, body, (acc0, m0, l0, krow0))

  if unified:
    out, second = acc, l
    plgpu.store(mx_ref.at[pb, ps, q_rows], m, mask=row_ok)
  else:
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    out = acc * (1.0 / l_safe)[:, None]                              # zeros when empty
    second = jnp.where(empty, -jnp.inf, m + jnp.log(l_safe))
  plgpu.store(o_ref.at[pb, ps, q_rows[:, None], vcols[None, :]], out, mask=o_mask)
  plgpu.store(lse_ref.at[pb, ps, q_rows], second, mask=row_ok)


def _call(q, k, v, kv_lengths, page_table, *, num_splits, scale, window_left, logits_soft_cap,
          block_sizes, interpret, units, m_hat, active):
  """Checks, then the kernel on a contiguous cache or (``page_table``) on page pools."""
  check_partials_args(q, k, v, kv_lengths, num_splits or 1)
  kv_heads, capacity, page_size = k.shape[2], k.shape[1], None
  if page_table is not None:   # the pools as [num_pages * page_size, kv_heads, D | Dv] rows
    check_page_table(q, page_table)
    page_size, capacity = k.shape[1], page_table.shape[1] * k.shape[1]
    k, v = (x.reshape(-1, *x.shape[2:]) for x in (k, v))
  bsz, hq, d = q.shape
  dv = v.shape[-1]
  group = hq // kv_heads
  g_pad, d_pad, dv_pad = (next_pow2(n, minimum=16) for n in (group, d, dv))
  bs = block_sizes or default_block_sizes(max(d, dv), k.dtype)
  scale = 1.0 / math.sqrt(d) if scale is None else scale
  p0, p1 = (bsz, num_splits) if units is None else (1, units[0].shape[0])
  grid = (bsz, kv_heads, num_splits) if units is None else (p1, kv_heads)
  if (units is None) == (num_splits is None):
    raise ValueError(f"give exactly one of num_splits and units, got {num_splits}, {units}")
  for name, x, want in (("m_hat", m_hat, (bsz, hq)), ("active", active, (p0, p1, kv_heads))):
    if x is not None and x.shape != want:
      raise ValueError(f"{name} must have shape {want}, got {x.shape}")
  kernel = functools.partial(
      _decode_kernel, scale=float(scale),
      soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
      window_left=window_left, block_k=bs.block_k, group=group, g_pad=g_pad, head_dim=d,
      d_pad=d_pad, head_dim_v=dv, dv_pad=dv_pad, num_splits=num_splits, capacity=capacity,
      page_size=page_size, batch=bsz, scheduled=units is not None, unified=m_hat is not None,
      masked=active is not None)
  out_shape = [jax.ShapeDtypeStruct((p0, p1, hq, dv), jnp.float32),   # partial out (or acc)
               jax.ShapeDtypeStruct((p0, p1, hq), jnp.float32)]       # partial lse (or l)
  if m_hat is not None:
    out_shape.append(jax.ShapeDtypeStruct((p0, p1, hq), jnp.float32))  # max logit
  args = [kv_lengths.astype(jnp.int32), q, k, v]   # then the optional refs, in kernel order
  args += [x.astype(jnp.float32 if x is m_hat else jnp.int32)
           for x in (page_table, *(units or ()), m_hat, active) if x is not None]
  name = "jattn_paged_decode" if page_table is not None else "jattn_decode"
  return tuple(pl.pallas_call(
      kernel, out_shape=out_shape, grid=grid,
      compiler_params=compat.triton_compiler_params(num_warps=bs.num_warps,
                                                    num_stages=bs.num_stages),
      interpret=interpret, name=name)(*args))


@functools.partial(jax.jit, static_argnames=(
    "num_splits", "scale", "window_left", "logits_soft_cap", "block_sizes", "interpret"))
def decode_partials(q, k_cache, v_cache, kv_lengths, *, num_splits=None, scale=None,
                    window_left=None, logits_soft_cap=None, block_sizes=None, interpret=False,
                    units=None, m_hat=None, active=None):
  """Per-split partial decode attention over a contiguous cache (Triton kernel).

  Args:
    q: [batch, q_heads, head_dim].
    k_cache, v_cache: [batch, max_len, kv_heads, head_dim | head_dim_v], one dtype (bf16, fp16
      or fp32).
    kv_lengths: int32 [batch]; the query sits at position kv_lengths - 1.
    num_splits: number of splits of each sequence's visible key range (None with ``units``).
    scale: logit scale, default 1/sqrt(head_dim).
    window_left: None or the left window size (keys >= kv_lengths - 1 - window_left are seen).
    logits_soft_cap: None or cap.
    block_sizes: ``DecodeBlockSizes`` or None for the defaults.
    interpret: run the kernel in the Pallas interpreter (CPU tests).
    units: None, or int32 arrays (row [U], first block [U], block count [U]) of a length-balanced
      schedule in blocks of ``block_k`` keys: one program per (unit, kv head) instead of
      (batch, kv head, split); units with count 0 read nothing.
    m_hat: None, or fp32 [batch, q_heads]: the shared max estimate of the unified-max softmax.
    active: None, or int32 [P0, P1, kv_heads] (P0, P1 as the partials' leading dims): programs
      at 0 read nothing.

  Returns:
    (out [P0, P1, q_heads, head_dim_v] fp32, lse [P0, P1, q_heads] fp32) with (P0, P1) =
    (batch, num_splits), or (1, U) with ``units``; partials with no visible key hold out 0
    and lse -inf. With ``m_hat``: (acc, l, mx): the unnormalised sums of exp(s - m_hat) * v
    and exp(s - m_hat) and each partial's max logit (-inf when empty).

  Example:
    >>> q = jnp.ones((1, 4, 16)); k = jnp.ones((1, 64, 2, 16))
    >>> o, lse = decode_partials(q, k, k, jnp.array([40], jnp.int32), num_splits=2,
    ...                          interpret=True)
    >>> o.shape, lse.shape
    ((1, 2, 4, 16), (1, 2, 4))
  """
  return _call(q, k_cache, v_cache, kv_lengths, None, num_splits=num_splits, scale=scale,
               window_left=window_left, logits_soft_cap=logits_soft_cap, block_sizes=block_sizes,
               interpret=interpret, units=units, m_hat=m_hat, active=active)


@functools.partial(jax.jit, static_argnames=(
    "num_splits", "scale", "window_left", "logits_soft_cap", "block_sizes", "interpret"))
def paged_decode_partials(q, k_pages, v_pages, page_table, kv_lengths, *, num_splits=None,
                          scale=None, window_left=None, logits_soft_cap=None, block_sizes=None,
                          interpret=False, units=None, m_hat=None, active=None):
  """Per-split partial decode attention over a paged cache (Triton kernel).

  Args:
    q, kv_lengths, num_splits, scale, window_left, logits_soft_cap, block_sizes, interpret, units,
      m_hat, active: as in :func:`decode_partials` (lengths clamped to max_pages * page_size).
    k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim | head_dim_v], one dtype.
    page_table: int32 [batch, max_pages]; token t of sequence b is in page
      ``page_table[b, t // page_size]``, slot ``t % page_size``.

  Returns:
    As :func:`decode_partials`.

  Example:
    >>> q = jnp.ones((1, 4, 16)); pages = jnp.ones((3, 16, 2, 16))
    >>> o, lse = paged_decode_partials(q, pages, pages, jnp.array([[2, 0]], jnp.int32),
    ...                                jnp.array([20], jnp.int32), num_splits=2, interpret=True)
    >>> o.shape
    (1, 2, 4, 16)
  """
  return _call(q, k_pages, v_pages, kv_lengths, page_table, num_splits=num_splits, scale=scale,
               window_left=window_left, logits_soft_cap=logits_soft_cap, block_sizes=block_sizes,
               interpret=interpret, units=units, m_hat=m_hat, active=active)
