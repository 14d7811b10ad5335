"""Top-K block-sparse decode in portable Pallas GPU (Triton lowering), contiguous and paged.

One program per (batch, kv head, split). Each (batch, kv head) carries its own list of selected
cache blocks (``indices[b, h, :]``, any order, -1 for unused slots), so the selection of a kv head is
shared by its query heads but differs between kv heads: the list acts as a per-head page table
over the cache viewed as blocks of ``block_size`` tokens (paged caches: ``page_size ==
block_size`` and the block id goes through the page table). A split walks a contiguous share of
the list (the first ``counts[b, h]`` slots when counts are given, so the work splits evenly over
the blocks actually kept); each step loads one block's K and V rows of head h (masked past the
sequence length and for -1 slots, which read no memory), runs the online softmax in fp32 and
accumulates. The next slot's block id (and, paged, its page) is looked up one step ahead and
arrives through the loop carry, so the K/V addresses never wait on an index load of the same
iteration and Triton can double-buffer the K/V copies. All query heads of the group form one
[g_pad, d_pad] tile, so each selected K/V byte is read from HBM once. Values may be narrower
than keys (MLA: keys carry extra rope dims): V tiles, the accumulator and the output are
[.., dv_pad] with their own column mask, so V rows are read with V's own width.

Two ways to combine the splits' partial (out, lse):

* :func:`sparse_decode` (used by ``jattn.sparse``'s "triton" path): the merge is folded into
  the attention kernel. Each split stores its partial to an HBM scratch and atomically counts
  its arrival on a per-(batch, kv head) counter; the split that arrives last merges the group's
  partials by log-sum-exp and writes the output in its dtype. One launch.
* :func:`sparse_decode_partials` returns the partials and :func:`merge_decode_partials` merges
  them in a second small kernel (the same arithmetic as ``jattn.merge.merge_partials``, which
  XLA runs as several reduction kernels). Two launches; ``sparse_decode(...,
  merge_kernel=True)`` runs them (the head-major default on sm90 since session 25: the merge
  kernel took 1.9 us where the in-kernel merge added ~4.3 to the attention kernel, run 105).

File layout: attention kernel body, wrappers (partials, merged), merge helper, merge kernel and
wrapper.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import compat
from pallas_kernels.decode.triton import load_group_query

__all__ = ["sparse_decode", "sparse_decode_partials", "merge_decode_partials",
           "default_num_splits"]

SPLIT_BY = ("count", "width")     # how a (batch, kv head)'s list is shared among its splits


def _pow2(n):
  return max(16, pl.next_power_of_2(int(n)))


def _len_index(b, len_group):
  """Row of a lengths array shared by ``len_group`` consecutive sequences (a head-major cache
  seen as batch x kv_heads sequences, ``lengths_group`` = kv_heads): b // len_group."""
  return b if len_group == 1 else jax.lax.div(b, jnp.int32(len_group))


def _check_lengths(lengths, bsz, lengths_group, name):
  """ValueError unless ``lengths`` has shape (bsz // lengths_group,)."""
  if lengths_group < 1 or bsz % lengths_group:
    raise ValueError(f"lengths_group must be >= 1 and divide the batch {bsz}, got "
                     f"{lengths_group}")
  if jnp.shape(lengths) != (bsz // lengths_group,):
    raise ValueError(f"{name} must have shape ({bsz // lengths_group},) (batch "
                     f"{bsz} / lengths_group {lengths_group}), got {jnp.shape(lengths)}")


def _kernel(lens_ref, idx_ref, cnt_ref, q_ref, k_ref, v_ref, *rest, scale, block, group, g_pad,
            head_dim, d_pad, head_dim_v, dv_pad, num_splits, num_slots, capacity, paged,
            merge=False, split_stride=1, blocks_per_step=1, index_lookahead=True,
            slot_source=None, len_group=1, prefetch_ids=False, split_by="count",
            merge_stores_last=True, pids=None, wait=None, lists_volatile=False):
  """One (batch, kv head, split) program.

  Refs: lens [B]; idx [B, Hk, M] (-1 = unused); cnt [B, Hk] (slots to walk) or None; q
  [B, Hq, D]; k [B, N, Hk, D] and v [B, N, Hk, Dv] (contiguous) or [P * block, Hk, D | Dv]
  (paged, page table [B, max_pages] first in ``rest``). Then, without ``merge``: outputs o
  [B, S, Hq, Dv] fp32 and lse [B, S, Hq] fp32 (the partials). With ``merge`` and S > 1: the
  arrival counters [B, Hk] int32 (input, aliased to the third output), outputs out [B, Hq, Dv]
  (final dtype), lse [B, Hq] fp32, the counters, and the partials o [B, S, Hq, Dv] and lse
  [B, S, Hq] (scratch in HBM); with ``merge`` and S == 1 just out and lse.

  ``blocks_per_step`` (a power of two) kept blocks form one [blocks_per_step * block, d] K/V
  tile per loop step (their ids are gathered as a vector); splits then hold whole steps.
  ``index_lookahead``: look the next step's block id(s) up one step ahead through the loop carry
  (default) or in the step itself. The default (1 block per step, lookahead) is the original
  code path, unchanged.
  ``slot_source``: None (the lists come from idx_ref / cnt_ref), or a function (b, h) ->
  (n_slots, blk_at) whose blk_at(s) gives the block id of list slot s < n_slots (scalar s:
  blocks_per_step 1; the kernel masks s >= end itself): the fused selection kernel
  (``pallas_kernels.sparse.decode_fused_select``) derives the lists in-kernel, with idx_ref
  and cnt_ref None.
  ``len_group``: lens holds one length per ``len_group`` consecutive sequences (lens[b //
  len_group]; a head-major cache seen as batch x kv_heads sequences).
  ``prefetch_ids``: the split's block ids (and pages) are loaded once, as one vector, before
  the loop; each step takes its ids from that vector in registers (a masked sum), so no step
  waits on a load of its ids and the K/V copies' addresses are known as early as the
  pipeline wants them. Not with ``slot_source``; ``index_lookahead`` then does not apply.
  ``split_by``: "count" (the first ``count`` slots split evenly) or "width" (the list's
  ``num_slots`` slots split evenly, static shares; slots >= count are skipped), so that a
  split's first slot, and its id loads, do not wait for the count's load. The same blocks;
  the same split of them when count == num_slots.
  ``merge_stores_last``: the last split's merge computes every query head of the group before
  it stores any (True), so no partial's load waits behind an output store, or stores each head
  as it goes (False). The same arithmetic either way.
  ``pids``: (batch, kv head, split) of this program (default: the program ids); ``wait``: a
  function run after the length and query loads and before the count and list loads (the
  one-launch kernel's wait for its selection, ``decode_one_launch``); ``lists_volatile``: the
  count and list loads are volatile (from L2: no stale L1 line of a list written after the
  kernel started).
  """
  if paged:
    pt_ref, *rest = rest
  else:
    pt_ref = None
  if not merge:
    o_ref, lse_ref = rest
  elif num_splits == 1:
    out_ref, lse_out_ref = rest
  else:
    _, out_ref, lse_out_ref, arr_ref, o_ref, lse_ref = rest
  if pids is None:
    b = pl.program_id(0)
    h = pl.program_id(1)
    split = pl.program_id(2)
    if split_stride != 1:                # tests: make a split other than S-1 arrive last
      split = (split * split_stride) % num_splits
  else:
    b, h, split = pids
  length = jnp.maximum(jnp.minimum(plgpu.load(lens_ref.at[_len_index(b, len_group)]), capacity),
                       0)                                                        # scalar
  loaded_q = None
  if wait is not None:                   # the query before the wait, the lists after it
    loaded_q = load_group_query(q_ref, b, h, group=group, g_pad=g_pad, head_dim=head_dim,
                                d_pad=d_pad)
    wait(b, h)
  if slot_source is not None:
    n_slots, blk_at = slot_source(b, h)
  elif cnt_ref is None:
    n_slots = jnp.int32(num_slots)
  else:
    n_slots = jnp.clip(plgpu.load(cnt_ref.at[b, h], volatile=lists_volatile), 0, num_slots)
  bps = int(blocks_per_step)
  if split_by not in SPLIT_BY:
    raise ValueError(f"split_by must be one of {SPLIT_BY}, got {split_by!r}")
  if split_by == "width":                # static shares of the list's width
    per_split = _split_share(num_slots, num_splits, bps)
    begin = jnp.minimum(split * per_split, num_slots)
  else:
    per_split = _split_share(n_slots, num_splits, bps)
    begin = jnp.minimum(split * per_split, n_slots)
  end = jnp.maximum(jnp.minimum(begin + per_split, n_slots), begin)   # "width": may be empty

  if prefetch_ids and slot_source is not None:
    raise ValueError("prefetch_ids needs the lists in idx_ref (not slot_source)")
  if prefetch_ids:                       # the split's <= ids_pad ids, before the loop
    ids_pad = _pow2(_split_share(num_slots, num_splits, bps))
    ar = jnp.arange(ids_pad, dtype=jnp.int32)
    own = ar < end - begin
    # "width": the load's addresses and mask do not depend on the count (the split's static
    # share), so it is issued with the count's load; slots past the count are dropped after.
    ld_mask = (begin + ar < jnp.minimum(begin + per_split, num_slots)) if (
        split_by == "width") else own
    ids_vec = plgpu.load(idx_ref.at[b, h, jnp.minimum(begin + ar, num_slots - 1)],
                         mask=ld_mask, other=-1, volatile=lists_volatile)
    ids_vec = jnp.where(own, ids_vec, -1)
    if paged:
      pages_vec = plgpu.load(pt_ref.at[b, jnp.maximum(ids_vec, 0)])

  q, (q_rows, cols, row_ok, col_ok, q_mask) = loaded_q or load_group_query(
      q_ref, b, h, group=group, g_pad=g_pad, head_dim=head_dim, d_pad=d_pad)  # [g_pad, d_pad]
  precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  if bps == 1:
    offs = jnp.arange(block, dtype=jnp.int32)                        # [block]
  else:
    rows = jnp.arange(bps * block, dtype=jnp.int32)                  # [bps * block] tile rows
    offs = rows % block                                              # row within its block
    sub = rows // block                                              # which block of the step
  vcols = jnp.arange(dv_pad, dtype=jnp.int32)                        # [dv_pad]
  vcol_ok = vcols < head_dim_v if dv_pad != head_dim_v else None
  o_mask = row_ok[:, None] if vcol_ok is None else row_ok[:, None] & vcol_ok[None, :]

  def lookup(s):
    """Block id of slot s (-1 when s >= end or the slot is unused) and its first cache row.

    With several blocks per step: the ids [bps * block] (one per tile row) of slots s .. s +
    bps - 1 and each row's first cache row of its block."""
    if prefetch_ids:                     # from the vector: no load in the step
      def pick(vec, local):              # vec[local] for a scalar local in [0, ids_pad)
        return jnp.sum(jnp.where(ar == local, vec, 0))
      if bps == 1:
        blk, page = pick(ids_vec, s - begin), (pick(pages_vec, s - begin) if paged else None)
      else:
        blk = page = None
        for j in range(bps):             # the step's blocks, one per ``sub`` value
          bj = pick(ids_vec, s - begin + j)
          blk = bj if blk is None else jnp.where(sub == j, bj, blk)
          if paged:
            pj = pick(pages_vec, s - begin + j)
            page = pj if page is None else jnp.where(sub == j, pj, page)
        s = s + sub
      blk = jnp.where(s < end, blk, -1)
      return (blk, page * block) if paged else (blk, None)
    if bps != 1:
      s = s + sub                                                    # [bps * block] slots
    if slot_source is None:
      blk = plgpu.load(idx_ref.at[b, h, jnp.minimum(s, num_slots - 1)],
                       volatile=lists_volatile)
    else:
      blk = blk_at(s)
    blk = jnp.where(s < end, blk, -1)
    if paged:
      page = plgpu.load(pt_ref.at[b, jnp.maximum(blk, 0)])
      return blk, page * block
    return blk, None

  def slot(i):
    """First slot of loop step i (steps count slots when bps == 1, else from 0)."""
    return i if bps == 1 else begin + i * bps

  index_lookahead = index_lookahead and not prefetch_ids

  def body(s, carry):
    if index_lookahead:
      acc, m_prev, l_prev, blk, row0 = carry if paged else (*carry, None)
      blk_next, row0_next = lookup(slot(s + 1))                      # one step ahead
    else:
      acc, m_prev, l_prev = carry
      blk, row0 = lookup(slot(s))                                    # this step's ids
    ok = blk >= 0
    pos = jnp.maximum(blk, 0) * block + offs                         # [bps * block] tokens
    valid = (pos < length) & ok
    kv_mask = valid[:, None] if col_ok is None else valid[:, None] & col_ok[None, :]
    v_mask = valid[:, None] if vcol_ok is None else valid[:, None] & vcol_ok[None, :]
    if paged:
      krow = row0 + offs
      k = plgpu.load(k_ref.at[krow[:, None], h, cols[None, :]], mask=kv_mask, other=0)
    else:
      k = plgpu.load(k_ref.at[b, pos[:, None], h, cols[None, :]], mask=kv_mask, other=0)
    sc = plgpu.dot(q, k, trans_b=True, precision=precision) * scale  # [g_pad, block] fp32
    sc = jnp.where(valid[None, :], sc, -jnp.inf)
    # m_new stays -inf while only unused (-1) slots have been visited: shift by 0 then.
    m_new = jnp.maximum(m_prev, jnp.max(sc, axis=1))                  # [g_pad]
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m_prev - m_use)
    p = jnp.exp(sc - m_use[:, None])                                 # [g_pad, block]
    l_new = l_prev * alpha + jnp.sum(p, axis=1)
    if paged:
      v = plgpu.load(v_ref.at[krow[:, None], h, vcols[None, :]], mask=v_mask, other=0)
    else:
      v = plgpu.load(v_ref.at[b, pos[:, None], h, vcols[None, :]], mask=v_mask, other=0)
    pv = plgpu.dot(p.astype(v.dtype), v, precision=precision)        # [g_pad, dv_pad]
    if not index_lookahead:
      return acc * alpha[:, None] + pv, m_new, l_new
    new = (acc * alpha[:, None] + pv, m_new, l_new, blk_next)
    return new + (row0_next,) if paged else new

  acc0 = jnp.zeros((g_pad, dv_pad), jnp.float32)
  m0 = jnp.full((g_pad,), -jnp.inf, jnp.float32)
  l0 = jnp.zeros((g_pad,), jnp.float32)
  if index_lookahead:
    blk0, row00 = lookup(begin)
    init = (acc0, m0, l0, blk0) + ((row00,) if paged else ())
  else:
    init = (acc0, m0, l0)
  if bps == 1:
    lo, hi = begin, end
  else:
    lo, hi = 0, pl.cdiv(end - begin, bps)
  acc, m, l = jax.lax.fori_loop(lo, hi, body, init)[:3]
  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  out = acc * (1.0 / l_safe)[:, None]                                # zeros when empty
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
  # Arrival: the split whose increment brings the counter of (b, h) to num_splits merges all
  # partials of the group. Memory order: the atomic is acq_rel at GPU scope but Triton issues
  # a scalar atomic from one thread, so every thread's partial stores must be ordered before
  # it by a CTA barrier. ``arrived`` (= 1) is a reduction over the whole [g_pad, dv_pad] tile,
  # which spans all warps and therefore passes through shared memory and a barrier placed
  # after the stores above; the increment depends on it, so the barrier cannot be dropped or
  # moved past the atomic. The winner reads the partials after the atomic's result has been
  # broadcast to its threads (shared memory + barrier), so its loads follow the acquire.
  tile = row_ok[:, None] & (vcols < head_dim_v)[None, :]             # [g_pad, dv_pad]
  arrived = jnp.minimum(jnp.sum(tile.astype(jnp.int32)), 1)
  ticket = plgpu.atomic_add(arr_ref, (b, h), arrived)

  @pl.when(ticket == num_splits - 1)
  def _merge():
    heads = [h * group + g for g in range(group)]
    mkw = dict(num_splits=num_splits, s_pad=_pow2(num_splits), head_dim=head_dim_v,
               d_pad=dv_pad)
    if merge_stores_last:
      _merge_heads(o_ref, lse_ref, out_ref, lse_out_ref, b, heads, **mkw)
    else:
      for hh in heads:
        _merge_head(o_ref, lse_ref, out_ref, lse_out_ref, b, hh, **mkw)


def _split_share(n_slots, num_splits, bps):
  """List slots per split when n_slots (an int or a traced scalar) are shared by num_splits:
  cdiv(n_slots, num_splits), or with ``bps`` blocks per step whole steps per split (the last
  split may hold fewer). With n_slots = the list's width: the most slots one split walks.

  Example:
    >>> _split_share(389, 16, 1), _split_share(389, 16, 2)
    (25, 26)
  """
  if bps == 1:
    return pl.cdiv(n_slots, num_splits)
  return pl.cdiv(pl.cdiv(n_slots, bps), num_splits) * bps


def default_num_splits(batch, kv_heads, max_selected, *, core_count=None, programs_per_core=2,
                       min_blocks_per_split=4):
  """Splits per (batch, kv head) for the sparse decode kernel.

  About ``programs_per_core`` programs per multiprocessor over the batch x kv_heads pairs (B1
  with 8 kv heads would otherwise run 8 programs on a 132-SM H200), with at least
  ``min_blocks_per_split`` selected blocks per split. Not rounded to a power of two: the
  selected lists have no power-of-two length.

  Args:
    batch, kv_heads: programs per split.
    max_selected: width of the selected-block lists.
    core_count: multiprocessors; default ``compat.gpu_core_count()``.
    programs_per_core: target programs per multiprocessor.
    min_blocks_per_split: lower bound on the work of one split.

  Returns:
    An int >= 1.

  Example:
    >>> default_num_splits(1, 8, 389, core_count=132)
    33
  """
  cores = compat.gpu_core_count() if core_count is None else int(core_count)
  want = -(-programs_per_core * cores // max(1, batch * kv_heads))
  most = -(-int(max_selected) // min_blocks_per_split)
  return int(max(1, min(want, most)))


@functools.partial(jax.jit, static_argnames=("block_size", "num_splits", "scale", "num_warps",
                                             "num_stages", "blocks_per_step", "index_lookahead",
                                             "interpret", "prefetch_ids", "split_by",
                                             "lengths_group"))
def sparse_decode_partials(q, k, v, kv_lengths, indices, page_table=None, counts=None, *,
                           block_size, num_splits, scale=None, num_warps=4, num_stages=3,
                           blocks_per_step=1, index_lookahead=True, interpret=False,
                           prefetch_ids=False, split_by="count", lengths_group=1):
  """Per-split partial decode attention over each kv head's selected cache blocks (Triton).

  Args:
    q: [batch, q_heads, head_dim].
    k: contiguous cache [batch, max_len, kv_heads, head_dim], or with ``page_table`` a page
      pool [num_pages, block_size, kv_heads, head_dim] (page size = block size).
    v: like ``k`` with its own last dim head_dim_v (may differ from head_dim, e.g. MLA values
      narrower than the rope-extended keys).
    kv_lengths: int32 [batch]; keys at positions >= kv_lengths are masked.
    indices: int32 [batch, kv_heads, max_selected]: selected block ids in any order, -1 for
      unused slots (positions >= kv_lengths[b] are masked).
    page_table: None or int32 [batch, max_pages]: block j of sequence b is page
      ``page_table[b, j]``.
    counts: None (walk all max_selected slots) or int32 [batch, kv_heads]: walk only the first
      ``counts[b, h]`` slots (e.g. ``pallas_kernels.sparse.decode_select.select_decode_slots``'s
      compact lists), split evenly over the splits.
    block_size: tokens per block, a power of two >= 16.
    num_splits: splits of each selected list (merge the partials with
      :func:`merge_decode_partials`).
    scale: logit scale, default 1/sqrt(head_dim).
    num_warps, num_stages: launch parameters.
    blocks_per_step: kept blocks per loop step (a power of two): the K/V tile of a step is
      [blocks_per_step * block_size, head_dim], gathered from that many (scattered) blocks;
      splits hold whole steps. 1 (default) is the original kernel.
    index_lookahead: True (default): the next step's block ids (and pages) are loaded one step
      ahead and reach the step through the loop carry; False: each step loads its own ids
      first (the K/V addresses then depend on a load of the same iteration).
    interpret: run in the Pallas interpreter (CPU tests).
    prefetch_ids: load each split's block ids (and pages) once, as one vector, before the
      loop; each step then takes its ids from registers, so no step waits on an id load
      (``index_lookahead`` does not apply). The same output to the bit (tested). Meant for
      short splits (the default split count gives <= 16 ids per split at 2048 blocks): each
      step's pick is a compare + sum over the padded vector.
    split_by: how the splits share a list: "count" (default: the first ``counts`` slots,
      evenly) or "width" (all ``max_selected`` slots, evenly: each split's share, and so its
      id loads, do not depend on the count's load; slots past the count are skipped). The
      same blocks; the same split of them, and so the same result to the bit, where
      count == max_selected. Without counts the two are the same.
    lengths_group: kv_lengths is [batch / lengths_group], one length per that many
      consecutive sequences (as :func:`sparse_decode`).

  Returns:
    (out [batch, num_splits, q_heads, head_dim_v] fp32, lse [batch, num_splits, q_heads] fp32);
    empty splits hold 0 and -inf.

  Example:
    >>> q = jnp.ones((1, 4, 16)); k = jnp.ones((1, 64, 2, 16))
    >>> idx = jnp.array([[[2, 0], [1, -1]]], jnp.int32)
    >>> o, lse = sparse_decode_partials(q, k, k, jnp.array([40], jnp.int32), idx,
    ...                                 block_size=16, num_splits=2, interpret=True)
    >>> o.shape
    (1, 2, 4, 16)
    >>> o, _ = sparse_decode_partials(q, k, k[..., :8], jnp.array([40], jnp.int32), idx,
    ...                               block_size=16, num_splits=2, interpret=True)
    >>> o.shape
    (1, 2, 4, 8)
  """
  kernel, grid, (bsz, hq, dv), args = _prepare(
      q, k, v, kv_lengths, indices, page_table, counts, block_size=block_size,
      num_splits=num_splits, scale=scale, merge=False, split_stride=1,
      blocks_per_step=blocks_per_step, index_lookahead=index_lookahead,
      prefetch_ids=prefetch_ids, split_by=split_by, lengths_group=lengths_group)
  out_shape = [jax.ShapeDtypeStruct((bsz, num_splits, hq, dv), jnp.float32),
               jax.ShapeDtypeStruct((bsz, num_splits, hq), jnp.float32)]
  return pl.pallas_call(
      kernel, out_shape=out_shape, grid=grid,
      compiler_params=compat.triton_compiler_params(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret, name="jattn_sparse_decode")(*args)


def _prepare(q, k, v, kv_lengths, indices, page_table, counts, *, block_size, num_splits, scale,
             merge, split_stride, blocks_per_step=1, index_lookahead=True, lengths_group=1,
             prefetch_ids=False, split_by="count", merge_stores_last=True):
  """Checks shapes; returns (kernel, grid, (batch, q_heads, head_dim_v), kernel args)."""
  if block_size < 16 or block_size & (block_size - 1):
    raise ValueError(f"block_size must be a power of two >= 16 for the Triton sparse decode "
                     f"kernel, got {block_size}")
  if int(num_splits) < 1:
    raise ValueError(f"num_splits must be >= 1, got {num_splits}")
  bps = int(blocks_per_step)
  if bps < 1 or bps & (bps - 1):
    raise ValueError(f"blocks_per_step must be a power of two >= 1, got {blocks_per_step}")
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
  _check_lengths(kv_lengths, bsz, lengths_group, "kv_lengths")
  group = hq // hk
  if scale is None:
    scale = 1.0 / math.sqrt(d)
  kernel = functools.partial(_kernel, scale=float(scale), block=block_size, group=group,
                             g_pad=_pow2(group), head_dim=d, d_pad=_pow2(d), head_dim_v=dv,
                             dv_pad=_pow2(dv), num_splits=int(num_splits),
                             num_slots=indices.shape[-1], capacity=capacity, paged=paged,
                             merge=merge, split_stride=int(split_stride))
  if bps != 1 or not index_lookahead:    # the default keeps the original kernel's arguments
    kernel = functools.partial(kernel, blocks_per_step=bps,
                               index_lookahead=bool(index_lookahead))
  if lengths_group != 1:
    kernel = functools.partial(kernel, len_group=int(lengths_group))
  if prefetch_ids:
    kernel = functools.partial(kernel, prefetch_ids=True)
  if split_by not in SPLIT_BY:
    raise ValueError(f"split_by must be one of {SPLIT_BY}, got {split_by!r}")
  if split_by != "count":
    kernel = functools.partial(kernel, split_by=split_by)
  if not merge_stores_last:
    kernel = functools.partial(kernel, merge_stores_last=False)
  if counts is None:
    kernel = functools.partial(_no_counts, kernel)
  args = [kv_lengths.astype(jnp.int32), indices.astype(jnp.int32)]
  if counts is not None:
    args.append(counts.astype(jnp.int32))
  args += [q, k, v]
  if paged:
    args.append(page_table.astype(jnp.int32))
  return kernel, (bsz, hk, int(num_splits)), (bsz, hq, dv), args


@functools.partial(jax.jit, static_argnames=("block_size", "num_splits", "scale", "out_dtype",
                                             "num_warps", "num_stages", "blocks_per_step",
                                             "index_lookahead", "interpret", "_split_stride",
                                             "lengths_group", "prefetch_ids", "split_by",
                                             "merge_stores_last", "merge_kernel"))
def sparse_decode(q, k, v, kv_lengths, indices, page_table=None, counts=None, arrivals=None, *,
                  block_size, num_splits, scale=None, out_dtype=None, num_warps=4, num_stages=3,
                  blocks_per_step=1, index_lookahead=True, interpret=False, _split_stride=1,
                  lengths_group=1, prefetch_ids=False, split_by="count",
                  merge_stores_last=True, merge_kernel=False):
  """Decode attention over each kv head's selected cache blocks, splits merged (Triton).

  The kernel of :func:`sparse_decode_partials` with the merge folded in: each (batch, kv head,
  split) program stores its partial (out, lse) to an HBM scratch, then increments the
  (batch, kv head)'s arrival counter (``pl`` Triton ``atomic_add``, acq_rel, GPU scope); the
  program that arrives last merges the ``num_splits`` partials of the group's query heads by
  log-sum-exp (the arithmetic of :func:`merge_decode_partials`) and writes the output. One
  launch instead of two; with ``num_splits == 1`` there is no counter and no scratch.

  Args:
    q, k, v, kv_lengths, indices, page_table, counts, block_size, scale, num_warps,
      num_stages, blocks_per_step, index_lookahead, interpret, prefetch_ids, split_by: as
      :func:`sparse_decode_partials`.
    arrivals: None or int32 [batch, kv_heads] of zeros: the arrival counters (donated to the
      kernel; e.g. ``select_decode_slots(..., return_arrivals=True)``'s, which costs no extra
      launch). None makes zeros (an XLA memset before the kernel). Ignored when num_splits == 1.
    num_splits: splits of each selected list.
    out_dtype: dtype of the output (default q.dtype).
    lengths_group: kv_lengths is [batch / lengths_group], one length per that many
      consecutive sequences (sequence b reads kv_lengths[b // lengths_group]): a head-major
      cache seen as batch x kv_heads sequences, without repeating the lengths in XLA.
    merge_stores_last: the merging split computes all of its group's query heads before it
      stores any (default), so the partials' loads of one head never wait behind the output
      stores of another; False stores each head as it is merged. The same arithmetic.
    merge_kernel: merge the splits in a second kernel (:func:`merge_decode_partials`, one
      program per (batch, query head)) instead of in the last split to arrive (no counters:
      ``arrivals`` is unused). The same arithmetic. On the H200 the in-kernel merge added
      ~4.3 us to the attention kernel (32.6 against 28.3 us at B1 S128K GQA 32:8, 19% of
      64-token blocks, head-major), the merge kernel 1.9 (run 105).
    _split_stride: tests only: program s handles split (s * stride) % num_splits (coprime with
      num_splits), so in the interpreter, which runs programs in order, another split than the
      last arrives last.

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
    raise ValueError(f"_split_stride {_split_stride} must be coprime with num_splits "
                     f"{num_splits}")
  out_dtype = q.dtype if out_dtype is None else out_dtype
  if merge_kernel and int(num_splits) > 1:       # partials, then one merge kernel
    o, lse = sparse_decode_partials(
        q, k, v, kv_lengths, indices, page_table, counts, block_size=block_size,
        num_splits=num_splits, scale=scale, num_warps=num_warps, num_stages=num_stages,
        blocks_per_step=blocks_per_step, index_lookahead=index_lookahead, interpret=interpret,
        prefetch_ids=prefetch_ids, split_by=split_by, lengths_group=lengths_group)
    return merge_decode_partials(o, lse, out_dtype=out_dtype, interpret=interpret)
  kernel, grid, (bsz, hq, dv), args = _prepare(
      q, k, v, kv_lengths, indices, page_table, counts, block_size=block_size,
      num_splits=num_splits, scale=scale, merge=True, split_stride=_split_stride,
      blocks_per_step=blocks_per_step, index_lookahead=index_lookahead,
      lengths_group=lengths_group, prefetch_ids=prefetch_ids, split_by=split_by,
      merge_stores_last=merge_stores_last)
  out_shape, aliases = _merged_outputs(args, arrivals, bsz=bsz, hq=hq, hk=grid[1], dv=dv,
                                       num_splits=num_splits, out_dtype=out_dtype)
  res = pl.pallas_call(
      kernel, out_shape=out_shape, grid=grid, input_output_aliases=aliases,
      compiler_params=compat.triton_compiler_params(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret, name="jattn_sparse_decode_merged")(*args)
  return res[0], res[1]


def _merged_outputs(args, arrivals, *, bsz, hq, hk, dv, num_splits, out_dtype):
  """Outputs of a kernel that merges its splits in place (the last split to arrive per (batch,
  kv head) merges): (out_shape, input_output_aliases). With several splits, appends the arrival
  counters (zeros if ``arrivals`` is None; updated in place) to ``args`` and adds the counters'
  output and the fp32 partials' scratch outputs; ``sparse_decode`` and the fused selection
  kernel share it."""
  out_shape = [jax.ShapeDtypeStruct((bsz, hq, dv), jnp.dtype(out_dtype)),
               jax.ShapeDtypeStruct((bsz, hq), jnp.float32)]
  aliases = {}
  if num_splits > 1:
    if arrivals is None:
      arrivals = jnp.zeros((bsz, hk), jnp.int32)
    elif arrivals.shape != (bsz, hk):
      raise ValueError(f"arrivals must be [batch, kv_heads] = [{bsz}, {hk}], got "
                       f"{arrivals.shape}")
    aliases = {len(args): 2}
    args.append(arrivals.astype(jnp.int32))
    out_shape += [jax.ShapeDtypeStruct((bsz, hk), jnp.int32),
                  jax.ShapeDtypeStruct((bsz, num_splits, hq, dv), jnp.float32),
                  jax.ShapeDtypeStruct((bsz, num_splits, hq), jnp.float32)]
  return out_shape, aliases


def _no_counts(kernel, lens_ref, idx_ref, *refs):
  return kernel(lens_ref, idx_ref, None, *refs)


# ----------------------------------------------------------------------------- merge
def _merge_head(o_ref, lse_ref, out_ref, lse_out_ref, b, hh, *, num_splits, s_pad, head_dim,
                d_pad):
  """Log-sum-exp merge of query head ``hh``'s num_splits partials of sequence ``b``.

  Refs: o [B, S, Hq, D] fp32; lse [B, S, Hq] fp32; outputs out [B, Hq, D] and lse [B, Hq].
  """
  _merge_heads(o_ref, lse_ref, out_ref, lse_out_ref, b, [hh], num_splits=num_splits,
               s_pad=s_pad, head_dim=head_dim, d_pad=d_pad)


def _merge_heads(o_ref, lse_ref, out_ref, lse_out_ref, b, heads, *, num_splits, s_pad,
                 head_dim, d_pad):
  """:func:`_merge_head` of each query head in ``heads``, every head computed before any store
  (no partial's load follows an output store, which the compiler could not move it past)."""
  cols = jnp.arange(d_pad, dtype=jnp.int32)                          # [d_pad]
  res = [_merge_values(o_ref, lse_ref, b, hh, num_splits=num_splits, s_pad=s_pad,
                       head_dim=head_dim, d_pad=d_pad) for hh in heads]
  for hh, (out, lse) in zip(heads, res):
    plgpu.store(out_ref.at[b, hh, cols], out.astype(out_ref.dtype), mask=cols < head_dim)
    plgpu.store(lse_out_ref.at[b, hh], lse)


def _merge_values(o_ref, lse_ref, b, hh, *, num_splits, s_pad, head_dim, d_pad):
  """(out [d_pad] fp32, lse scalar) of query head ``hh``: the log-sum-exp merge of its
  partials (partials with lse -inf ignored; no partial gives 0 and -inf)."""
  srows = jnp.arange(s_pad, dtype=jnp.int32)                         # [s_pad]
  cols = jnp.arange(d_pad, dtype=jnp.int32)                          # [d_pad]
  s_ok = srows < num_splits
  lse = plgpu.load(lse_ref.at[b, srows, hh], mask=s_ok, other=-jnp.inf)   # [s_pad]
  mask = s_ok[:, None] if d_pad == head_dim else s_ok[:, None] & (cols < head_dim)[None, :]
  o = plgpu.load(o_ref.at[b, srows[:, None], hh, cols[None, :]], mask=mask, other=0.0)
  m = jnp.max(lse)
  m = jnp.where(m == -jnp.inf, 0.0, m)
  w = jnp.exp(lse - m)                                               # 0 for empty partials
  total = jnp.sum(w)
  empty = total == 0.0
  total_safe = jnp.where(empty, 1.0, total)
  contrib = jnp.where((w > 0.0)[:, None], o, 0.0)                    # [s_pad, d_pad]
  out = jnp.sum(contrib * (w / total_safe)[:, None], axis=0)         # [d_pad]
  return out, jnp.where(empty, -jnp.inf, m + jnp.log(total_safe))


def _merge_kernel(o_ref, lse_ref, out_ref, lse_out_ref, *, num_splits, s_pad, head_dim, d_pad):
  """One (batch, query head) program: log-sum-exp merge of its num_splits partials."""
  _merge_head(o_ref, lse_ref, out_ref, lse_out_ref, pl.program_id(0), pl.program_id(1),
              num_splits=num_splits, s_pad=s_pad, head_dim=head_dim, d_pad=d_pad)


@functools.partial(jax.jit, static_argnames=("out_dtype", "num_warps", "interpret"))
def merge_decode_partials(outs, lses, *, out_dtype=None, num_warps=4, interpret=False):
  """Merge split partials [batch, splits, heads, d] by log-sum-exp in one kernel.

  The arithmetic of ``jattn.merge.merge_partials(outs, lses, axis=1)``: partials with lse -inf
  are ignored; all-empty heads give 0 and -inf.

  Args:
    outs: fp32 [batch, num_splits, q_heads, head_dim].
    lses: fp32 [batch, num_splits, q_heads].
    out_dtype: dtype of the merged output (default outs.dtype).
    num_warps: launch parameter.
    interpret: run in the Pallas interpreter (CPU tests).

  Returns:
    (out [batch, q_heads, head_dim] in out_dtype, lse [batch, q_heads] fp32).

  Example:
    >>> o = jnp.ones((1, 3, 2, 16)); lse = jnp.zeros((1, 3, 2))
    >>> out, l = merge_decode_partials(o, lse, interpret=True)
    >>> out.shape, l.shape
    ((1, 2, 16), (1, 2))
  """
  bsz, ns, hq, d = outs.shape
  if lses.shape != (bsz, ns, hq):
    raise ValueError(f"lses must be {(bsz, ns, hq)}, got {lses.shape}")
  out_dtype = outs.dtype if out_dtype is None else jnp.dtype(out_dtype)
  kernel = functools.partial(_merge_kernel, num_splits=ns, s_pad=_pow2(ns), head_dim=d,
                             d_pad=_pow2(d))
  return pl.pallas_call(
      kernel, out_shape=[jax.ShapeDtypeStruct((bsz, hq, d), out_dtype),
                         jax.ShapeDtypeStruct((bsz, hq), jnp.float32)],
      grid=(bsz, hq),
      compiler_params=compat.triton_compiler_params(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="jattn_sparse_decode_merge")(
          outs.astype(jnp.float32), lses.astype(jnp.float32))
