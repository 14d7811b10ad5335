"""Split-KV decode attention for TPU (Pallas Mosaic), contiguous and paged caches
(docs/decode.md, "Implementations"). Grid (batch, split, step): a step DMAs the K and V of
``block_k`` tokens with every kv head as ``[tokens * kv_heads, head_dim]`` rows (one block or
whole pages), and a static loop over kv heads takes each head's rows by a strided sublane load.
Steps past a split's range repeat the previous block index (no DMA) and skip the compute.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import compat
from pallas_kernels.decode.checks import check_page_table, check_partials_args

__all__ = ["DecodeBlockSizes", "decode_partials", "paged_decode_partials"]

LANES = 128


@dataclasses.dataclass(frozen=True)
class DecodeBlockSizes:
  """Tiling of the Mosaic TPU decode kernel.

  Attributes:
    block_k: tokens per grid step (a multiple of 8); the paged kernel takes
      ``max(1, block_k // page_size)`` whole pages per step.

  Example:
    >>> DecodeBlockSizes(block_k=512).block_k
    512
  """
  block_k: int = 256

  def __post_init__(self):
    if self.block_k < 8 or self.block_k % 8:
      raise ValueError(f"block_k must be a positive multiple of 8, got {self.block_k}")


def _div(a, b):
  """a // b for non-negative int32 scalars (truncating division lowers without sign ops)."""
  return jax.lax.div(a, jnp.int32(b))


def _split_range(length, split, *, window_left, block_k, num_splits, capacity):
  """Scalars: the clamped length, the first visible key and the split's key blocks [begin, stop)."""
  length = jnp.clip(length, 0, capacity)
  lo = jnp.int32(0) if window_left is None else jnp.maximum(length - 1 - window_left, 0)
  first = _div(lo, block_k)
  end = _div(length + block_k - 1, block_k)                   # one past the last block
  n_blocks = jnp.maximum(end - first, 0)
  per_split = _div(n_blocks + num_splits - 1, num_splits)
  begin = first + split * per_split
  stop = jnp.minimum(begin + per_split, end)
  return length, lo, begin, stop


def load_head(kv_ref, h, *, kv_heads, rows):
  """Head h's [rows, D] tile (rows h, h + kv_heads, ...) of a block, by a strided sublane load."""
  return kv_ref[...] if kv_heads == 1 else kv_ref[pl.ds(h, rows, stride=kv_heads), :]


def init_softmax(m_ref, l_ref, acc_ref):
  """Reset the online-softmax scratch: m = -inf, l = acc = 0."""
  m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
  l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
  acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def write_softmax(m_ref, l_ref, acc_ref, o_ref, lse_ref):
  """o = acc / l in o's dtype and lse = m + log(l); a row with l == 0 gets 0 and -inf."""
  l = l_ref[...]
  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  o_ref[...] = (acc_ref[...] * (1.0 / l_safe[..., :1])).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(empty, -jnp.inf, m_ref[...] + jnp.log(l_safe))


def _decode_kernel(*refs, scale, soft_cap, window_left, block_k, kv_heads, g_pad, num_splits,
                   capacity, num_steps, num_prefetch, refs_per_step):
  """refs: lens [, page_table] (SMEM), q [Hk, g_pad, D], ``refs_per_step`` K refs and as many V
  refs [block_k / refs_per_step * Hk, D | Dv] (a block, or a page each); outputs o [Hk, g_pad,
  Dv], lse [Hk, g_pad, LANES]; scratch m, l [Hk, g_pad, LANES], acc [Hk, g_pad, Dv]."""
  lens_ref, q_ref = refs[0], refs[num_prefetch]
  kv_in = refs[num_prefetch + 1:num_prefetch + 1 + 2 * refs_per_step]
  k_refs, v_refs = kv_in[:refs_per_step], kv_in[refs_per_step:]
  o_ref, lse_ref, m_ref, l_ref, acc_ref = refs[num_prefetch + 1 + 2 * refs_per_step:]
  rows = block_k // refs_per_step                                   # tokens per ref
  b, split, step = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  length, lo, begin, stop = _split_range(lens_ref[b], split, window_left=window_left,
                                         block_k=block_k, num_splits=num_splits,
                                         capacity=capacity)

  def head_tile(kv_refs, h):                                        # [block_k, D]
    tiles = [load_head(r, h, kv_heads=kv_heads, rows=rows) for r in kv_refs]
    return tiles[0] if len(tiles) == 1 else jnp.concatenate(tiles, axis=0)

  pl.when(step == 0)(lambda: init_softmax(m_ref, l_ref, acc_ref))
  blk = begin + step

  @pl.when(blk < stop)
  def _compute():
    pos = blk * block_k + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)   # [1, bk]
    valid = (pos < length) & (pos >= lo)
    pos_rows = blk * block_k + jax.lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)  # [bk, 1]
    valid_rows = (pos_rows < length) & (pos_rows >= lo)
    for h in range(kv_heads):
      q = q_ref[h]                                                               # [g_pad, D]
      k = head_tile(k_refs, h)                                                   # [bk, D]
      s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                              preferred_element_type=jnp.float32) * scale        # [g_pad, bk]
      if soft_cap is not None:
        s = soft_cap * jnp.tanh(s * (1.0 / soft_cap))
      s = jnp.where(valid, s, -jnp.inf)
      m_prev = m_ref[h]                                                          # [g_pad, L]
      m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))             # [g_pad, L]
      alpha = jnp.exp(m_prev - m_new)
      p = jnp.exp(s - m_new[:, :1])                                              # [g_pad, bk]
      l_ref[h] = alpha * l_ref[h] + jnp.sum(p, axis=1, keepdims=True)
      m_ref[h] = m_new
      v = head_tile(v_refs, h)                                                   # [bk, Dv]
      v = jnp.where(valid_rows, v, jnp.zeros_like(v))   # hidden rows may hold NaN or garbage
      pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)               # [g_pad, Dv]
      acc_ref[h] = acc_ref[h] * alpha[:, :1] + pv

  pl.when(step == num_steps - 1)(lambda: write_softmax(m_ref, l_ref, acc_ref, o_ref, lse_ref))


def group_queries(q, kv_heads, dtype):
  """(q4 [batch, kv_heads, g_pad, head_dim] in ``dtype``, group, g_pad): each kv head's GQA group
  of query rows, zero padded to a multiple of the sublane tile (8 rows of 32-bit, 16 of 16-bit
  values)."""
  bsz, hq, d = q.shape
  group = hq // kv_heads
  sub = 8 if jnp.dtype(dtype).itemsize == 4 else 16
  g_pad = -(-group // sub) * sub
  q4 = q.astype(dtype).reshape(bsz, kv_heads, group, d)
  if g_pad != group:
    q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, g_pad - group), (0, 0)))
  return q4, group, g_pad


def _call(q, k, v, kv_lengths, page_table, *, num_splits, scale, window_left, logits_soft_cap,
          block_sizes, interpret):
  """Checks, then the kernel; k, v [batch or pages, tokens, Hk, D | Dv] as rows t * Hk + h."""
  check_partials_args(q, k, v, kv_lengths, num_splits)
  if jnp.dtype(k.dtype).itemsize not in (2, 4):
    raise NotImplementedError(f"mosaic_tpu decode supports 16- and 32-bit caches, got {k.dtype}")
  block_k, pages_per_step = (block_sizes or DecodeBlockSizes()).block_k, 1
  if page_table is None:
    capacity = k.shape[1]
    block_k = min(block_k, capacity)                               # == max_len: full row dim
  else:
    check_page_table(q, page_table)
    page_size, max_pages = k.shape[1], page_table.shape[1]
    pages_per_step = max(1, min(block_k // page_size, max_pages))
    block_k, capacity = pages_per_step * page_size, max_pages * page_size
    page_table = jnp.clip(page_table.astype(jnp.int32), 0, k.shape[0] - 1)
  bsz, hq, d = q.shape
  n, tokens, kv_heads, dv = v.shape
  k2, v2 = k.reshape(n, tokens * kv_heads, d), v.reshape(n, tokens * kv_heads, dv)
  kv_lengths = kv_lengths.astype(jnp.int32)
  q4, group, g_pad = group_queries(q, kv_heads, k2.dtype)          # dots in the cache dtype
  scale = 1.0 / math.sqrt(d) if scale is None else scale
  num_steps = -(-(-(-capacity // block_k)) // num_splits)          # blocks per split, at most
  kw = dict(window_left=window_left, block_k=block_k, num_splits=num_splits, capacity=capacity)
  paged = page_table is not None
  prefetch = (kv_lengths, page_table) if paged else (kv_lengths,)
  rows = block_k // pages_per_step * kv_heads                      # rows of one K/V ref

  def kv_map(p):   # contiguous: block blk of row b; paged: the blk-th step's p-th page
    def index_map(b, s, j, lens_ref, *table_ref):
      _, _, begin, stop = _split_range(lens_ref[b], s, **kw)
      blk = jnp.maximum(jnp.minimum(begin + j, stop - 1), 0)   # clamped: no DMA past the split
      if not paged:
        return (b, blk, 0)
      return (table_ref[0][b, jnp.minimum(blk * pages_per_step + p, page_table.shape[1] - 1)], 0, 0)
    return index_map
  out_map = lambda b, s, j, *_: (b, s, 0, 0, 0)

  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=len(prefetch),
      grid=(bsz, num_splits, num_steps),
      in_specs=[pl.BlockSpec((None, kv_heads, g_pad, d), lambda b, s, j, *_: (b, 0, 0, 0)),
                *(pl.BlockSpec((None, rows, d), kv_map(p)) for p in range(pages_per_step)),
                *(pl.BlockSpec((None, rows, dv), kv_map(p)) for p in range(pages_per_step))],
      out_specs=[pl.BlockSpec((None, None, kv_heads, g_pad, dv), out_map),
                 pl.BlockSpec((None, None, kv_heads, g_pad, LANES), out_map)],
      scratch_shapes=[pltpu.VMEM((kv_heads, g_pad, LANES), jnp.float32),
                      pltpu.VMEM((kv_heads, g_pad, LANES), jnp.float32),
                      pltpu.VMEM((kv_heads, g_pad, dv), jnp.float32)],
  )
  kernel = functools.partial(
      _decode_kernel, scale=float(scale),
      soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
      kv_heads=kv_heads, g_pad=g_pad, num_steps=num_steps, num_prefetch=len(prefetch),
      refs_per_step=pages_per_step, **kw)
  o, lse = pl.pallas_call(
      kernel, grid_spec=grid_spec,
      out_shape=[jax.ShapeDtypeStruct((bsz, num_splits, kv_heads, g_pad, dv), jnp.float32),
                 jax.ShapeDtypeStruct((bsz, num_splits, kv_heads, g_pad, LANES), jnp.float32)],
      compiler_params=compat.tpu_compiler_params(("parallel", "parallel", "arbitrary")),
      interpret=compat.tpu_interpret_params() if interpret else False,
      name="jattn_paged_decode_tpu" if paged else "jattn_decode_tpu",
  )(*prefetch, q4, *([k2] * pages_per_step), *([v2] * pages_per_step))
  return (o[:, :, :, :group].reshape(bsz, num_splits, hq, dv),
          lse[:, :, :, :group, 0].reshape(bsz, num_splits, hq))


@functools.partial(jax.jit, static_argnames=(
    "num_splits", "scale", "window_left", "logits_soft_cap", "block_sizes", "interpret"))
def decode_partials(q, k_cache, v_cache, kv_lengths, *, num_splits, scale=None, window_left=None,
                    logits_soft_cap=None, block_sizes=None, interpret=False):
  """Per-split partial decode attention over a contiguous cache (Mosaic TPU kernel).

  Args:
    q, kv_lengths, num_splits, scale, window_left, logits_soft_cap: as the Triton kernel's
      (``pallas_kernels.decode.triton.decode_partials``).
    k_cache, v_cache: [batch, max_len, kv_heads, head_dim | head_dim_v], one dtype (fp32, bf16
      or fp16).
    block_sizes: ``DecodeBlockSizes`` or None.
    interpret: run in the TPU interpreter (``pltpu.InterpretParams()``) on CPU.

  Returns:
    (out [batch, num_splits, q_heads, head_dim_v] fp32, lse [batch, num_splits, q_heads] fp32).

  Example:
    >>> q = jnp.ones((1, 4, 128)); k = jnp.ones((1, 64, 2, 128))
    >>> o, lse = decode_partials(q, k, k, jnp.array([40], jnp.int32), num_splits=2,
    ...                          interpret=True)
    >>> o.shape
    (1, 2, 4, 128)
  """
  return _call(q, k_cache, v_cache, kv_lengths, None, num_splits=num_splits, scale=scale,
               window_left=window_left, logits_soft_cap=logits_soft_cap, block_sizes=block_sizes,
               interpret=interpret)


@functools.partial(jax.jit, static_argnames=(
    "num_splits", "scale", "window_left", "logits_soft_cap", "block_sizes", "interpret"))
def paged_decode_partials(q, k_pages, v_pages, page_table, kv_lengths, *, num_splits, scale=None,
                          window_left=None, logits_soft_cap=None, block_sizes=None,
                          interpret=False):
  """Per-split partial decode attention over a paged cache (Mosaic TPU kernel); each grid step
  DMAs ``block_sizes.block_k // page_size`` pages (at least one) of K and of V.

  Args:
    q, kv_lengths, num_splits, scale, window_left, logits_soft_cap, interpret: as in
      :func:`decode_partials`.
    k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim | head_dim_v], one dtype;
      page_size * kv_heads a multiple of 8 (16 for 16-bit dtypes).
    page_table: int32 [batch, max_pages] (entries past a sequence's length are clamped into
      range and never used).
    block_sizes: ``DecodeBlockSizes`` (block_k / page_size pages per step) or None.

  Returns:
    As :func:`decode_partials`.

  Example:
    >>> q = jnp.ones((1, 4, 128)); pages = jnp.ones((3, 16, 2, 128))
    >>> o, lse = paged_decode_partials(q, pages, pages, jnp.array([[2, 0]], jnp.int32),
    ...                                jnp.array([20], jnp.int32), num_splits=2, interpret=True)
    >>> o.shape
    (1, 2, 4, 128)
  """
  return _call(q, k_pages, v_pages, kv_lengths, page_table, num_splits=num_splits, scale=scale,
               window_left=window_left, logits_soft_cap=logits_soft_cap, block_sizes=block_sizes,
               interpret=interpret)
