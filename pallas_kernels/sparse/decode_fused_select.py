"""Top-K block-sparse decode with the block selection inside the attention kernel (Triton).

Today's "triton" sparse decode (``jattn.sparse``) is three launches: block scores
(``decode_select.decode_block_scores``), the selection (``decode_select.select_decode_slots``:
threshold search, compact ascending kept-block lists and counts) and the split-KV attention
(``decode.sparse_decode``, whose last split per (batch, kv head) merges). Here the selection
runs in the attention kernel's prologue, so a call is two launches: scores, then
select + attend + merge.

* :func:`sparse_decode_select_attend`: grid (batch, kv head, split). Each program
  (1) computes the kept set of (b, h) from its scores row with the selection kernel's rules
  (``decode_select._keep_flags``, the selection kernel's own keep computation: the forced
  initial and local blocks, the top_k candidates by the same threshold search, ``decode_select._radix_threshold`` for ``digit_bits`` 2 or 4, ties to the
  lower block id), as a kept-flag vector over the padded block axis; (2) its inclusive prefix
  count ``incl`` gives the list length (the count) and, for list slot p, the kept block id
  ``#{j: incl[j] <= p}`` (one compare + sum per loop step, looked up one step ahead like the
  index loads of ``sparse_decode``; no scatter, no HBM round trip); (3) runs
  ``decode._kernel`` (the online-softmax loop over its share of the list, split exactly as
  ``sparse_decode`` splits the counts, and the in-kernel log-sum-exp merge by the last split
  to arrive) with that lookup in place of the index loads (``slot_source``). Option
  ``lookup="scratch"``: instead, each split stores its share of the list to an HBM scratch
  after the selection, then (after a CTA barrier) loads the ids back in its loop exactly as
  ``sparse_decode`` loads its index list. Same blocks in the same order and the same
  arithmetic, so the same output and lse to the bit as ``select_decode_slots`` +
  ``sparse_decode`` on the same scores (tested). With
  ``return_indices`` the program of split 0 also writes the compact list and counts (the
  selection kernel's stores).
* :func:`decode_block_scores_arrivals`: ``decode_block_scores``'s kernel (the same loads and
  arithmetic, so the same scores) whose chunk-0 program also writes the zeroed arrival counter
  of its (batch, kv head), so the merge needs no memset launch.
* :func:`sparse_decode_fused`: the two launches from the block sums.

Cost model: every split of a (b, h) repeats the selection (a [nb_pad] scores load, mostly from
L2, and the radix search), in parallel; the per-step lookup is a [nb_pad] compare + reduction
off the K/V critical path. Run 35 on the H200: bit-identical to the three-launch path but
slower (74.9 vs 54.2 us); the probe is ``experiments/probe_sparse_decode_fused_select.py``. Option ``search_loop="rolled"``: the
threshold search as one loop instead of ~5k straight-line SASS instructions per program
(same work and selection; docs/sparse.md, "Why it is slower"). Session 25: ``lengths_group``
(a head-major cache) and ``blocks_per_step`` (with ``lookup="scratch"``), wired into
``jattn.sparse`` as ``fused_select="attend"`` (early bit search): 41.98 us per call against
42.27 for the default two launches (run 102, H200, B1 S128K GQA 32:8, head-major).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import compat
from pallas_kernels.sparse import decode as _dec
from pallas_kernels.sparse import decode_select as _sel

__all__ = ["sparse_decode_select_attend", "decode_block_scores_arrivals", "sparse_decode_fused",
           "decode_width"]


def _pow2(n):
  return max(16, pl.next_power_of_2(int(n)))


def decode_width(num_blocks, top_k, num_init_blocks, num_local_blocks):
  """Width of the kept lists: max(1, min(forced + top_k, num_blocks)).

  The one definition: ``jattn.sparse``'s decode selection sizes its lists with it too.

  Args:
    num_blocks: blocks in the cache (``BlockSummaries.num_blocks``).
    top_k: blocks chosen by score besides the forced ones.
    num_init_blocks: leading blocks always kept.
    num_local_blocks: trailing blocks (the current one and those before it) always kept.

  Returns:
    int: the static width of the kept-block lists.

  Example:
    >>> decode_width(2048, 387, 1, 1)
    389
  """
  n_forced = min(num_init_blocks, num_blocks) + min(num_local_blocks, num_blocks)
  return max(1, min(n_forced + min(top_k, num_blocks), num_blocks))


# ----------------------------------------------------------------------------- kernel
def _fused_kernel(lens_ref, s_ref, q_ref, k_ref, v_ref, *rest, sel, width, return_indices,
                  lookup="reduce", **attn):
  """One (batch, kv head, split) program: selection, then ``decode._kernel``'s body.

  Refs: lens [B]; scores [B, Hk, N] fp32; q, k, v (and the page table, the arrival counters,
  the outputs and scratch) as ``decode._kernel`` with ``merge=True``; with ``return_indices``
  two more outputs: idx [B, Hk, width] int32 and cnt [B, Hk] int32; with lookup "scratch"
  one more: the list scratch [B, Hk, width] int32.
  """
  if lookup == "scratch":
    *rest, scr_ref = rest
  if return_indices:
    *rest, idx_ref, cnt_ref = rest

  def slot_source(b, h):
    j, keep = _sel._keep_flags(lens_ref, s_ref, b, h, **sel)
    keep_i = keep.astype(jnp.int32)
    incl = jnp.cumsum(keep_i)                                        # [nb_pad]
    count = jnp.sum(keep_i)
    if return_indices:
      @pl.when(pl.program_id(2) == 0)
      def _write_list():                 # the selection kernel's stable-partition stores
        slot = jnp.where(keep, incl - 1, count + j - incl)
        plgpu.store(idx_ref.at[b, h, slot], jnp.where(keep, j, -1), mask=slot < width)
        plgpu.store(cnt_ref.at[b, h], count)

    if lookup == "scratch":
      # This split's share of the list (``decode._kernel``'s begin / end) to the scratch, then
      # the loop loads its block ids from there as ``sparse_decode`` loads the index list.
      # Memory order (as the merge of ``decode._kernel``): ``token`` (= 0: this split holds
      # end - begin slots, but no compiler can prove it, so it is not folded away) is a
      # reduction over the [nb_pad] flags, which span all warps, so it passes through shared
      # memory and a CTA barrier placed after the stores; every id load's address depends on
      # it.
      split = pl.program_id(2)
      if attn["split_stride"] != 1:
        split = (split * attn["split_stride"]) % attn["num_splits"]
      per_split = _dec._split_share(count, attn["num_splits"], attn.get("blocks_per_step", 1))
      begin = jnp.minimum(split * per_split, count)
      end = jnp.minimum(begin + per_split, count)
      pos = incl - 1
      mine = keep & (pos >= begin) & (pos < end)
      slot = jnp.where(keep, pos, count + j - incl)                  # distinct for every lane
      plgpu.store(scr_ref.at[b, h, slot], j, mask=mine)
      token = jnp.sum(mine.astype(jnp.int32)) - (end - begin)

      def blk_at(p):
        return plgpu.load(scr_ref.at[b, h, jnp.minimum(p + token, width - 1)])
    else:
      def blk_at(p):
        # Kept block number p (ascending) = #{j: incl[j] <= p} for p < count: the blocks
        # before it hold at most p kept ones, the block itself and later ones at least p + 1.
        return jnp.sum((incl <= p).astype(jnp.int32))

    return count, blk_at

  _dec._kernel(lens_ref, None, None, q_ref, k_ref, v_ref, *rest, slot_source=slot_source,
               **attn)


@functools.partial(jax.jit, static_argnames=(
    "block_size", "top_k", "num_init_blocks", "num_local_blocks", "num_splits", "scale",
    "out_dtype", "digit_bits", "search_chunk", "search_loop", "lookup", "num_warps",
    "num_stages", "return_indices", "interpret", "_split_stride", "lengths_group",
    "blocks_per_step"))
def sparse_decode_select_attend(q, k, v, kv_lengths, scores, page_table=None, arrivals=None, *,
                                block_size, top_k, num_init_blocks=1, num_local_blocks=1,
                                num_splits=None, scale=None, out_dtype=None, digit_bits=2,
                                search_chunk=None, search_loop="unrolled", lookup="reduce",
                                num_warps=4, num_stages=3, return_indices=False, interpret=False,
                                _split_stride=1, lengths_group=1, blocks_per_step=1):
  """Block selection, split-KV attention over the kept blocks and the merge, in one launch.

  ``select_decode_slots`` + ``sparse_decode`` (merged) as one kernel: each (batch, kv head,
  split) program selects from the scores row of (batch, kv head), takes its share of the
  ascending kept list (the first ``count`` slots split evenly, as ``sparse_decode`` with
  counts) and runs ``sparse_decode``'s loop and merge. Same output and lse to the bit.

  Args:
    q: [batch, q_heads, head_dim].
    k: contiguous cache [batch, max_len, kv_heads, head_dim], or with ``page_table`` a page
      pool [num_pages, block_size, kv_heads, head_dim].
    v: like ``k`` with its own last dim.
    kv_lengths: int32 [batch], including the new token (query at kv_lengths - 1).
    scores: fp32 [batch, kv_heads, num_blocks] (``decode_block_scores`` or
      :func:`decode_block_scores_arrivals`); num_blocks = cdiv(max_len, block_size)
      (contiguous) or max_pages (paged).
    page_table: None or int32 [batch, max_pages] (page size = block_size).
    arrivals: None or int32 [batch, kv_heads] zeros (donated; e.g.
      :func:`decode_block_scores_arrivals`'s); None makes zeros (an XLA memset). Unused with
      one split.
    block_size: tokens per block, a power of two >= 16.
    top_k, num_init_blocks, num_local_blocks: as ``jattn.sparse.select_decode_blocks``.
    num_splits: splits per (batch, kv head); default ``decode.default_num_splits``.
    scale: logit scale, default 1/sqrt(head_dim).
    out_dtype: output dtype (default q.dtype).
    digit_bits, search_chunk: the threshold search, as ``select_decode_slots`` (default 2:
      the radix search; every value gives the same selection).
    search_loop: "unrolled" (default: the search's steps as straight-line code, as
      ``select_decode_slots``) or "rolled" (the steps as one loop in the kernel: at the bench
      shape the prologue before the first K/V copy shrinks from ~4.9k to ~1.4k SASS
      instructions at digit_bits 2, see docs/sparse.md) or "early" (digit_bits 1 only: stop
      at the first trial counting exactly top_k keys, ``select_decode_slots``). The same
      selection and output.
    lookup: how a loop step finds its block id: "reduce" (default: #{j: incl[j] <= slot}, a
      [nb_pad] compare + sum one step ahead, registers only) or "scratch" (each split stores
      its share of the list to an HBM scratch after the selection, then loads ids from it as
      ``sparse_decode`` loads its index list; a CTA barrier orders the two). The same output.
    num_warps, num_stages: launch parameters.
    return_indices: also return the kept lists int32 [batch, kv_heads, width] (ascending, -1
      padded; width = min(init + local + top_k, num_blocks), at least 1) and counts int32
      [batch, kv_heads], written by split 0.
    interpret: run in the Pallas interpreter (CPU tests).
    _split_stride: tests only: program s handles split (s * stride) % num_splits, so another
      split than the last arrives last in the interpreter.
    lengths_group: consecutive sequences that share one length (kv_lengths [batch /
      lengths_group]; a head-major cache seen as batch x kv_heads sequences of one kv head,
      as ``decode_select.decode_block_scores``).
    blocks_per_step: kept blocks per loop step (a power of two, ``decode.sparse_decode``'s
      option); more than 1 needs ``lookup="scratch"``.

  Returns:
    (out [batch, q_heads, head_dim_v] in out_dtype, lse [batch, q_heads] fp32), then indices
    and counts with ``return_indices``.

  Example:
    >>> q = jnp.ones((1, 4, 16)); k = jnp.ones((1, 96, 2, 16))
    >>> s = jnp.arange(12.0).reshape(1, 2, 6)
    >>> out, lse, idx, cnt = sparse_decode_select_attend(
    ...     q, k, k, jnp.array([80]), s, block_size=16, top_k=1, num_splits=2,
    ...     return_indices=True, interpret=True)
    >>> out.shape, idx.tolist(), cnt.tolist()
    ((1, 4, 16), [[[0, 3, 4], [0, 3, 4]]], [[3, 3]])
  """
  if block_size < 16 or block_size & (block_size - 1):
    raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
  bsz, hq, d = q.shape
  dv = v.shape[-1]
  if k.ndim != 4 or k.shape[-1] != d or v.shape[:-1] != k.shape[:-1]:
    raise ValueError(f"k must be [.., .., kv_heads, head_dim={d}] and v share all but its last "
                     f"dim, got k {k.shape}, v {v.shape}")
  paged = page_table is not None
  if paged:
    num_pages, page_size, hk, _ = k.shape
    if page_size != block_size:
      raise ValueError(f"page size {page_size} must equal block_size {block_size}")
    nb = page_table.shape[1]
    capacity = nb * page_size
    k = k.reshape(num_pages * page_size, hk, d)
    v = v.reshape(num_pages * page_size, hk, dv)
  else:
    if k.shape[0] != bsz:
      raise ValueError(f"q batch {bsz} != cache batch {k.shape[0]}")
    _, capacity, hk, _ = k.shape
    nb = pl.cdiv(capacity, block_size)
  if hq % hk:
    raise ValueError(f"q_heads ({hq}) must be a multiple of kv_heads ({hk})")
  if scores.shape != (bsz, hk, nb):
    raise ValueError(f"scores must be [batch, kv_heads, num_blocks] = {(bsz, hk, nb)}, got "
                     f"{scores.shape}")
  width = decode_width(nb, top_k, num_init_blocks, num_local_blocks)
  if num_splits is None:
    num_splits = _dec.default_num_splits(bsz, hk, width)
  num_splits = int(num_splits)
  if num_splits < 1:
    raise ValueError(f"num_splits must be >= 1, got {num_splits}")

  if lookup not in ("reduce", "scratch"):
    raise ValueError(f"lookup must be 'reduce' or 'scratch', got {lookup!r}")
  bps = int(blocks_per_step)
  if bps < 1 or bps & (bps - 1):
    raise ValueError(f"blocks_per_step must be a power of two, got {blocks_per_step}")
  if bps > 1 and lookup != "scratch":
    raise ValueError("blocks_per_step > 1 needs lookup='scratch' (the 'reduce' lookup finds "
                     "one block id per step)")
  _dec._check_lengths(kv_lengths, bsz, int(lengths_group), "kv_lengths")
  if math.gcd(int(_split_stride), num_splits) != 1:
    raise ValueError(f"_split_stride {_split_stride} must be coprime with num_splits "
                     f"{num_splits}")
  _, sel = _sel._selection_params(nb, block_size, top_k, num_init_blocks, num_local_blocks,
                                  width, num_warps, digit_bits, search_chunk, search_loop)
  sel.pop("width")
  if lengths_group != 1:
    sel["len_group"] = int(lengths_group)
  group = hq // hk
  if scale is None:
    scale = 1.0 / math.sqrt(d)
  kernel = functools.partial(
      _fused_kernel, sel=sel, width=width, return_indices=bool(return_indices), lookup=lookup,
      scale=float(scale), block=int(block_size), group=group, g_pad=_pow2(group), head_dim=d,
      d_pad=_pow2(d), head_dim_v=dv, dv_pad=_pow2(dv), num_splits=num_splits, num_slots=width,
      capacity=capacity, paged=paged, merge=True, split_stride=int(_split_stride),
      len_group=int(lengths_group), blocks_per_step=bps)
  args = [kv_lengths.astype(jnp.int32), scores.astype(jnp.float32), q, k, v]
  if paged:
    args.append(page_table.astype(jnp.int32))
  out_shape, aliases = _dec._merged_outputs(
      args, arrivals, bsz=bsz, hq=hq, hk=hk, dv=dv, num_splits=num_splits,
      out_dtype=q.dtype if out_dtype is None else out_dtype)
  if return_indices:
    out_shape += [jax.ShapeDtypeStruct((bsz, hk, width), jnp.int32),
                  jax.ShapeDtypeStruct((bsz, hk), jnp.int32)]
  if lookup == "scratch":
    out_shape.append(jax.ShapeDtypeStruct((bsz, hk, width), jnp.int32))
  res = pl.pallas_call(
      kernel, out_shape=out_shape, grid=(bsz, hk, num_splits), input_output_aliases=aliases,
      compiler_params=compat.triton_compiler_params(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret, name="jattn_sparse_decode_select_attend")(*args)
  if return_indices:
    n = len(res) - (lookup == "scratch")
    return res[0], res[1], res[n - 2], res[n - 1]
  return res[0], res[1]


# ----------------------------------------------------------------------------- scores
def _score_arrivals_kernel(slen_ref, q_ref, sums_ref, o_ref, arr_ref, **kw):
  """``decode_select._score_kernel``, plus: the chunk-0 program zeroes arr[b, h]."""
  _sel._score_kernel(slen_ref, q_ref, sums_ref, o_ref, **kw)
  b, h = pl.program_id(0), pl.program_id(1)

  @pl.when(pl.program_id(2) == 0)
  def _zero():
    plgpu.store(arr_ref.at[b, h], jnp.int32(0))


@functools.partial(jax.jit, static_argnames=("block_size", "chunk", "num_warps", "interpret",
                                             "lengths_group"))
def decode_block_scores_arrivals(q, sums, summary_lengths, *, block_size, chunk=64,
                                 num_warps=4, interpret=False, lengths_group=1):
  """``decode_select.decode_block_scores`` (the same scores, to the bit) and zeroed counters.

  Args:
    q, sums, summary_lengths, block_size, chunk, num_warps, interpret, lengths_group: as
      ``decode_block_scores``.

  Returns:
    (scores fp32 [batch, kv_heads, num_blocks], int32 [batch, kv_heads] zeros: the arrival
    counters of :func:`sparse_decode_select_attend`, written by the kernel, no memset).

  Example:
    >>> q = jnp.ones((1, 4, 16)); sums = jnp.ones((1, 3, 2, 16))
    >>> s, arr = decode_block_scores_arrivals(q, sums, jnp.array([40]), block_size=16,
    ...                                       interpret=True)
    >>> s[0, 0].tolist(), arr.tolist()
    ([2.0, 2.0, 4.0], [[0, 0]])
  """
  bsz, hk, nb, d, group, chunk = _sel._check_score_inputs(q, sums, chunk)
  _dec._check_lengths(summary_lengths, bsz, int(lengths_group), "summary_lengths")
  kernel = functools.partial(_score_arrivals_kernel, block=int(block_size), chunk=chunk,
                             group=group, g_pad=_pow2(group), head_dim=d, d_pad=_pow2(d),
                             num_blocks=nb, len_group=int(lengths_group))
  return pl.pallas_call(
      kernel, out_shape=[jax.ShapeDtypeStruct((bsz, hk, nb), jnp.float32),
                         jax.ShapeDtypeStruct((bsz, hk), jnp.int32)],
      grid=(bsz, hk, pl.cdiv(nb, chunk)),
      compiler_params=compat.triton_compiler_params(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="jattn_sparse_decode_scores_arrivals")(
          summary_lengths.astype(jnp.int32), q, sums.astype(jnp.float32))


def sparse_decode_fused(q, k, v, kv_lengths, sums, summary_lengths, page_table=None, *,
                        block_size, top_k, num_init_blocks=1, num_local_blocks=1,
                        num_splits=None, scale=None, digit_bits=2, return_lse=False,
                        return_indices=False, interpret=False, lengths_group=1, **kw):
  """Sparse decode in two launches: :func:`decode_block_scores_arrivals`, then
  :func:`sparse_decode_select_attend` (the counters from the first, no memset).

  The "triton" ``jattn.sparse.sparse_decode_attention`` / ``sparse_paged_decode_attention``
  (layout "nhd") in two launches instead of three: the same selection and output.

  Args:
    q, k, v, kv_lengths, page_table, block_size, top_k, num_init_blocks, num_local_blocks,
      num_splits, scale, digit_bits, interpret, lengths_group: as
      :func:`sparse_decode_select_attend` (lengths_group also for the summaries' lengths).
    sums, summary_lengths: ``BlockSummaries.sums`` and ``.lengths`` (layout "nhd").
    return_lse, return_indices: also return lse [batch, q_heads] and/or the kept lists
      [batch, kv_heads, width].
    **kw: more options of :func:`sparse_decode_select_attend` (num_warps, num_stages, ...).

  Returns:
    out [batch, q_heads, head_dim_v] in q.dtype; then lse and/or indices if requested.

  Example:
    >>> import jattn.sparse as sp
    >>> k = jax.random.normal(jax.random.key(0), (1, 256, 2, 16)); lens = jnp.array([200])
    >>> s = sp.init_block_summaries(k, lens, block_size=16)
    >>> q = jax.random.normal(jax.random.key(1), (1, 4, 16))
    >>> out = sparse_decode_fused(q, k, k, lens, s.sums, s.lengths, block_size=16, top_k=3,
    ...                           num_splits=2, interpret=True)
    >>> ref = sp.sparse_decode_attention(q, k, k, lens, s, block_size=16, top_k=3,
    ...                                  implementation="xla")
    >>> bool(jnp.allclose(out, ref, atol=1e-5))
    True
  """
  scores, arrivals = decode_block_scores_arrivals(q, sums, summary_lengths,
                                                  block_size=block_size, interpret=interpret,
                                                  lengths_group=lengths_group)
  res = sparse_decode_select_attend(
      q, k, v, jnp.asarray(kv_lengths, jnp.int32), scores, page_table, arrivals,
      block_size=block_size, top_k=top_k, num_init_blocks=num_init_blocks,
      num_local_blocks=num_local_blocks, num_splits=num_splits, scale=scale,
      digit_bits=digit_bits, return_indices=return_indices, interpret=interpret,
      lengths_group=lengths_group, **kw)
  out = (res[0],)
  if return_lse:
    out += (res[1],)
  if return_indices:
    out += (res[2],)
  return out[0] if len(out) == 1 else out
