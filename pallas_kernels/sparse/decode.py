"""Top-K block-sparse decode in portable Pallas GPU (Triton lowering), contiguous and paged.

One program per (batch, kv head, split): a split walks a share of the first ``counts[b, h]``
slots of its own block list ``indices[b, h, :]`` (-1: unused) with an fp32 online softmax, the
GQA group's queries in one tile (each kept K/V byte read once). The last split to arrive merges
the partials (or ``merge_partials_pallas`` with ``merge_kernel=True``).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import compat
from pallas_kernels.common.merge import merge_partials_pallas, store_merged_heads
from pallas_kernels.common.util import next_pow2
from pallas_kernels.decode.triton import load_group_query

# The documented API; the length helpers serve the selection kernels.
__all__ = ["sparse_decode", "sparse_decode_partials", "default_num_splits"]


def length_row(b, lengths_group):
  """Row of a lengths array shared by ``lengths_group`` consecutive sequences."""
  return b if lengths_group == 1 else jax.lax.div(b, jnp.int32(lengths_group))


def check_lengths(lengths, bsz, lengths_group, name):
  """ValueError unless ``lengths`` has shape (bsz // lengths_group,)."""
  if lengths_group < 1 or bsz % lengths_group:
    raise ValueError(f"lengths_group must be >= 1 and divide the batch {bsz}, got {lengths_group}")
  if jnp.shape(lengths) != (bsz // lengths_group,):
    raise ValueError(f"{name} must have shape ({bsz // lengths_group},) (batch "
                     f"{bsz} / lengths_group {lengths_group}), got {jnp.shape(lengths)}")


def _kernel(lens_ref, idx_ref, *rest, scale, block, group, g_pad, head_dim, d_pad, head_dim_v,
            dv_pad, num_splits, num_slots, capacity, counted, paged, merge, split_stride, bps,
            prefetch_ids, len_group, unified, masked):
  """One (batch, kv head, split) program. Refs: lens [B / len_group]; idx [B, Hk, M] (-1 =
  unused); with ``counted`` cnt [B, Hk] (slots to walk); q [B, Hq, D]; k, v [B, N, Hk, D | Dv]
  or, paged, [P * block, Hk, D | Dv] with the page table [B, max_pages] next; then ``unified``'s
  m_hat [B, Hq] fp32 and ``masked``'s active [B, S, Hk] int32 (programs at 0 read nothing).
  Outputs without ``merge``: the partials o [B, S, Hq, Dv] and lse [B, S, Hq] fp32 (unified:
  acc, l and each split's max logit mx). With ``merge`` and S > 1: the input counters [B, Hk]
  int32 (aliased to the third output), then out [B, Hq, Dv], lse [B, Hq] fp32, the counters and
  the partials (HBM scratch); with S == 1 just out and lse."""
  cnt_ref, *rest = rest if counted else (None, *rest)
  q_ref, k_ref, v_ref, *rest = rest
  pt_ref, *rest = rest if paged else (None, *rest)
  mhat_ref, *rest = rest if unified else (None, *rest)
  act_ref, *rest = rest if masked else (None, *rest)
  if not merge:
    o_ref, lse_ref, *rest = rest
    mx_ref = rest[0] if unified else None
  elif num_splits == 1:
    out_ref, lse_out_ref = rest
  else:
    _, out_ref, lse_out_ref, arr_ref, o_ref, lse_ref = rest
  b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  if split_stride != 1:
    split = (split * split_stride) % num_splits
  length = jnp.clip(plgpu.load(lens_ref.at[length_row(b, len_group)]), 0, capacity)   # scalar
  n_slots = (jnp.int32(num_slots) if cnt_ref is None
             else jnp.clip(plgpu.load(cnt_ref.at[b, h]), 0, num_slots))
  per_split = _split_share(n_slots, num_splits, bps)
  begin = jnp.minimum(split * per_split, n_slots)
  end = jnp.maximum(jnp.minimum(begin + per_split, n_slots), begin)
  if masked:
    end = jnp.where(plgpu.load(act_ref.at[b, split, h]) != 0, end, begin)

  def first_row(ids):                    # first pool row of blocks ids (pages clamped into it)
    return jnp.clip(plgpu.load(pt_ref.at[b, jnp.maximum(ids, 0)]), 0,
                    k_ref.shape[0] // block - 1) * block

  if prefetch_ids:                       # the split's <= ids_pad ids, before the loop
    ids_pad = next_pow2(_split_share(num_slots, num_splits, bps), minimum=16)
    ar = jnp.arange(ids_pad, dtype=jnp.int32)
    own = ar < end - begin
    ids_vec = plgpu.load(idx_ref.at[b, h, jnp.minimum(begin + ar, num_slots - 1)], mask=own,
                         other=-1)                                           # [ids_pad]
    rows_vec = first_row(ids_vec) if paged else None

  q, (q_rows, cols, row_ok, col_ok, _) = load_group_query(
      q_ref, b, h, group=group, g_pad=g_pad, head_dim=head_dim, d_pad=d_pad)  # [g_pad, d_pad]
  precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  if unified:
    m_fix = plgpu.load(mhat_ref.at[b, q_rows], mask=row_ok, other=0.0)  # [g_pad]
  if bps == 1:
    offs = jnp.arange(block, dtype=jnp.int32)                        # [block]
  else:
    rows = jnp.arange(bps * block, dtype=jnp.int32)                  # [bps * block] tile rows
    offs = rows % block                                              # row within its block
    sub = rows // block                                              # which block of the step
  vcols = jnp.arange(dv_pad, dtype=jnp.int32)                        # [dv_pad]
  vcol_ok = vcols < head_dim_v if dv_pad != head_dim_v else None
  o_mask = row_ok[:, None] if vcol_ok is None else row_ok[:, None] & vcol_ok[None, :]

  def lookup(i):
    """Block id of loop step i's slot s (-1 when s >= end or unused) and, paged, its first cache
    row (else None); with bps > 1 (steps from 0), per tile row [bps * block], of slots s ..
    s + bps - 1."""
    s = i if bps == 1 else begin + i * bps
    if prefetch_ids:                     # from the vectors: no load in the step
      def pick(vec):                     # vec[s - begin + sub]: the step's blocks, per ``sub``
        got = jnp.sum(jnp.where(ar == s - begin, vec, 0))
        for j in range(1, bps):
          got = jnp.where(sub == j, jnp.sum(jnp.where(ar == s - begin + j, vec, 0)), got)
        return got
      blk = jnp.where(s + (sub if bps > 1 else 0) < end, pick(ids_vec), -1)
      return blk, (pick(rows_vec) if paged else None)
    blk = plgpu.load(idx_ref.at[b, h, jnp.minimum(s, num_slots - 1)])
    blk = jnp.where(s < end, blk, -1)
    return blk, (first_row(blk) if paged else None)

  lookahead = not prefetch_ids

  def body(i, carry):
    acc, m_prev, l_prev, ahead = carry   # lookahead: step i's lookup, done one step before
    nxt = lookup(i + 1) if lookahead else None
    blk, row0 = ahead if lookahead else lookup(i)                    # else from the id vector
    ok = blk >= 0
    pos = jnp.maximum(blk, 0) * block + offs                         # [bps * block] tokens
    valid = (pos < length) & ok
    kv_mask = valid[:, None] if col_ok is None else valid[:, None] & col_ok[None, :]
    v_mask = valid[:, None] if vcol_ok is None else valid[:, None] & vcol_ok[None, :]
    lead, krow = ((), row0 + offs) if paged else ((b,), pos)        # pool rows or (b, tokens)

    def load(ref, c, mask):
      return plgpu.load(ref.at[(*lead, krow[:, None], h, c[None, :])], mask=mask, other=0)
    k = load(k_ref, cols, kv_mask)
    sc = plgpu.dot(q, k, trans_b=True, precision=precision) * scale  # [g_pad, block] fp32
    sc = jnp.where(valid[None, :], sc, -jnp.inf)
    # m_new stays -inf while only unused (-1) slots have been visited: shift by 0 then.
    m_new = jnp.maximum(m_prev, jnp.max(sc, axis=1))                  # [g_pad]
    if unified:                         # the shared reference: no rescaling
      m_use, alpha = m_fix, jnp.ones_like(m_new)
    else:
      m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      alpha = jnp.exp(m_prev - m_use)
    p = jnp.exp(sc - m_use[:, None])                                 # [g_pad, block]
    l_new = l_prev * alpha + jnp.sum(p, axis=1)
    v = load(v_ref, vcols, v_mask)
    pv = plgpu.dot(p.astype(v.dtype), v, precision=precision)        # [g_pad, dv_pad]
    return acc * alpha[:, None] + pv, m_new, l_new, nxt

  init = (jnp.zeros((g_pad, dv_pad), jnp.float32), jnp.full((g_pad,), -jnp.inf, jnp.float32),
          jnp.zeros((g_pad,), jnp.float32), lookup(begin) if lookahead else None)  # acc, m, l
  lo, hi = (begin, end) if bps == 1 else (0, pl.cdiv(end - begin, bps))
  acc, m, l = jax.lax.fori_loop(lo, hi, body, init)[:3]
  if unified:                          # unnormalised sums against m_hat, and the max logit
    out, lse = acc, l
    plgpu.store(mx_ref.at[b, split, q_rows], m, mask=row_ok)
  else:
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    out = acc * (1.0 / l_safe)[:, None]                              # zeros when empty
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(l_safe))
  if merge and num_splits == 1:                                      # nothing to merge
    plgpu.store(out_ref.at[b, q_rows[:, None], vcols[None, :]], out.astype(out_ref.dtype),
                mask=o_mask)
    plgpu.store(lse_out_ref.at[b, q_rows], lse, mask=row_ok)
    return
  plgpu.store(o_ref.at[b, split, q_rows[:, None], vcols[None, :]], out, mask=o_mask)
  plgpu.store(lse_ref.at[b, split, q_rows], lse, mask=row_ok)
  if not merge:
    return
  # The split whose increment brings the counter of (b, h) to num_splits merges the partials.
  # Memory order: the atomic (acq_rel, GPU scope) is issued by one thread, so every thread's
  # stores must precede it by a CTA barrier: ``arrived`` (= 1) reduces the whole [g_pad, dv_pad]
  # tile across all warps (shared memory + a barrier after the stores) and the increment depends
  # on it. The winner's loads follow the atomic's broadcast result, hence the acquire.
  tile = row_ok[:, None] & (vcols < head_dim_v)[None, :]             # [g_pad, dv_pad]
  arrived = jnp.minimum(jnp.sum(tile.astype(jnp.int32)), 1)
  ticket = plgpu.atomic_add(arr_ref, (b, h), arrived)

  @pl.when(ticket == num_splits - 1)
  def _merge():
    store_merged_heads(o_ref, lse_ref, out_ref, lse_out_ref, b,
                       [h * group + g for g in range(group)], num_splits=num_splits,
                       head_dim=head_dim_v, d_pad=dv_pad)


def _split_share(n_slots, num_splits, bps):
  """List slots per split, in whole steps of ``bps`` blocks (389 over 16: 25; 26 with bps 2)."""
  if bps == 1:
    return pl.cdiv(n_slots, num_splits)
  return pl.cdiv(pl.cdiv(n_slots, bps), num_splits) * bps


def default_num_splits(batch, kv_heads, max_selected, *, core_count=None, programs_per_core=2,
                       min_blocks_per_split=4):
  """Splits per (batch, kv head) for the sparse decode kernel: about ``programs_per_core``
  programs per multiprocessor, at least ``min_blocks_per_split`` selected blocks per split.

  Args:
    batch, kv_heads, max_selected: the call's batch, kv heads and most blocks a row keeps.
    core_count: multiprocessors (default: the GPU's); programs_per_core, min_blocks_per_split:
      the rule's two constants.

  Returns:
    The number of splits (>= 1).

  Example:
    >>> default_num_splits(1, 8, 389, core_count=132)
    33
  """
  cores = compat.gpu_core_count() if core_count is None else int(core_count)
  want = -(-programs_per_core * cores // max(1, batch * kv_heads))
  most = -(-int(max_selected) // min_blocks_per_split)
  return int(max(1, min(want, most)))


def _prepare(q, k, v, kv_lengths, indices, page_table, counts, *, block_size, num_splits, scale,
             merge, split_stride, blocks_per_step, prefetch_ids, lengths_group, m_hat=None,
             active=None):
  """Checks shapes; returns (kernel, grid, (batch, q_heads, head_dim_v), kernel args)."""
  if block_size < 16 or block_size & (block_size - 1):
    raise ValueError(f"block_size must be a power of two >= 16 for the Triton sparse decode "
                     f"kernel, got {block_size}")
  if int(num_splits) < 1:
    raise ValueError(f"num_splits must be >= 1, got {num_splits}")
  if blocks_per_step not in (1, 2) or (blocks_per_step == 2 and not prefetch_ids):
    raise ValueError(f"blocks_per_step must be 1, or 2 with prefetch_ids, got "
                     f"{blocks_per_step} (prefetch_ids={prefetch_ids})")
  bsz, hq, d = q.shape
  dv = v.shape[-1]
  if k.ndim != 4 or k.shape[-1] != d or v.shape[:-1] != k.shape[:-1]:
    raise ValueError(f"k must be [.., .., kv_heads, head_dim={d}] and v share all but its last "
                     f"dim, got k {k.shape}, v {v.shape}")
  if hq % k.shape[2]:
    raise ValueError(f"q_heads ({hq}) must be a multiple of kv_heads ({k.shape[2]})")
  paged = page_table is not None
  if paged:
    num_pages, page_size, hk, _ = k.shape
    if page_size != block_size:
      raise ValueError(f"page size {page_size} must equal block_size {block_size}")
    capacity = page_table.shape[1] * page_size
    k = k.reshape(num_pages * page_size, hk, d)
    v = v.reshape(num_pages * page_size, hk, dv)
  else:
    _, capacity, hk, _ = k.shape
  if indices.ndim != 3 or indices.shape[:2] != (bsz, hk):
    raise ValueError(f"indices must be [batch, kv_heads, m] = [{bsz}, {hk}, m], got "
                     f"{indices.shape}")
  if counts is not None and counts.shape != (bsz, hk):
    raise ValueError(f"counts must be [batch, kv_heads] = [{bsz}, {hk}], got {counts.shape}")
  check_lengths(kv_lengths, bsz, lengths_group, "kv_lengths")
  group = hq // hk
  scale = 1.0 / math.sqrt(d) if scale is None else scale
  kernel = functools.partial(
      _kernel, scale=float(scale), block=block_size, group=group,
      g_pad=next_pow2(group, minimum=16), head_dim=d, d_pad=next_pow2(d, minimum=16),
      head_dim_v=dv, dv_pad=next_pow2(dv, minimum=16), num_splits=int(num_splits),
      num_slots=indices.shape[-1], capacity=capacity, counted=counts is not None, paged=paged,
      merge=merge, split_stride=int(split_stride), bps=int(blocks_per_step),
      prefetch_ids=bool(prefetch_ids), len_group=int(lengths_group), unified=m_hat is not None,
      masked=active is not None)
  args = [kv_lengths.astype(jnp.int32), indices.astype(jnp.int32)]
  if counts is not None:
    args.append(counts.astype(jnp.int32))
  args += [q, k, v]
  if paged:
    args.append(page_table.astype(jnp.int32))
  if m_hat is not None:
    if m_hat.shape != (bsz, hq):
      raise ValueError(f"m_hat must be [batch, q_heads] = {(bsz, hq)}, got {m_hat.shape}")
    args.append(m_hat.astype(jnp.float32))
  if active is not None:
    if active.shape != (bsz, int(num_splits), hk):
      raise ValueError(f"active must be [batch, num_splits, kv_heads] = "
                       f"{(bsz, int(num_splits), hk)}, got {active.shape}")
    args.append(active.astype(jnp.int32))
  return kernel, (bsz, hk, int(num_splits)), (bsz, hq, dv), args


def _compiler_params():
  return compat.triton_compiler_params(num_warps=4, num_stages=3)


@functools.partial(jax.jit, static_argnames=("block_size", "num_splits", "scale",
                                             "blocks_per_step", "prefetch_ids", "lengths_group",
                                             "interpret"))
def sparse_decode_partials(q, k, v, kv_lengths, indices, page_table=None, counts=None, *,
                           block_size, num_splits, scale=None, blocks_per_step=1,
                           prefetch_ids=False, lengths_group=1, interpret=False, m_hat=None,
                           active=None):
  """Per-split partial decode attention over each kv head's selected cache blocks (Triton).

  Args:
    q: [batch, q_heads, head_dim].
    k, v: contiguous caches [batch, max_len, kv_heads, head_dim | head_dim_v], or with
      ``page_table`` page pools [num_pages, block_size, kv_heads, ...] (page size = block size).
    kv_lengths: int32 [batch / lengths_group]; keys at positions >= kv_lengths are masked.
    indices: int32 [batch, kv_heads, max_selected]: selected block ids in any order, -1 for
      unused slots.
    page_table: None or int32 [batch, max_pages]: block j of sequence b is ``page_table[b, j]``.
    counts: None (walk all slots) or int32 [batch, kv_heads]: walk only the first counts.
    block_size, num_splits: tokens per block (a power of two >= 16), splits of each list.
    scale: logit scale, default 1/sqrt(head_dim).
    blocks_per_step: kept blocks per loop step: 1, or 2 with ``prefetch_ids``.
    prefetch_ids: load each split's block ids once before the loop (else one step ahead).
    lengths_group: consecutive sequences sharing one entry of kv_lengths.
    interpret: run in the Pallas interpreter (CPU tests).
    m_hat, active: as ``pallas_kernels.decode.triton.decode_partials`` (active: [batch,
      num_splits, kv_heads]).

  Returns:
    (out [batch, num_splits, q_heads, head_dim_v] fp32, lse [batch, num_splits, q_heads] fp32),
    0 and -inf for empty splits. With ``m_hat``: (acc, l, mx), the sums of exp(s - m_hat) * v
    and exp(s - m_hat) and each split's max logit.

  Example:
    >>> q = jnp.ones((1, 4, 16)); k = jnp.ones((1, 64, 2, 16))
    >>> idx = jnp.array([[[2, 0], [1, -1]]], jnp.int32)
    >>> o, lse = sparse_decode_partials(q, k, k[..., :8], jnp.array([40], jnp.int32), idx,
    ...                                 block_size=16, num_splits=2, interpret=True)
    >>> o.shape
    (1, 2, 4, 8)
  """
  kernel, grid, (bsz, hq, dv), args = _prepare(
      q, k, v, kv_lengths, indices, page_table, counts, block_size=block_size,
      num_splits=num_splits, scale=scale, merge=False, split_stride=1,
      blocks_per_step=blocks_per_step, prefetch_ids=prefetch_ids, lengths_group=lengths_group,
      m_hat=m_hat, active=active)
  o, part = (jax.ShapeDtypeStruct((bsz, num_splits, hq) + t, jnp.float32) for t in ((dv,), ()))
  out_shape = [o, part, part] if m_hat is not None else [o, part]            # o, lse (, mx)
  return tuple(pl.pallas_call(kernel, out_shape=out_shape, grid=grid,
                              compiler_params=_compiler_params(), interpret=interpret,
                              name="jattn_sparse_decode")(*args))


@functools.partial(jax.jit, static_argnames=("block_size", "num_splits", "scale", "out_dtype",
                                             "blocks_per_step", "prefetch_ids", "merge_kernel",
                                             "lengths_group", "interpret", "_split_stride"))
def sparse_decode(q, k, v, kv_lengths, indices, page_table=None, counts=None, arrivals=None, *,
                  block_size, num_splits, scale=None, out_dtype=None, blocks_per_step=1,
                  prefetch_ids=False, merge_kernel=False, lengths_group=1, interpret=False,
                  _split_stride=1):
  """Decode attention over each kv head's selected cache blocks, splits merged (Triton): by
  the split that arrives last on a (batch, kv head) atomic counter, or a second kernel.

  Args:
    q, k, v, kv_lengths, indices, page_table, counts, block_size, num_splits, scale,
      blocks_per_step, prefetch_ids, lengths_group, interpret: as :func:`sparse_decode_partials`.
    arrivals: None or int32 [batch, kv_heads] zeros: the arrival counters (None: a memset).
    out_dtype: dtype of the output (default q.dtype).
    merge_kernel: merge the splits in a second kernel (the same arithmetic).
    _split_stride: tests only: program s handles split (s * stride) % num_splits.

  Returns:
    (out [batch, q_heads, head_dim_v] in out_dtype, lse [batch, q_heads] fp32; rows that see
    no key give 0 and -inf).

  Example:
    >>> q = jnp.ones((1, 4, 16)); k = jnp.ones((1, 64, 2, 16))
    >>> idx = jnp.array([[[2, 0], [1, -1]]], jnp.int32)
    >>> out, lse = sparse_decode(q, k, k, jnp.array([40], jnp.int32), idx, block_size=16,
    ...                          num_splits=2, interpret=True)
    >>> out.shape, lse.shape
    ((1, 4, 16), (1, 4))
  """
  if math.gcd(int(_split_stride), int(num_splits)) != 1:
    raise ValueError(f"_split_stride {_split_stride} must be coprime with num_splits {num_splits}")
  out_dtype = q.dtype if out_dtype is None else out_dtype
  kw = dict(block_size=block_size, num_splits=num_splits, scale=scale,
            blocks_per_step=blocks_per_step, prefetch_ids=prefetch_ids, lengths_group=lengths_group)
  if merge_kernel and int(num_splits) > 1:       # partials, then one merge kernel
    o, lse = sparse_decode_partials(q, k, v, kv_lengths, indices, page_table, counts,
                                    interpret=interpret, **kw)
    return merge_partials_pallas(o, lse, out_dtype=out_dtype, interpret=interpret)
  kernel, grid, (bsz, hq, dv), args = _prepare(q, k, v, kv_lengths, indices, page_table, counts,
                                               merge=True, split_stride=_split_stride, **kw)
  hk = grid[1]
  out_shape = [jax.ShapeDtypeStruct((bsz, hq, dv), jnp.dtype(out_dtype)),
               jax.ShapeDtypeStruct((bsz, hq), jnp.float32)]
  aliases = {len(args): 2} if num_splits > 1 else {}
  if num_splits > 1:                     # the counters (updated in place) and the scratch
    if arrivals is None:
      arrivals = jnp.zeros((bsz, hk), jnp.int32)
    elif arrivals.shape != (bsz, hk):
      raise ValueError(f"arrivals must be [batch, kv_heads] = [{bsz}, {hk}], got {arrivals.shape}")
    args.append(arrivals.astype(jnp.int32))
    out_shape += [jax.ShapeDtypeStruct((bsz, hk), jnp.int32),
                  jax.ShapeDtypeStruct((bsz, num_splits, hq, dv), jnp.float32),
                  jax.ShapeDtypeStruct((bsz, num_splits, hq), jnp.float32)]
  res = pl.pallas_call(kernel, out_shape=out_shape, grid=grid, input_output_aliases=aliases,
                       compiler_params=_compiler_params(), interpret=interpret,
                       name="jattn_sparse_decode_merged")(*args)
  return res[0], res[1]
