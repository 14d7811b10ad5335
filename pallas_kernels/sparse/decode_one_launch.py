"""Top-K block-sparse decode in one launch: block scores, selection and attention (Triton).

The three steps of ``jattn.sparse``'s "triton" sparse decode (block scores, top-K selection,
split-KV attention over the kept blocks with its in-kernel merge) run as the roles of one
kernel, so the attention's programs do not wait for a kernel boundary: they load their query
and length while the selection runs, then start on the kept blocks as soon as their own
(batch, kv head)'s list is ready.

Roles by ticket. Every program first takes a ticket from a global counter (``atomic_add``),
in the order programs actually start. Tickets 0 .. B*Hk*score_splits - 1 are score tiles:
each scores its share of the blocks into an fp32 scratch (the score kernel's loads and
arithmetic) and counts its arrival on its (batch, kv head)'s counter; the tile that arrives
last runs the selection (``decode_select._select_body``: the same lists and counts) and then
raises the (batch, kv head)'s ready flag. The later tickets are the attention splits
(``decode._kernel``): each loads its length and queries, polls its ready flag (an atomic read,
acquire), then loads the count and list with volatile loads (from L2: a line of another
head's list may sit stale in L1) and runs the loop and the merge.

No deadlock: a program only waits for tickets smaller than its own, and a ticket is taken only
by a program that is running; score tiles never wait. The memory order of the flag is the
merge's (``decode._kernel``): the flag's value is computed from a reduction over every lane of
the selection's stores (shared memory and a CTA barrier after them), and the increment is
acq_rel at GPU scope.

In the interpreter (CPU tests) programs run one at a time in grid order, so each ticket is its
program id and every flag is up before its first poll: there the wait is that one poll (the
interpreter cannot run a loop around an atomic), and a flag not yet up would show as a wrong
result, not a hang.

Counters (ticket, score arrivals, ready flags, attention arrivals) start as zeros made by XLA
(one memset before the launch).
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

__all__ = ["sparse_decode_one_launch"]

def _one_launch_kernel(slen_ref, len_ref, q_ref, sums_ref, k_ref, v_ref, *refs, bsz, hk,
                       score_splits, chunks_per_split, chunk, group, g_pad, head_dim, d_pad,
                       len_group, sel, attn, spin):
  """One program: a score tile (and, last to arrive, the selection) or an attention split.

  Refs: slen, len [B / len_group]; q [B, Hq, D]; sums [B, N, Hk, D] fp32; k, v [B, L, Hk, D |
  Dv]; the counters (inputs, aliased to the last outputs); outputs scores [B, Hk, N] fp32,
  idx [B, Hk, width], cnt [B, Hk], out [B, Hq, Dv], lse [B, Hq], with S > 1 the partials o
  [B, S, Hq, Dv] and lse [B, S, Hq] (scratch), then the counters: ticket [1], score arrivals
  and ready flags [B, Hk], with S > 1 the attention arrivals [B, Hk].
  """
  if attn["num_splits"] > 1:
    (_, _, _, _, s_ref, idx_ref, cnt_ref, out_ref, lse_out_ref, o_ref, lse_ref,
     tk_ref, sa_ref, rd_ref, aa_ref) = refs
    merge_refs = (None, out_ref, lse_out_ref, aa_ref, o_ref, lse_ref)
  else:                                  # one split: no partials, no attention counter
    _, _, _, s_ref, idx_ref, cnt_ref, out_ref, lse_out_ref, tk_ref, sa_ref, rd_ref = refs
    merge_refs = (out_ref, lse_out_ref)
  ticket = plgpu.atomic_add(tk_ref, (jnp.int32(0),), jnp.int32(1))
  n_score = bsz * hk * score_splits

  @pl.when(ticket < n_score)
  def _score():
    split = ticket % score_splits
    bh = ticket // score_splits
    b, h = bh // hk, bh % hk
    arrived = _sel._score_share(slen_ref, q_ref, sums_ref, s_ref, b, h, split,
                                chunks_per_split=chunks_per_split, chunk=chunk, group=group,
                                g_pad=g_pad, head_dim=head_dim, d_pad=d_pad,
                                block=sel["block"], num_blocks=sel["num_blocks"],
                                len_group=len_group)
    last = plgpu.atomic_add(sa_ref, (b, h), arrived) == score_splits - 1

    @pl.when(last)
    def _select():
      written = _sel._select_body(len_ref, s_ref, idx_ref, cnt_ref, b, h, len_group=len_group,
                                  **sel)
      plgpu.atomic_add(rd_ref, (b, h), jnp.minimum(written, 1))     # the list is ready

  @pl.when(ticket >= n_score)
  def _attend():
    u = ticket - n_score
    split = u % attn["num_splits"]
    bh = u // attn["num_splits"]
    b, h = bh // hk, bh % hk

    def wait(b, h):
      flag = plgpu.atomic_add(rd_ref, (b, h), jnp.int32(0))         # acquire
      if spin:
        jax.lax.while_loop(lambda f: f == 0,
                           lambda f: plgpu.atomic_add(rd_ref, (b, h), jnp.int32(0)), flag)

    _dec._kernel(len_ref, idx_ref, cnt_ref, q_ref, k_ref, v_ref, *merge_refs,
                 pids=(b, h, split), wait=wait, lists_volatile=True,
                 merge=True, len_group=len_group, **attn)


@functools.partial(jax.jit, static_argnames=(
    "block_size", "top_k", "num_init_blocks", "num_local_blocks", "max_selected",
    "num_splits", "score_splits", "chunk", "scale", "out_dtype", "num_warps", "num_stages",
    "blocks_per_step", "prefetch_ids", "search_loop", "lengths_group", "interpret"))
def sparse_decode_one_launch(q, k, v, kv_lengths, sums, summary_lengths, *, block_size, top_k,
                             num_init_blocks=1, num_local_blocks=1, max_selected=None,
                             num_splits=None, score_splits=None, chunk=64, scale=None,
                             out_dtype=None, num_warps=4, num_stages=2, blocks_per_step=2,
                             prefetch_ids=True, search_loop=None, lengths_group=1,
                             interpret=False):
  """Block scores, top-K selection and sparse decode attention in one Triton launch.

  The same selection (lists and counts, to the bit) as ``score_select_decode_slots`` and the
  attention of ``decode.sparse_decode`` on it (same blocks, same split of them, same merge) on
  a contiguous cache; the roles and their order are in the module docstring.

  Args:
    q: [batch, q_heads, head_dim].
    k, v: contiguous cache [batch, max_len, kv_heads, head_dim | head_dim_v].
    kv_lengths: int32 [batch / lengths_group], including the new token (query at
      kv_lengths - 1).
    sums: fp32 block key sums [batch, num_blocks, kv_heads, head_dim]
      (``BlockSummaries.sums``, layout "nhd").
    summary_lengths: int32 [batch / lengths_group]: positions the sums cover.
    block_size: tokens per block, a power of two >= 16.
    top_k, num_init_blocks, num_local_blocks: as ``jattn.sparse.select_decode_blocks``.
    max_selected: list width (default min(init + local + top_k, num_blocks), at least 1).
    num_splits: attention splits per (batch, kv head) (default ``decode.default_num_splits``).
    score_splits: score tiles' programs per (batch, kv head) (default
      ``decode_select.default_score_splits``).
    chunk: blocks per score tile, a power of two >= 16 (as ``decode_block_scores``).
    scale: logit scale, default 1/sqrt(head_dim).
    out_dtype: output dtype (default q.dtype).
    num_warps, num_stages, blocks_per_step, prefetch_ids: the attention's launch options (as
      ``decode.sparse_decode``; one num_warps for every role).
    search_loop: the selection's bit search (as ``select_decode_slots``).
    lengths_group: both lengths arrays hold one entry per that many consecutive sequences (a
      head-major cache seen as batch x kv_heads sequences).
    interpret: run in the Pallas interpreter (CPU tests).

  Returns:
    (out [batch, q_heads, head_dim_v] in out_dtype, lse [batch, q_heads] fp32, indices int32
    [batch, kv_heads, max_selected] (kept block ids ascending, then -1), counts int32
    [batch, kv_heads]).

  Example:
    >>> import jattn.sparse as sp
    >>> k = jax.random.normal(jax.random.key(0), (1, 256, 2, 16)); lens = jnp.array([200])
    >>> s = sp.init_block_summaries(k, lens, block_size=16)
    >>> q = jax.random.normal(jax.random.key(1), (1, 4, 16))
    >>> out, lse, idx, cnt = sparse_decode_one_launch(
    ...     q, k, k, lens, s.sums, s.lengths, block_size=16, top_k=3, num_splits=2,
    ...     score_splits=1, chunk=16, interpret=True)
    >>> ref = sp.sparse_decode_attention(q, k, k, lens, s, block_size=16, top_k=3,
    ...                                  implementation="xla")
    >>> bool(jnp.allclose(out, ref, atol=1e-5)), cnt.tolist()
    (True, [[5, 5]])
  """
  bsz, n_len, hk, d = k.shape
  hq = q.shape[1]
  dv = v.shape[-1]
  if q.ndim != 3 or q.shape[0] != bsz or q.shape[-1] != d or hq % hk:
    raise ValueError(f"q {q.shape} does not match the cache {k.shape}")
  chunk = _sel._check_score_inputs(q, sums, chunk)[-1]
  if v.shape[:3] != k.shape[:3]:
    raise ValueError(f"k {k.shape} and v {v.shape} must agree in all but the last dim")
  nb = pl.cdiv(n_len, block_size)
  if sums.shape != (bsz, nb, hk, d):
    raise ValueError(f"sums must be [batch, num_blocks, kv_heads, head_dim] = "
                     f"{(bsz, nb, hk, d)}, got {sums.shape}")
  _dec._check_lengths(kv_lengths, bsz, lengths_group, "kv_lengths")
  _dec._check_lengths(summary_lengths, bsz, lengths_group, "summary_lengths")
  if max_selected is None:
    max_selected = max(1, min(num_init_blocks + num_local_blocks + top_k, nb))
  if num_splits is None:
    num_splits = _dec.default_num_splits(bsz, hk, max_selected)
  if num_splits < 1:
    raise ValueError(f"num_splits must be >= 1, got {num_splits}")
  n_chunks = pl.cdiv(nb, chunk)
  if score_splits is None:
    score_splits = _sel.default_score_splits(bsz, hk, nb, chunk=chunk)
  score_splits = int(min(max(1, score_splits), n_chunks))
  _, sel = _sel._selection_params(nb, block_size, top_k, num_init_blocks, num_local_blocks,
                                  max_selected, num_warps, 1, None, search_loop)
  group = hq // hk
  if scale is None:
    scale = 1.0 / math.sqrt(d)
  attn = dict(scale=float(scale), block=block_size, group=group, g_pad=_dec._pow2(group),
              head_dim=d, d_pad=_dec._pow2(d), head_dim_v=dv, dv_pad=_dec._pow2(dv),
              num_splits=int(num_splits), num_slots=int(max_selected), capacity=n_len,
              paged=False, blocks_per_step=int(blocks_per_step), prefetch_ids=prefetch_ids)
  kernel = functools.partial(
      _one_launch_kernel, bsz=bsz, hk=hk, score_splits=score_splits,
      chunks_per_split=pl.cdiv(n_chunks, score_splits), chunk=chunk, group=group,
      g_pad=_sel._pow2(group), head_dim=d, d_pad=_sel._pow2(d), len_group=int(lengths_group),
      sel=sel, attn=attn, spin=not interpret)
  out_dtype = q.dtype if out_dtype is None else out_dtype
  i32 = jnp.int32
  n_counters = 4 if num_splits > 1 else 3
  counters = [jnp.zeros((1,), i32)] + [jnp.zeros((bsz, hk), i32) for _ in range(n_counters - 1)]
  args = [summary_lengths.astype(i32), kv_lengths.astype(i32), q, sums.astype(jnp.float32),
          k, v] + counters
  out_shape = [jax.ShapeDtypeStruct((bsz, hk, nb), jnp.float32),
               jax.ShapeDtypeStruct((bsz, hk, max_selected), i32),
               jax.ShapeDtypeStruct((bsz, hk), i32),
               jax.ShapeDtypeStruct((bsz, hq, dv), jnp.dtype(out_dtype)),
               jax.ShapeDtypeStruct((bsz, hq), jnp.float32)]
  if num_splits > 1:
    out_shape += [jax.ShapeDtypeStruct((bsz, num_splits, hq, dv), jnp.float32),
                  jax.ShapeDtypeStruct((bsz, num_splits, hq), jnp.float32)]
  aliases = {6 + i: len(out_shape) + i for i in range(n_counters)}
  out_shape += [jax.ShapeDtypeStruct(c.shape, i32) for c in counters]
  grid = (bsz * hk * (score_splits + num_splits),)
  res = pl.pallas_call(
      kernel, out_shape=out_shape, grid=grid, input_output_aliases=aliases,
      compiler_params=compat.triton_compiler_params(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret, name="jattn_sparse_decode_one_launch")(*args)
  return res[3], res[4], res[1], res[2]
