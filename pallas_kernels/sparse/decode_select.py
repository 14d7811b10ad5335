"""The selection of ``jattn.sparse.select_decode_blocks`` as Pallas kernels (Triton lowering),
without XLA's sort: block scores (:func:`decode_block_scores`), the kept blocks by a bit search
for the k-th largest score (:func:`select_decode_slots`; ties to the lower block id, as
``lax.top_k``), or both in one launch (:func:`score_select_decode_slots`).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import compat
from pallas_kernels.common.util import next_pow2
from pallas_kernels.decode.triton import load_group_query
from pallas_kernels.sparse.decode import check_lengths, default_num_splits, length_row
from pallas_kernels.sparse.topk import INT_MIN, bit_search, keep_top, total_order_key

__all__ = ["decode_block_scores", "select_decode_slots", "score_select_decode_slots",
           "default_score_splits", "decode_width"]

_NEG_INF_KEY = -2139095041           # total_order_key(-inf): 0xff800000 ^ 0x7fffffff
SCORE_CHUNK = 64                     # blocks per score tile ([64, head_dim] fp32 key sums)


def decode_width(num_blocks, top_k, num_init_blocks, num_local_blocks):
  """Static width of the kept-block lists: max(1, min(forced + top_k, num_blocks)).

  Args:
    num_blocks: blocks in the cache (``BlockSummaries.num_blocks``).
    top_k, num_init_blocks, num_local_blocks: as ``jattn.sparse.select_decode_blocks`` (a float
      top_k counts as round(top_k * num_blocks) chosen blocks).

  Returns:
    int.

  Example:
    >>> decode_width(2048, 387, 1, 1)
    389
  """
  n_forced = min(num_init_blocks, num_blocks) + min(num_local_blocks, num_blocks)
  top_k = int(top_k * num_blocks + 0.5) if isinstance(top_k, float) else top_k
  return max(1, min(n_forced + min(top_k, num_blocks), num_blocks))


def _score_share(slen_ref, q_ref, sums_ref, s_ref, b, h, split, *, chunks_per_split, chunk,
                 group, g_pad, head_dim, d_pad, block, num_blocks, len_group=1):
  """Scores of chunks split * chunks_per_split .. + chunks_per_split - 1 of (b, h)'s blocks
  (``chunk`` blocks each, one [chunk, d_pad] load of the key sums) into s_ref: the group's summed
  queries . key sum / max(count, 1), fp32 (sequence b's summary length is slen[b // len_group]).
  Returns ``arrived`` (= 1) to count the arrival with. Memory order as in ``sparse_decode``'s
  merge: it reduces the whole [g_pad, d_pad] query tile across all warps (a CTA barrier after
  the score stores), the atomic increment depends on it, and the selection's loads (of scores
  other threads and programs stored) follow the atomic's broadcast result."""
  q, (_, cols, _, col_ok, q_mask) = load_group_query(
      q_ref, b, h, group=group, g_pad=g_pad, head_dim=head_dim, d_pad=d_pad)  # [g_pad, d_pad]
  qsum = jnp.sum(q.astype(jnp.float32), axis=0)                      # [d_pad], padded rows 0
  for i in range(chunks_per_split):
    rows = (split * chunks_per_split + i) * chunk + jnp.arange(chunk, dtype=jnp.int32)  # block ids
    row_ok = rows < num_blocks
    mask = row_ok[:, None] if col_ok is None else row_ok[:, None] & col_ok[None, :]
    sums = plgpu.load(sums_ref.at[b, rows[:, None], h, cols[None, :]], mask=mask, other=0.0)
    dots = jnp.sum(sums.astype(jnp.float32) * qsum[None, :], axis=1)  # [chunk] fp32
    length = plgpu.load(slen_ref.at[length_row(b, len_group)])
    cnt = jnp.clip(length - rows * block, 0, block)
    plgpu.store(s_ref.at[b, h, rows], dots / jnp.maximum(cnt, 1).astype(jnp.float32),
                mask=row_ok)
  return jnp.minimum(jnp.sum(q_mask.astype(jnp.int32)), 1)


def _score_kernel(slen_ref, q_ref, sums_ref, o_ref, **kw):
  """One (batch, kv head, chunk) program. Refs: slen [B / len_group] (positions summarised);
  q [B, Hq, D]; sums [B, N, Hk, D] fp32; output scores [B, Hk, N] fp32."""
  _score_share(slen_ref, q_ref, sums_ref, o_ref, pl.program_id(0), pl.program_id(1),
               pl.program_id(2), chunks_per_split=1, **kw)


def _check_score_inputs(q, sums, summary_lengths, block_size, lengths_group):
  """Checks q [batch, q_heads, head_dim] against the block sums and their lengths; returns (batch,
  kv_heads, num_blocks, the static keywords of ``_score_share`` but ``chunks_per_split``)."""
  bsz, hq, d = q.shape
  _, nb, hk, ds = sums.shape
  if ds != d or hq % hk or sums.shape[0] != bsz:
    raise ValueError(f"q {q.shape} does not match the block sums {sums.shape}")
  check_lengths(summary_lengths, bsz, lengths_group, "summary_lengths")
  return bsz, hk, nb, dict(chunk=min(SCORE_CHUNK, next_pow2(nb, minimum=16)), group=hq // hk,
                           g_pad=next_pow2(hq // hk, minimum=16), head_dim=d,
                           d_pad=next_pow2(d, minimum=16), block=int(block_size), num_blocks=nb,
                           len_group=int(lengths_group))


@functools.partial(jax.jit, static_argnames=("block_size", "interpret", "lengths_group"))
def decode_block_scores(q, sums, summary_lengths, *, block_size, interpret=False, lengths_group=1):
  """Block scores of one decode query per sequence against the running key sums.

  Args:
    q: [batch, q_heads, head_dim].
    sums, summary_lengths: ``BlockSummaries.sums`` (fp32 [batch, num_blocks, kv_heads,
      head_dim]) and ``.lengths`` (int32 [batch]; block j averages clip(length - j * block_size,
      0, block_size) keys).
    block_size: positions per block.
    interpret: run in the Pallas interpreter (CPU tests).
    lengths_group: sequences sharing one length (sequence b reads entry b // lengths_group).

  Returns:
    fp32 [batch, kv_heads, num_blocks]: sum over the group's query heads of q . mean key.

  Example:
    >>> q = jnp.ones((1, 4, 16)); sums = jnp.ones((1, 3, 2, 16))
    >>> decode_block_scores(q, sums, jnp.array([40]), block_size=16, interpret=True)[0, 0]
    Array([2., 2., 4.], dtype=float32)
  """
  bsz, hk, nb, kw = _check_score_inputs(q, sums, summary_lengths, block_size, lengths_group)
  return pl.pallas_call(
      functools.partial(_score_kernel, **kw),
      out_shape=jax.ShapeDtypeStruct((bsz, hk, nb), jnp.float32),
      grid=(bsz, hk, pl.cdiv(nb, kw["chunk"])),
      compiler_params=compat.triton_compiler_params(num_warps=4, num_stages=1),
      interpret=interpret, name="jattn_sparse_decode_scores")(
          summary_lengths.astype(jnp.int32), q, sums.astype(jnp.float32))


def _keep_flags(len_ref, s_ref, b, h, *, block, num_blocks, nb_pad, num_init, num_local, top_k,
                len_group):
  """The kept set of (batch b, kv head h): (block ids [nb_pad], keep [nb_pad] bool)."""
  j = jnp.arange(nb_pad, dtype=jnp.int32)                            # [nb_pad] block ids
  real = j < num_blocks
  length = jnp.minimum(plgpu.load(len_ref.at[length_row(b, len_group)]), num_blocks * block)
  diag = jnp.where(length > 0, (length - 1) // block, -1)            # the query's block
  visible = j <= diag
  forced = j < num_init
  if num_local > 0:
    forced = forced | (j > diag - num_local)
  forced = visible & forced
  keep = forced
  if top_k > 0:
    cand = visible & ~forced
    s = plgpu.load(s_ref.at[b, h, j], mask=real, other=0.0)          # [nb_pad] fp32
    # lax.top_k(where(cand, s, -inf), top_k) over the real blocks (ties to the lower block id)
    key = jnp.where(cand, total_order_key(s), _NEG_INF_KEY)
    t_u, c_t = bit_search(key, real, top_k=top_k, n_real=num_blocks)
    thr = t_u ^ INT_MIN
    # exactly top_k keys >= thr (the usual case): all of them, no rank of the ties
    keep = keep | jax.lax.cond(c_t == top_k, lambda: cand & (key >= thr) & real,
                               lambda: cand & keep_top(key, thr, real, top_k))
  return j, keep


def _select_body(len_ref, s_ref, idx_ref, cnt_ref, arr_ref=None, *, b=None, h=None, width,
                 **flags):
  """The selection of (batch b, kv head h) from its scores in ``s_ref``: writes idx[b, h] and
  cnt[b, h], and zeroes arr[b, h] (the merged decode kernel's counter) unless arr_ref is None.
  Called by the fused score + selection kernel, or the selection kernel itself (b, h None: one
  (batch, kv head) program; refs len [B / len_group] (query position + 1), scores [B, Hk, N]
  fp32, outputs idx [B, Hk, width], cnt [B, Hk] and optionally the counters [B, Hk], int32)."""
  if b is None:
    b, h = pl.program_id(0), pl.program_id(1)
  j, keep = _keep_flags(len_ref, s_ref, b, h, **flags)
  keep_i = keep.astype(jnp.int32)
  incl = jnp.cumsum(keep_i)                                          # [nb_pad]
  count = jnp.sum(keep_i)
  # Stable partition: kept blocks in ascending order at 0..count-1, every other lane at a
  # distinct slot >= count (holding -1), so each of the first ``width`` slots is written once.
  slot = jnp.where(keep, incl - 1, count + j - incl)
  plgpu.store(idx_ref.at[b, h, slot], jnp.where(keep, j, -1), mask=slot < width)
  plgpu.store(cnt_ref.at[b, h], count)
  if arr_ref is not None:
    plgpu.store(arr_ref.at[b, h], jnp.int32(0))


def _selection_params(kv_lengths, bsz, nb, block_size, top_k, num_init_blocks, num_local_blocks,
                      max_selected, lengths_group):
  """Checks kv_lengths; returns (num_warps, static keywords of ``_select_body``). Warps grow with
  the blocks: 4, 8 from 2048 blocks (faster than 4 or 16 there), at most 16."""
  check_lengths(kv_lengths, bsz, lengths_group, "kv_lengths")
  nb_pad = next_pow2(nb, minimum=16)
  num_warps = int(min(16, max(8 if nb_pad >= 2048 else 4, nb_pad // 512)))
  sel = dict(block=int(block_size), num_blocks=nb, nb_pad=nb_pad,
             num_init=int(num_init_blocks), num_local=int(num_local_blocks),
             top_k=int(min(top_k, nb)), width=int(max_selected), len_group=int(lengths_group))
  return num_warps, sel


@functools.partial(jax.jit, static_argnames=("block_size", "top_k", "num_init_blocks",
                                             "num_local_blocks", "max_selected", "interpret",
                                             "return_arrivals", "lengths_group"))
def select_decode_slots(scores, kv_lengths, *, block_size, top_k, num_init_blocks,
                        num_local_blocks, max_selected, interpret=False, return_arrivals=False,
                        lengths_group=1):
  """Kept blocks of one decode query per sequence: initial, local and the top_k by score.

  Args:
    scores: fp32 [batch, kv_heads, num_blocks] (``decode_block_scores``).
    kv_lengths: int32 [batch / lengths_group], including the new token (query at kv_lengths -
      1); clamped to num_blocks * block_size.
    block_size, interpret, lengths_group: as :func:`decode_block_scores`.
    top_k, num_init_blocks, num_local_blocks: as ``jattn.sparse.select_decode_blocks``.
    max_selected: output width, at least the most blocks a row can keep (:func:`decode_width`).
    return_arrivals: also return int32 [batch, kv_heads] zeros (``sparse_decode``'s counters).

  Returns:
    (indices int32 [batch, kv_heads, max_selected]: kept block ids ascending, then -1;
    counts int32 [batch, kv_heads]), then the zeroed counters if ``return_arrivals``.

  Example:
    >>> s = jnp.array([[[0.0, 5.0, 1.0, 3.0, 2.0, 9.0]]])
    >>> idx, cnt = select_decode_slots(s, jnp.array([80]), block_size=16, top_k=2,
    ...                                num_init_blocks=1, num_local_blocks=1, max_selected=4,
    ...                                interpret=True)
    >>> idx.tolist(), cnt.tolist()
    ([[[0, 1, 3, 4]]], [[4]])
  """
  bsz, hk, nb = scores.shape
  num_warps, sel = _selection_params(kv_lengths, bsz, nb, block_size, top_k, num_init_blocks,
                                     num_local_blocks, max_selected, lengths_group)
  out_shape = ([jax.ShapeDtypeStruct((bsz, hk, max_selected), jnp.int32)]          # idx, cnt
               + [jax.ShapeDtypeStruct((bsz, hk), jnp.int32)] * (2 if return_arrivals else 1))
  return pl.pallas_call(
      functools.partial(_select_body, **sel), out_shape=out_shape, grid=(bsz, hk),
      compiler_params=compat.triton_compiler_params(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="jattn_sparse_decode_select")(
          kv_lengths.astype(jnp.int32), scores.astype(jnp.float32))


def _score_select_kernel(slen_ref, len_ref, q_ref, sums_ref, *rest, score, score_splits,
                         split_stride, **sel):
  """One (batch, kv head, score split) program: scores (``score``: keywords of ``_score_share``),
  then (last to arrive) the selection. Refs: slen [B] (positions summarised); len [B] (query
  position + 1); q [B, Hq, D]; sums [B, N, Hk, D] fp32; with score_splits > 1 the arrival
  counters [B, Hk] int32 (zeros, input aliased to the last output). Outputs: scores [B, Hk, N]
  fp32, idx [B, Hk, width] int32, cnt [B, Hk] int32, then the counters (with score_splits > 1,
  or when requested: set to 0)."""
  s_ref, idx_ref, cnt_ref, *arr = rest[1:] if score_splits > 1 else rest   # [1:]: the input
  arr_ref = arr[0] if arr else None
  b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  if split_stride != 1:                  # tests: make a split other than S-1 arrive last
    split = (split * split_stride) % score_splits
  arrived = _score_share(slen_ref, q_ref, sums_ref, s_ref, b, h, split, **score)
  if score_splits > 1:
    last = plgpu.atomic_add(arr_ref, (b, h), arrived) == score_splits - 1
  else:
    last = arrived == 1                  # always: orders the loads below after the barrier

  @pl.when(last)
  def _select():
    _select_body(len_ref, s_ref, idx_ref, cnt_ref, arr_ref, b=b, h=h, **sel)


def default_score_splits(batch, kv_heads, num_blocks, *, core_count=None, programs_per_core=2):
  """Score programs per (batch, kv head) of :func:`score_select_decode_slots`: about
  ``programs_per_core`` programs per multiprocessor, at most one per score tile.

  Args:
    batch, kv_heads, num_blocks: the call's batch, kv heads and cache blocks.
    core_count: multiprocessors (default: the GPU's); programs_per_core: programs per one.

  Returns:
    The number of score programs (>= 1).

  Example:
    >>> default_score_splits(1, 8, 2048, core_count=132)
    32
    >>> default_score_splits(64, 8, 2048, core_count=132)
    1
  """
  chunk = min(SCORE_CHUNK, next_pow2(num_blocks, minimum=16))        # blocks per score tile
  return default_num_splits(batch, kv_heads, num_blocks, core_count=core_count,
                            programs_per_core=int(programs_per_core), min_blocks_per_split=chunk)


@functools.partial(jax.jit, static_argnames=("block_size", "top_k", "num_init_blocks",
                                             "num_local_blocks", "max_selected", "score_splits",
                                             "return_arrivals", "return_scores", "interpret",
                                             "lengths_group", "_split_stride"))
def score_select_decode_slots(q, sums, summary_lengths, kv_lengths, *, block_size, top_k,
                              num_init_blocks, num_local_blocks, max_selected,
                              score_splits=None, return_arrivals=False, return_scores=False,
                              interpret=False, lengths_group=1, _split_stride=1):
  """:func:`decode_block_scores` and :func:`select_decode_slots` in one launch.

  Grid (batch, kv head, score split): each program scores its share into an HBM scratch; the
  last to arrive on a (batch, kv head) atomic counter selects and resets the counter to 0.
  The same scores and selection as the two kernels, to the bit.

  Args:
    q, sums, summary_lengths, block_size, interpret, lengths_group: as :func:`decode_block_scores`.
    kv_lengths, top_k, num_init_blocks, num_local_blocks, max_selected: as
      :func:`select_decode_slots`.
    score_splits: score programs per (batch, kv head); default :func:`default_score_splits`.
      Rounded so that every split has at least one score tile.
    return_arrivals, return_scores: also return the zeroed int32 [batch, kv_heads] arrival
      counters / the fp32 [batch, kv_heads, num_blocks] scores.
    _split_stride: tests only: program s scores split (s * stride) % score_splits.

  Returns:
    (indices int32 [batch, kv_heads, max_selected], counts int32 [batch, kv_heads]), then the
    counters if ``return_arrivals``, then the scores if ``return_scores``.

  Example:
    >>> q = jnp.ones((1, 4, 16)); sums = jnp.arange(6.0).reshape(1, 6, 1, 1) * jnp.ones(16)
    >>> idx, cnt = score_select_decode_slots(
    ...     q, sums, jnp.array([96]), jnp.array([96]), block_size=16, top_k=2,
    ...     num_init_blocks=1, num_local_blocks=1, max_selected=4, interpret=True)
    >>> idx.tolist(), cnt.tolist()
    ([[[0, 3, 4, 5]]], [[4]])
  """
  bsz, hk, nb, score = _check_score_inputs(q, sums, summary_lengths, block_size, lengths_group)
  n_chunks = pl.cdiv(nb, score["chunk"])
  score_splits = default_score_splits(bsz, hk, nb) if score_splits is None else score_splits
  if int(score_splits) < 1:
    raise ValueError(f"score_splits must be >= 1, got {score_splits}")
  per_split = pl.cdiv(n_chunks, min(int(score_splits), n_chunks))
  splits = pl.cdiv(n_chunks, per_split)
  if math.gcd(int(_split_stride), splits) != 1:
    raise ValueError(f"_split_stride {_split_stride} must be coprime with the {splits} splits")
  num_warps, sel = _selection_params(kv_lengths, bsz, nb, block_size, top_k, num_init_blocks,
                                     num_local_blocks, max_selected, lengths_group)
  kernel = functools.partial(_score_select_kernel, score=dict(score, chunks_per_split=per_split),
                             score_splits=splits, split_stride=int(_split_stride), **sel)
  args = [summary_lengths.astype(jnp.int32), kv_lengths.astype(jnp.int32), q,
          sums.astype(jnp.float32)]
  out_shape = [jax.ShapeDtypeStruct((bsz, hk, nb), jnp.float32),
               jax.ShapeDtypeStruct((bsz, hk, max_selected), jnp.int32),
               jax.ShapeDtypeStruct((bsz, hk), jnp.int32)]
  aliases = {len(args): 3} if splits > 1 else {}      # zeroed counters, updated in place
  if splits > 1 or return_arrivals:
    out_shape.append(jax.ShapeDtypeStruct((bsz, hk), jnp.int32))
  if splits > 1:
    args.append(jnp.zeros((bsz, hk), jnp.int32))
  res = pl.pallas_call(
      kernel, out_shape=out_shape, grid=(bsz, hk, splits), input_output_aliases=aliases,
      compiler_params=compat.triton_compiler_params(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="jattn_sparse_decode_score_select")(*args)
  return (res[1], res[2]) + ((res[3],) if return_arrivals else ()) + (
      (res[0],) if return_scores else ())
