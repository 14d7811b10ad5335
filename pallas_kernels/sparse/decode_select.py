"""Decode-time block scoring and top-k block selection as two Pallas kernels (Triton lowering).

The selection of ``jattn.sparse.select_decode_blocks`` without XLA's sort: the block scores of
one new query per sequence are a batched matrix-vector product, and ``lax.top_k`` over 2048
candidates per kv head becomes a full bitonic sort on the GPU (several launches); here it is
one threshold search inside a kernel.

* :func:`decode_block_scores`: one program per (batch, kv head, chunk of ``chunk`` blocks):
  score[b, h, j] = (sum of the GQA group's queries) . key_sum[b, j, h] / max(count_j, 1), fp32
  products and sums (no TF32). Spread over many programs so the fp32 key sums (8 MiB at 128K
  tokens, 8 kv heads, head_dim 128) are read at full bandwidth.
* :func:`select_decode_slots`: one program per (batch, kv head) holding all its block scores
  in registers: the forced blocks (initial and local) from the sequence length, then the k-th
  largest candidate score found by a 32-step bitwise search over the scores' total-order int32
  keys (ties broken by the lower block id, as ``lax.top_k``), then the kept blocks compacted in
  ascending order by a prefix sum into a ``[max_selected]`` list padded with -1, and the count.
  Exactly ``select_decode_blocks``'s output for the same scores (tested). Option
  ``digit_bits`` 2 or 4: a radix form of the same search (16 or 8 passes, each counting the
  keys >= all 2**digit_bits trial digits at once), the same threshold, so the same selection.
* :func:`score_select_decode_slots`: both in one launch (``jattn.sparse``'s
  ``fused_select=True``): grid (batch, kv head, score split), each program scores its share
  of the blocks with the score kernel's code into an HBM scratch; with one split the program
  then selects (after a CTA barrier), with several the last to arrive on a per-(batch, kv
  head) counter (atomic) selects and resets the counter, which then serves as the merged
  decode kernel's zeroed arrival counter. The same scores and selection, to the bit.

File layout: score kernel and wrapper, selection kernel and wrapper, fused kernel and wrapper.
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
from pallas_kernels.sparse.decode import _check_lengths, _len_index

__all__ = ["decode_block_scores", "select_decode_slots", "score_select_decode_slots",
           "default_score_splits", "total_order_key"]

_INT_MIN = -(2 ** 31)
_NEG_INF_KEY = -2139095041           # total_order_key(-inf): 0xff800000 ^ 0x7fffffff


def _pow2(n):
  return max(16, pl.next_power_of_2(int(n)))


# ----------------------------------------------------------------------------- scores
def _group_query_sum(q_ref, b, h, *, group, g_pad, head_dim, d_pad):
  """fp32 [d_pad] sum of kv head h's GQA group of queries (padded rows and columns 0), the
  column ids and mask, and the [g_pad, d_pad] mask of the group's real query entries."""
  q, (_, cols, _, col_ok, q_mask) = load_group_query(
      q_ref, b, h, group=group, g_pad=g_pad, head_dim=head_dim, d_pad=d_pad)  # [g_pad, d_pad]
  qsum = jnp.sum(q.astype(jnp.float32), axis=0)                      # [d_pad], padded rows 0
  return qsum, cols, col_ok, q_mask


def _chunk_scores(slen_ref, sums_ref, b, h, c, qsum, cols, col_ok, *, block, chunk,
                  num_blocks, len_group=1):
  """Scores of blocks c * chunk .. c * chunk + chunk - 1: (block ids [chunk], in range
  [chunk], fp32 scores [chunk]); one [chunk, d_pad] load of the key sums. The summary length
  of sequence b is slen[b // len_group]."""
  rows = c * chunk + jnp.arange(chunk, dtype=jnp.int32)              # [chunk] block ids
  row_ok = rows < num_blocks
  mask = row_ok[:, None] if col_ok is None else row_ok[:, None] & col_ok[None, :]
  s = plgpu.load(sums_ref.at[b, rows[:, None], h, cols[None, :]], mask=mask, other=0.0)
  dots = jnp.sum(s.astype(jnp.float32) * qsum[None, :], axis=1)      # [chunk] fp32
  length = plgpu.load(slen_ref.at[_len_index(b, len_group)])
  cnt = jnp.clip(length - rows * block, 0, block)
  return rows, row_ok, dots / jnp.maximum(cnt, 1).astype(jnp.float32)


def _score_kernel(slen_ref, q_ref, sums_ref, o_ref, *, block, chunk, group, g_pad, head_dim,
                  d_pad, num_blocks, len_group=1):
  """One (batch, kv head, chunk) program.

  Refs: slen [B / len_group] (positions summarised); q [B, Hq, D]; sums [B, N, Hk, D] fp32;
  output scores [B, Hk, N] fp32.
  """
  b = pl.program_id(0)
  h = pl.program_id(1)
  c = pl.program_id(2)
  qsum, cols, col_ok, _ = _group_query_sum(q_ref, b, h, group=group, g_pad=g_pad,
                                           head_dim=head_dim, d_pad=d_pad)
  rows, row_ok, scores = _chunk_scores(slen_ref, sums_ref, b, h, c, qsum, cols, col_ok,
                                       block=block, chunk=chunk, num_blocks=num_blocks,
                                       len_group=len_group)
  plgpu.store(o_ref.at[b, h, rows], scores, mask=row_ok)


def _check_score_inputs(q, sums, chunk):
  """Checks q [batch, q_heads, head_dim] against the block sums and the score tile ``chunk``.

  Returns (batch, kv_heads, num_blocks, head_dim, group, chunk), chunk clipped to
  ``_pow2(num_blocks)``.
  """
  bsz, hq, d = q.shape
  _, nb, hk, ds = sums.shape
  if ds != d or hq % hk or sums.shape[0] != bsz:
    raise ValueError(f"q {q.shape} does not match the block sums {sums.shape}")
  if chunk < 16 or chunk & (chunk - 1):
    raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")
  return bsz, hk, nb, d, hq // hk, min(chunk, _pow2(nb))


@functools.partial(jax.jit, static_argnames=("block_size", "chunk", "num_warps", "interpret",
                                             "lengths_group"))
def decode_block_scores(q, sums, summary_lengths, *, block_size, chunk=64, num_warps=4,
                        interpret=False, lengths_group=1):
  """Block scores of one decode query per sequence against the running key sums.

  Args:
    q: [batch, q_heads, head_dim].
    sums: fp32 [batch, num_blocks, kv_heads, head_dim] (``BlockSummaries.sums``).
    summary_lengths: int32 [batch] (``BlockSummaries.lengths``): block j averages
      clip(length - j * block_size, 0, block_size) keys.
    block_size: positions per block.
    chunk: blocks per program (a power of two).
    num_warps: launch parameter.
    interpret: run in the Pallas interpreter (CPU tests).
    lengths_group: consecutive sequences that share one length: summary_lengths is then
      [batch / lengths_group] and sequence b reads entry b // lengths_group (a head-major
      cache seen as batch x kv_heads sequences, without repeating the lengths in XLA).

  Returns:
    fp32 [batch, kv_heads, num_blocks]: sum over the group's query heads of q . mean key.

  Example:
    >>> q = jnp.ones((1, 4, 16)); sums = jnp.ones((1, 3, 2, 16))
    >>> decode_block_scores(q, sums, jnp.array([40]), block_size=16, interpret=True)[0, 0]
    Array([2., 2., 4.], dtype=float32)
  """
  bsz, hk, nb, d, group, chunk = _check_score_inputs(q, sums, chunk)
  _check_lengths(summary_lengths, bsz, lengths_group, "summary_lengths")
  kernel = functools.partial(_score_kernel, block=int(block_size), chunk=chunk, group=group,
                             g_pad=_pow2(group), head_dim=d, d_pad=_pow2(d), num_blocks=nb,
                             len_group=int(lengths_group))
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((bsz, hk, nb), jnp.float32),
      grid=(bsz, hk, pl.cdiv(nb, chunk)),
      compiler_params=compat.triton_compiler_params(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="jattn_sparse_decode_scores")(
          summary_lengths.astype(jnp.int32), q, sums.astype(jnp.float32))


# ----------------------------------------------------------------------------- selection
def _default_search_chunk(nb_pad, digit_bits, num_warps):
  """Blocks per radix compare tile: [2**digit_bits, chunk] at ~32 int32 per thread."""
  cols = (32 * 32 * int(num_warps)) >> digit_bits      # 32 elements x threads / digits
  return int(min(nb_pad, max(16, 1 << (max(cols, 1).bit_length() - 1))))   # a power of two


def total_order_key(x):
  """int32 keys of fp32 values in IEEE total order (-NaN < -inf < -0 < +0 < inf < NaN).

  The order ``lax.top_k`` ranks by; usable inside Triton kernels.

  Args:
    x: a floating array (converted to fp32).

  Returns:
    int32 array of x's shape; ``a < b`` in total order iff ``key(a) < key(b)``.

  Example:
    >>> total_order_key(jnp.array([-0.0, 0.0, 1.0])).tolist()
    [-1, 0, 1065353216]
  """
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _radix_threshold(s_ref, b, h, diag, *, num_blocks, nb_pad, num_init, num_local, top_k,
                     digit_bits, chunk, rolled=False):
  """The bit search's threshold (unsigned space), ``digit_bits`` bits per pass.

  Same answer as the 32-step search: t = the largest u with #{real lanes: u_key >= u} >= top_k,
  where u_key = key ^ INT_MIN. The count is non-increasing in u, so t's digit at each level is
  the largest digit d whose trial (prefix | d << shift, lower bits 0) still counts >= top_k:
  one pass counts, for all 2**digit_bits digits at once, the keys >= each trial ([digits,
  chunk] compares summed over the chunks of the block axis elementwise, then one reduction
  along the block axis), and the digit is the number of digits >= 1 that pass (they form a
  prefix 1..d of the digits). Digit 0 always passes (the prefix passed before, or is 0 and
  counts every real lane, >= top_k), so its row is forced true and padded lanes get u_key 0,
  which no trial >= 1 counts (as in the 32-step search, whose trials are all >= 1).
  The keys are loaded per chunk of ``chunk`` blocks (a static loop): the [digits, chunk] tile,
  not [digits, nb_pad], bounds the registers. ``rolled``: the passes as one ``fori_loop``.
  """
  return _radix_search(_radix_keys(s_ref, b, h, diag, num_blocks=num_blocks, nb_pad=nb_pad,
                                   num_init=num_init, num_local=num_local, chunk=chunk),
                       top_k=top_k, digit_bits=digit_bits, rolled=rolled)


def _radix_keys(s_ref, b, h, diag, *, num_blocks, nb_pad, num_init, num_local, chunk):
  """The search keys of (b, h), one [chunk] int32 vector per chunk of the block axis:
  ``total_order_key`` of the candidates' scores, -inf's key for non-candidates, INT_MIN (u_key 0)
  for padded lanes."""
  keys = []
  for c in range(nb_pad // chunk):
    jc = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
    real_c = jc < num_blocks
    forced_c = jc < num_init
    if num_local > 0:
      forced_c = forced_c | (jc > diag - num_local)
    cand_c = (jc <= diag) & ~forced_c
    s_c = plgpu.load(s_ref.at[b, h, jc], mask=real_c, other=0.0)
    key_c = jnp.where(cand_c, total_order_key(s_c), _NEG_INF_KEY)
    keys.append(jnp.where(real_c, key_c, _INT_MIN))                  # padded: u_key 0
  return keys


def _radix_search(keys, *, top_k, digit_bits, rolled):
  """t_u from the key chunks: 32 / digit_bits passes, Python-unrolled or (``rolled``) one
  ``fori_loop`` whose body is the same pass (same trials, counts and digits)."""
  dig = jnp.arange(1 << digit_bits, dtype=jnp.int32)                 # [nd] candidate digits

  def one_pass(t_u, shift, trial_shift):
    trial = (t_u | jax.lax.shift_left(dig, trial_shift)) ^ _INT_MIN    # [nd] signed
    acc = None
    for key_c in keys:
      ge = (key_c[None, :] >= trial[:, None]).astype(jnp.int32)      # [nd, chunk]
      acc = ge if acc is None else acc + ge
    n_ge = jnp.sum(acc, axis=1)                                      # [nd]
    ok = (n_ge >= top_k) | (dig == 0)
    digit = jnp.sum(ok.astype(jnp.int32)) - 1
    return t_u | jax.lax.shift_left(digit, shift)

  if rolled:
    def body(p, t_u):
      shift = 32 - digit_bits * (p + 1)
      return one_pass(t_u, shift, jnp.broadcast_to(shift, dig.shape))
    return jax.lax.fori_loop(0, 32 // digit_bits, body, jnp.int32(0))
  t_u = jnp.int32(0)
  for p in range(32 // digit_bits):
    shift = jnp.int32(32 - digit_bits * (p + 1))
    t_u = one_pass(t_u, shift, shift)
  return t_u


SEARCH_LOOPS = ("unrolled", "rolled", "early", "kary")
KARY_TRIALS = tuple(range(1, 9))      # most trials per pass of search_loop="kary"
_KARY_MAX_PASSES = 24


def _kary_search(key, real, lo, hi, *, top_k, trials, max_passes=_KARY_MAX_PASSES,
                 return_passes=False):
  """A threshold key that counts exactly ``top_k`` real keys, searched in score space.

  Each pass places up to ``trials`` evenly spaced fp32 trials inside [lo, hi] and counts the
  real keys >= each trial's key with ONE scalar reduction: the per-lane 0/1 flags of the
  trials are packed into one int32 (trial i in bits [w * i, w * (i + 1))), so the sum holds
  every count at once. A field holds at most the keys inside the current bracket [lo, hi)
  (the count at hi is known, so a trial counts only keys in [trial, hi)), which bounds its
  width w and so the trials that fit: 2 at 2048 blocks in the first pass (w = 12), more as the
  bracket shrinks (at most ``trials``). The pass stops on a count of exactly top_k; otherwise
  (lo, hi) shrinks to the trials whose counts bracket top_k. Simulated at 2046 candidates and
  top 387 with 4 trials: ~6 passes on normal scores, ~9 log-normal, ~11 Cauchy, against ~17.5
  steps of the early bit search (one reduction each). Slower on the H200 all the same: scores
  + selection 10.2 / 13.0 / 17.8 us at 2 / 4 / 8 trials against 9.8 for the early bit search
  (run 100; a 2D [trials, blocks] compare tile per pass instead: 11.0-18.3 us, run 99), so it
  is an option, not the default.

  The acceptance test alone makes the answer exact: keys >= a trial that counts exactly
  top_k are the top_k largest with every tie at the k-th among them (the early bit search's
  condition), however the trials were placed. Ties at the k-th key, non-finite scores, fewer
  candidates than top_k or an interval no trial can split find nothing (a pass without
  progress, or ``max_passes``); the caller then runs the bit search.

  Pure jnp (runs inside a Triton kernel or on arrays).

  Args:
    key: int32 [n] keys (``total_order_key`` of the candidates' scores, -inf's key for the
      other real lanes).
    real: bool [n], the lanes that count.
    lo, hi: fp32 scalars, the smallest and largest candidate score.
    top_k: the count to hit.
    trials: most trials per pass (1 to 8).
    max_passes: passes before giving up.
    return_passes: also return the passes run.

  Returns:
    (found bool scalar, thr int32 scalar: a key counting exactly top_k where found), then the
    passes run with ``return_passes``.
  """
  n_lanes = key.shape[0]
  kp = jnp.where(real, key, _INT_MIN)                # padding: below every trial's key
  ii = [jnp.int32(i) for i in range(trials)]

  def cond(c):
    p, _, _, _, _, _, thr, moved = c
    return (p < max_passes) & (thr == _INT_MIN) & moved

  def body(c):
    p, lo, hi, c_lo, c_hi, tk_hi, _, _ = c
    # field width: the bracket holds <= c_lo - c_hi keys (c_lo is an upper bound at first)
    m = jnp.maximum(c_lo - c_hi, 1)
    w = jnp.int32(32) - jax.lax.clz(m)                               # bits of m
    n_t = jnp.clip(jnp.int32(31) // w, 1, trials)                    # trials this pass
    step = (hi - lo) / (n_t.astype(jnp.float32) + 1.0)
    below_hi = kp < tk_hi                                            # tk_hi: INT_MIN+ none
    below_hi = below_hi | (tk_hi == _INT_MIN)
    packed = jnp.zeros_like(kp)
    ts, tks = [], []
    for i in ii:
      t = jnp.clip(lo + step * (i.astype(jnp.float32) + 1.0), lo, hi)
      tk = jnp.maximum(total_order_key(t), _INT_MIN + 1)
      ts.append(t)
      tks.append(tk)
      flag = ((kp >= tk) & below_hi & (i < n_t)).astype(jnp.int32)
      packed = packed + jax.lax.shift_left(flag, w * i)
    tot = jnp.sum(packed)
    mask = jax.lax.shift_left(jnp.int32(1), w) - 1
    thr = jnp.int32(_INT_MIN)
    new = (lo, hi, c_lo, c_hi, tk_hi)
    for i, t, tk in zip(ii, ts, tks):
      n_i = c_hi + (jax.lax.shift_right_logical(tot, w * i) & mask)  # #{key >= tk}
      use = i < n_t
      thr = jnp.where(use & (n_i == top_k), tk, thr)
      n_lo, n_hi, n_clo, n_chi, n_tkhi = new
      up = use & (n_i > top_k)                  # the k-th is at or above t: raise lo
      n_lo, n_clo = jnp.where(up, t, n_lo), jnp.where(up, n_i, n_clo)
      dn = use & (n_i < top_k) & ((tk < n_tkhi) | (n_tkhi == _INT_MIN))   # first such: hi
      n_hi, n_chi, n_tkhi = (jnp.where(dn, t, n_hi), jnp.where(dn, n_i, n_chi),
                             jnp.where(dn, tk, n_tkhi))
      new = (n_lo, n_hi, n_clo, n_chi, n_tkhi)
    moved = (new[0] != lo) | (new[1] != hi)
    return (p + 1,) + new + (thr, moved)

  init = (jnp.int32(0), lo.astype(jnp.float32), hi.astype(jnp.float32), jnp.int32(n_lanes),
          jnp.int32(0), jnp.int32(_INT_MIN), jnp.int32(_INT_MIN), True)
  res = jax.lax.while_loop(cond, body, init)
  passes, thr = res[0], res[6]
  out = (thr != _INT_MIN, thr)
  return out + (passes,) if return_passes else out


def _bit_search(key, real, *, top_k, loop="unrolled", return_steps=False, n_real=None):
  """t_u by the bit search (top bit first): the largest u with #{real: key_u >= u} >= top_k,
  or (``loop="early"``) any u whose count is exactly top_k.

  ``loop``: "unrolled" (32 straight-line steps), "rolled" (the same steps as one
  ``fori_loop``) or "early": a ``while_loop`` that stops at the first accepted trial whose
  count is exactly ``top_k``. Keys >= that trial are then exactly top_k keys, so they are the
  top_k largest with every tie at the k-th key among them, and the caller's threshold step
  (keys > t, then ties at t by block id up to top_k) keeps the same set as with the full
  search's t. Continuous scores stop after ~17 of the 32 steps (2046 normal scores, top 387:
  mean 17.5, at most 26 in 300 draws); ties at the k-th key run all 32.

  Pure jnp (runs inside a Triton kernel or on arrays, which the tests use).
  ``return_steps``: also return the steps run (an int32 scalar).
  ``n_real``: the number of real keys (a Python int); then also return c_t = #{real: key_u >=
  t_u} (an int32 scalar, the count of the accepted trial; n_real while none was), after t_u
  and before the steps.
  """
  if loop not in SEARCH_LOOPS:
    raise ValueError(f"search_loop must be one of {SEARCH_LOOPS}, got {loop!r}")

  def count(trial):
    return jnp.sum(((key >= (trial ^ _INT_MIN)) & real).astype(jnp.int32))

  def accept(trial, t_u, c_t):
    n_ge = count(trial)
    ok = n_ge >= top_k
    return jnp.where(ok, trial, t_u), jnp.where(ok, n_ge, c_t), n_ge

  c0 = jnp.int32(0 if n_real is None else n_real)
  if loop == "early":
    def cond(c):
      i, _, _, done = c
      return (i < 32) & jnp.logical_not(done)

    def body(c):                       # bit 31 - i; 1 << 31 wraps to INT_MIN in int32
      i, t_u, c_t, _ = c
      t_u, c_t, n_ge = accept(t_u | jax.lax.shift_left(jnp.int32(1), 31 - i), t_u, c_t)
      return i + 1, t_u, c_t, n_ge == top_k
    steps, t_u, c_t, _ = jax.lax.while_loop(cond, body,
                                            (jnp.int32(0), jnp.int32(0), c0, False))
  elif loop == "rolled":
    def bit_step(i, c):
      return accept(c[0] | jax.lax.shift_left(jnp.int32(1), 31 - i), *c)[:2]
    t_u, c_t = jax.lax.fori_loop(0, 32, bit_step, (jnp.int32(0), c0))
    steps = jnp.int32(32)
  else:
    t_u, c_t = jnp.int32(0), c0
    for bit in range(31, -1, -1):
      t_u, c_t, _ = accept(t_u | jnp.int32(_INT_MIN if bit == 31 else 1 << bit), t_u, c_t)
    steps = jnp.int32(32)
  res = (t_u,) + ((c_t,) if n_real is not None else ()) + ((steps,) if return_steps else ())
  return res[0] if len(res) == 1 else res


def _keep_flags(len_ref, s_ref, b, h, *, block, num_blocks, nb_pad, num_init, num_local, top_k,
                digit_bits, search_chunk, search_loop="unrolled", len_group=1,
                search_trials=4):
  """The kept set of (batch b, kv head h) from its scores: (block ids [nb_pad], keep [nb_pad]
  bool). Shared by the selection kernels (``_select_body``, which then compacts it) and the
  fused selection + attention kernel (``decode_fused_select``). ``search_loop``: "unrolled"
  (default), "rolled" (the threshold search's steps as one ``fori_loop``: the same integer ops
  per step, so the same threshold) or "early" (bit search only: stop at the first trial that
  counts exactly top_k keys, ``_bit_search``; the same kept set) or "kary" (``_kary_search``
  with at most ``search_trials`` trials per pass, then, only if it found nothing, the early
  bit search; the same kept set)."""
  j = jnp.arange(nb_pad, dtype=jnp.int32)                            # [nb_pad] block ids
  real = j < num_blocks
  length = jnp.minimum(plgpu.load(len_ref.at[_len_index(b, len_group)]), num_blocks * block)
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
    # lax.top_k(where(cand, s, -inf), top_k) over the real blocks, then keep the candidates:
    # the top_k largest keys, ties to the lower block id.
    key = jnp.where(cand, total_order_key(s), _NEG_INF_KEY)
    # Largest t with #{key >= t} >= top_k, built from the top bit down in the unsigned space
    # u = t ^ INT_MIN (order preserving), so the answer is the top_k-th largest key.
    def searched(loop):                        # the candidates kept by the threshold search
      c_t = None
      if digit_bits == 1:
        t_u, c_t = _bit_search(key, real, top_k=top_k, loop=loop, n_real=num_blocks)
      else:                                    # radix: 32 / digit_bits dependent reductions
        t_u = _radix_threshold(s_ref, b, h, diag, num_blocks=num_blocks, nb_pad=nb_pad,
                               num_init=num_init, num_local=num_local, top_k=top_k,
                               digit_bits=digit_bits, chunk=search_chunk,
                               rolled=loop == "rolled")
      thr = t_u ^ _INT_MIN

      def by_rank():                           # keys > thr, then ties at thr by block id
        above = (key > thr) & real
        need = top_k - jnp.sum(above.astype(jnp.int32))             # ties at thr to take
        tie = (key == thr) & real
        tie_i = tie.astype(jnp.int32)
        tie_rank = jnp.cumsum(tie_i) - tie_i                           # ties before j
        return cand & (above | (tie & (tie_rank < need)))
      if c_t is None:
        return by_rank()
      # exactly top_k keys >= thr (the usual case): all of them, no rank of the ties
      return jax.lax.cond(c_t == top_k, lambda: cand & (key >= thr) & real, by_rank)

    if search_loop == "kary":                  # exact hits in score space, else the bit search
      found, thr_k = _kary_search(
          key, real, jnp.min(jnp.where(cand, s, jnp.inf)),
          jnp.max(jnp.where(cand, s, -jnp.inf)), top_k=top_k, trials=search_trials)
      keep = keep | jax.lax.cond(found, lambda: cand & (key >= thr_k) & real,
                                 lambda: searched("early"))
    else:
      keep = keep | searched(search_loop)
  return j, keep


def _select_body(len_ref, s_ref, idx_ref, cnt_ref, b, h, *, block, num_blocks, nb_pad,
                 num_init, num_local, top_k, width, digit_bits, search_chunk, len_group=1,
                 search_loop="unrolled", search_trials=4):
  """The selection of (batch b, kv head h) from its scores in ``s_ref`` (shared by the
  selection kernel and the fused score + selection kernel): writes idx[b, h] and cnt[b, h].
  Returns the number of list slots written (>= 1; a reduction over every lane, so a value
  computed from it follows all of this program's stores; unused results cost nothing)."""
  j, keep = _keep_flags(len_ref, s_ref, b, h, block=block, num_blocks=num_blocks,
                        nb_pad=nb_pad, num_init=num_init, num_local=num_local, top_k=top_k,
                        digit_bits=digit_bits, search_chunk=search_chunk, len_group=len_group,
                        search_loop=search_loop, search_trials=search_trials)
  keep_i = keep.astype(jnp.int32)
  incl = jnp.cumsum(keep_i)                                          # [nb_pad]
  count = jnp.sum(keep_i)
  # Stable partition: kept blocks in ascending order at 0..count-1, every other lane at a
  # distinct slot >= count (holding -1), so each of the first ``width`` slots is written once.
  slot = jnp.where(keep, incl - 1, count + j - incl)
  plgpu.store(idx_ref.at[b, h, slot], jnp.where(keep, j, -1), mask=slot < width)
  plgpu.store(cnt_ref.at[b, h], count)
  return jnp.sum((slot < width).astype(jnp.int32))


def _select_kernel(len_ref, s_ref, idx_ref, cnt_ref, *arr, block, num_blocks, nb_pad, num_init,
                   num_local, top_k, width, digit_bits=1, search_chunk=None, len_group=1,
                   search_loop="unrolled", search_trials=4):
  """One (batch, kv head) program.

  Refs: len [B] (query position + 1); scores [B, Hk, N] fp32; outputs idx [B, Hk, width]
  int32, cnt [B, Hk] int32 and optionally arrival counters [B, Hk] int32 (set to 0).
  """
  b = pl.program_id(0)
  h = pl.program_id(1)
  _select_body(len_ref, s_ref, idx_ref, cnt_ref, b, h, block=block, num_blocks=num_blocks,
               nb_pad=nb_pad, num_init=num_init, num_local=num_local, top_k=top_k,
               width=width, digit_bits=digit_bits, search_chunk=search_chunk,
               len_group=len_group, search_loop=search_loop, search_trials=search_trials)
  if arr:                                      # zeroed counters for the merged decode kernel
    plgpu.store(arr[0].at[b, h], jnp.int32(0))


def _selection_params(nb, block_size, top_k, num_init_blocks, num_local_blocks, max_selected,
                      num_warps, digit_bits, search_chunk, search_loop=None, search_trials=None):
  """Checks the selection options; (num_warps, static keywords of ``_select_body``).

  ``search_loop=None``: "early" for the bit search (digit_bits 1), "unrolled" for the radix
  forms. The early exit took the selection alone from 6.81 to 5.47 us and the fused scores +
  selection in the head-major call from 11.73 to 10.40 us (run 90, H200, 2048 blocks, top
  387, 8 warps, device kernel time; the same kept set, tested)."""
  nb_pad = _pow2(nb)
  if search_loop is None:
    search_loop = "early" if digit_bits == 1 else "unrolled"
  if num_warps is None:   # 8 from 2048 blocks: the bit search's 32 steps took 6.8 us against
    # 7.2 with 4 warps (16: 7.5) at 2048 blocks on the H200 (runs 86-87, device kernel time)
    num_warps = int(min(16, max(8 if nb_pad >= 2048 else 4, nb_pad // 512)))
  if digit_bits not in (1, 2, 4):
    raise ValueError(f"digit_bits must be 1, 2 or 4, got {digit_bits}")
  if search_loop not in SEARCH_LOOPS:
    raise ValueError(f"search_loop must be one of {SEARCH_LOOPS}, got {search_loop!r}")
  if search_loop in ("early", "kary") and digit_bits != 1:
    raise ValueError(f"search_loop={search_loop!r} is for the bit search (digit_bits=1), got "
                     f"digit_bits={digit_bits}")
  if search_trials is not None and search_loop != "kary":
    raise ValueError(f"search_trials is for search_loop='kary', got search_loop="
                     f"{search_loop!r}")
  if search_loop == "kary":
    search_trials = 4 if search_trials is None else search_trials
    if search_trials not in KARY_TRIALS:
      raise ValueError(f"search_trials must be an int from 1 to {KARY_TRIALS[-1]}, got "
                       f"{search_trials}")
  if search_chunk is None:
    search_chunk = _default_search_chunk(nb_pad, digit_bits, num_warps)
  elif search_chunk < 16 or search_chunk & (search_chunk - 1):
    raise ValueError(f"search_chunk must be a power of two >= 16, got {search_chunk}")
  sel = dict(block=int(block_size), num_blocks=nb, nb_pad=nb_pad,
             num_init=int(num_init_blocks), num_local=int(num_local_blocks),
             top_k=int(min(top_k, nb)), width=int(max_selected), digit_bits=int(digit_bits),
             search_chunk=int(min(search_chunk, nb_pad)))
  if search_loop != "unrolled":          # default: _keep_flags' default search
    sel["search_loop"] = search_loop
  if search_loop == "kary":
    sel["search_trials"] = int(search_trials)
  return int(num_warps), sel


@functools.partial(jax.jit, static_argnames=("block_size", "top_k", "num_init_blocks",
                                             "num_local_blocks", "max_selected", "num_warps",
                                             "interpret", "return_arrivals", "digit_bits",
                                             "search_chunk", "lengths_group", "search_loop",
                                             "search_trials"))
def select_decode_slots(scores, kv_lengths, *, block_size, top_k, num_init_blocks,
                        num_local_blocks, max_selected, num_warps=None, interpret=False,
                        return_arrivals=False, digit_bits=1, search_chunk=None,
                        lengths_group=1, search_loop=None, search_trials=None):
  """Kept blocks of one decode query per sequence: initial, local and the top_k by score.

  Args:
    scores: fp32 [batch, kv_heads, num_blocks] (``decode_block_scores``).
    kv_lengths: int32 [batch], including the new token (query at kv_lengths - 1); clamped to
      num_blocks * block_size.
    block_size: positions per block.
    top_k, num_init_blocks, num_local_blocks: as ``jattn.sparse.select_decode_blocks``.
    max_selected: output width; at least the most blocks a row can keep
      (min(init + local + top_k, num_blocks)).
    num_warps: launch parameter; default grows with the block count (8 from 2048 blocks).
    interpret: run in the Pallas interpreter (CPU tests).
    return_arrivals: also return int32 [batch, kv_heads] zeros written by this kernel: the
      arrival counters of ``pallas_kernels.sparse.decode.sparse_decode`` (no memset launch).
    digit_bits: bits of the threshold fixed per pass of its search: 1 (the 32-step bit
      search, one scalar reduction per step), 2 or 4 (radix: 32 / digit_bits passes, each
      counting the keys >= all 2**digit_bits trial digits at once, one [2**digit_bits]
      reduction along the block axis). The same selection for every value (tested).
    search_chunk: radix only: blocks per compare tile ([2**digit_bits, search_chunk], summed
      elementwise over the chunks before the one reduction), a power of two >= 16; default
      keeps the tile at ~32 int32 per thread (``_default_search_chunk``).
    lengths_group: consecutive sequences that share one length (kv_lengths [batch /
      lengths_group], sequence b reads entry b // lengths_group), as
      :func:`decode_block_scores`.
    search_loop: the bit search's steps: "unrolled" (32 straight-line steps), "rolled" (one
      loop) or "early" (a loop that stops at the first trial counting exactly top_k keys:
      ~17 steps on continuous scores, 32 with ties at the k-th) or "kary" (up to
      ``search_trials`` evenly spaced score trials per pass, their counts packed into one
      reduction, accepting the first trial that counts exactly top_k keys: ~6 passes on
      normal scores; the early bit search only when none does, e.g. ties at the k-th; slower
      than "early" on the H200, runs 99-100). The same selection for every value (tested). "early"
      and "kary" need digit_bits=1. Default None: "early" for digit_bits=1 (faster on the
      H200: 5.5 against 6.8 us at 2048 blocks, run 90), else "unrolled".
    search_trials: "kary" only: most trials per pass, 1 to 8 (default 4).

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
  _check_lengths(kv_lengths, bsz, lengths_group, "kv_lengths")
  num_warps, sel = _selection_params(nb, block_size, top_k, num_init_blocks, num_local_blocks,
                                     max_selected, num_warps, digit_bits, search_chunk,
                                     search_loop, search_trials)
  if lengths_group != 1:
    sel["len_group"] = int(lengths_group)
  kernel = functools.partial(_select_kernel, **sel)
  out_shape = [jax.ShapeDtypeStruct((bsz, hk, max_selected), jnp.int32),
               jax.ShapeDtypeStruct((bsz, hk), jnp.int32)]
  if return_arrivals:
    out_shape.append(jax.ShapeDtypeStruct((bsz, hk), jnp.int32))
  return pl.pallas_call(
      kernel, out_shape=out_shape,
      grid=(bsz, hk),
      compiler_params=compat.triton_compiler_params(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="jattn_sparse_decode_select")(
          kv_lengths.astype(jnp.int32), scores.astype(jnp.float32))


# ----------------------------------------------------------------------------- fused
def _score_share(slen_ref, q_ref, sums_ref, s_ref, b, h, split, *, chunks_per_split, chunk,
                 group, g_pad, head_dim, d_pad, block, num_blocks, len_group):
  """Scores of score program ``split``'s share of (b, h)'s blocks into s_ref: chunks_per_split
  tiles of ``chunk`` blocks, each the score kernel's program (the same loads and arithmetic,
  so the same fp32 scores). Returns ``arrived`` (= 1), the value to count the arrival with.

  Memory order (as in pallas_kernels.sparse.decode.sparse_decode's merge): a selection reads
  scores stored by other threads of this program (and, with splits, by other programs).
  ``arrived`` is a reduction over the whole [g_pad, d_pad] query tile, which spans all warps,
  so it passes through shared memory and a CTA barrier placed after the score stores; an
  atomic (acq_rel, GPU scope) increment by it depends on it, and the last program's selection
  loads follow the atomic's broadcast result."""
  qsum, cols, col_ok, q_mask = _group_query_sum(q_ref, b, h, group=group, g_pad=g_pad,
                                                head_dim=head_dim, d_pad=d_pad)
  for i in range(chunks_per_split):
    rows, row_ok, scores = _chunk_scores(slen_ref, sums_ref, b, h,
                                         split * chunks_per_split + i, qsum, cols, col_ok,
                                         block=block, chunk=chunk, num_blocks=num_blocks,
                                         len_group=len_group)
    plgpu.store(s_ref.at[b, h, rows], scores, mask=row_ok)
  return jnp.minimum(jnp.sum(q_mask.astype(jnp.int32)), 1)


def _score_select_kernel(slen_ref, len_ref, q_ref, sums_ref, *rest, chunk, group, g_pad,
                         head_dim, d_pad, score_splits, chunks_per_split, split_stride,
                         **sel):
  """One (batch, kv head, score split) program: scores, then (last to arrive) the selection.

  Refs: slen [B] (positions summarised); len [B] (query position + 1); q [B, Hq, D]; sums
  [B, N, Hk, D] fp32; with score_splits > 1 the arrival counters [B, Hk] int32 (zeros, input
  aliased to the last output). Outputs: scores [B, Hk, N] fp32, idx [B, Hk, width] int32,
  cnt [B, Hk] int32, then the counters (with score_splits > 1, or when requested: set to 0).
  """
  if score_splits > 1:
    _, s_ref, idx_ref, cnt_ref, arr_ref = rest
  else:
    s_ref, idx_ref, cnt_ref, *arr = rest
    arr_ref = arr[0] if arr else None
  b = pl.program_id(0)
  h = pl.program_id(1)
  split = pl.program_id(2)
  if split_stride != 1:                  # tests: make a split other than S-1 arrive last
    split = (split * split_stride) % score_splits
  arrived = _score_share(slen_ref, q_ref, sums_ref, s_ref, b, h, split,
                         chunks_per_split=chunks_per_split, chunk=chunk, group=group,
                         g_pad=g_pad, head_dim=head_dim, d_pad=d_pad, block=sel["block"],
                         num_blocks=sel["num_blocks"], len_group=sel.get("len_group", 1))
  if score_splits > 1:
    last = plgpu.atomic_add(arr_ref, (b, h), arrived) == score_splits - 1
  else:
    last = arrived == 1                  # always: orders the loads below after the barrier

  @pl.when(last)
  def _select():
    _select_body(len_ref, s_ref, idx_ref, cnt_ref, b, h, **sel)
    if arr_ref is not None:              # zeroed counters for the merged decode kernel
      plgpu.store(arr_ref.at[b, h], jnp.int32(0))


def default_score_splits(batch, kv_heads, num_blocks, *, chunk=64, core_count=None,
                         programs_per_core=2):
  """Score programs per (batch, kv head) of :func:`score_select_decode_slots`.

  About ``programs_per_core`` programs per multiprocessor over the batch x kv_heads pairs, at
  most one per ``chunk`` blocks: B1 with 8 kv heads and 2048 blocks on a 132-SM H200 gives 32
  (256 programs of one [64, head_dim] key-sum tile each, the score kernel's decomposition);
  1 (no counter, no memset) once batch x kv_heads fills the GPU, and without a GPU.

  Args:
    batch, kv_heads: (batch, kv head) pairs.
    num_blocks: cache blocks.
    chunk: blocks per score tile.
    core_count: multiprocessors; default ``compat.gpu_core_count()`` (1 without a GPU).
    programs_per_core: target programs per multiprocessor.

  Returns:
    An int >= 1.

  Example:
    >>> default_score_splits(1, 8, 2048, core_count=132)
    32
    >>> default_score_splits(64, 8, 2048, core_count=132)
    1
  """
  cores = compat.gpu_core_count() if core_count is None else int(core_count)
  want = -(-int(programs_per_core) * cores // max(1, batch * kv_heads))
  n_chunks = -(-int(num_blocks) // min(int(chunk), _pow2(num_blocks)))
  return int(max(1, min(want, n_chunks)))


@functools.partial(jax.jit, static_argnames=("block_size", "top_k", "num_init_blocks",
                                             "num_local_blocks", "max_selected", "score_splits",
                                             "chunk", "num_warps", "digit_bits",
                                             "search_chunk", "return_arrivals",
                                             "return_scores", "interpret", "_split_stride",
                                             "lengths_group", "search_loop", "search_trials"))
def score_select_decode_slots(q, sums, summary_lengths, kv_lengths, *, block_size, top_k,
                              num_init_blocks, num_local_blocks, max_selected,
                              score_splits=None, chunk=64, num_warps=None, digit_bits=1,
                              search_chunk=None, return_arrivals=False, return_scores=False,
                              interpret=False, _split_stride=1, lengths_group=1,
                              search_loop=None, search_trials=None):
  """:func:`decode_block_scores` and :func:`select_decode_slots` in one launch.

  Grid (batch, kv head, score split). Each program computes the scores of its share of the
  blocks (``chunk``-block tiles, the score kernel's loads and arithmetic) into an fp32 HBM
  scratch; the selection of a (batch, kv head) then runs in one program over all its scores
  (the selection kernel's code: threshold search, ties, forced blocks, compaction). With
  ``score_splits == 1`` that is the same program, after a CTA barrier; with more, each split
  counts its arrival on a per-(batch, kv head) counter (``atomic_add``, acq_rel, GPU scope) and
  the split that arrives last selects, then resets the counter to 0, so the counters leave the
  kernel as the zeroed arrival counters of ``pallas_kernels.sparse.decode.sparse_decode``. The
  counters start as zeros made by XLA (a memset before the launch); ``score_splits == 1`` needs
  none. Same scores and the same selection as the two kernels, to the bit (tested), for any
  split count and arrival order.

  Args:
    q: [batch, q_heads, head_dim].
    sums: fp32 [batch, num_blocks, kv_heads, head_dim] (``BlockSummaries.sums``).
    summary_lengths: int32 [batch] (``BlockSummaries.lengths``).
    kv_lengths: int32 [batch], including the new token (query at kv_lengths - 1).
    block_size: positions per block.
    top_k, num_init_blocks, num_local_blocks, max_selected: as :func:`select_decode_slots`.
    score_splits: score programs per (batch, kv head); default :func:`default_score_splits`
      (32 at B1, 8 kv heads, 2048 blocks on an H200; 1 without a GPU). Rounded so that every
      split has at least one ``chunk``-block tile.
    chunk: blocks per score tile, a power of two >= 16 (as :func:`decode_block_scores`).
    num_warps: launch parameter; default :func:`select_decode_slots`'s (the selection's).
    digit_bits, search_chunk, search_loop, search_trials: the threshold search, as
      :func:`select_decode_slots`.
    return_arrivals: also return the zeroed int32 [batch, kv_heads] arrival counters.
    return_scores: also return the fp32 [batch, kv_heads, num_blocks] scores.
    interpret: run in the Pallas interpreter (CPU tests).
    lengths_group: both lengths arrays are [batch / lengths_group], shared by that many
      consecutive sequences (as :func:`decode_block_scores`).
    _split_stride: tests only: program s scores split (s * stride) % score_splits (coprime
      with the split count), so in the interpreter, which runs programs in order, another
      split than the last arrives last.

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
  bsz, hk, nb, d, group, chunk = _check_score_inputs(q, sums, chunk)
  _check_lengths(summary_lengths, bsz, lengths_group, "summary_lengths")
  _check_lengths(kv_lengths, bsz, lengths_group, "kv_lengths")
  n_chunks = pl.cdiv(nb, chunk)
  if score_splits is None:
    score_splits = default_score_splits(bsz, hk, nb, chunk=chunk)
  if int(score_splits) < 1:
    raise ValueError(f"score_splits must be >= 1, got {score_splits}")
  per_split = pl.cdiv(n_chunks, min(int(score_splits), n_chunks))
  splits = pl.cdiv(n_chunks, per_split)
  if math.gcd(int(_split_stride), splits) != 1:
    raise ValueError(f"_split_stride {_split_stride} must be coprime with the {splits} splits")
  num_warps, sel = _selection_params(nb, block_size, top_k, num_init_blocks, num_local_blocks,
                                     max_selected, num_warps, digit_bits, search_chunk,
                                     search_loop, search_trials)
  if lengths_group != 1:
    sel["len_group"] = int(lengths_group)
  kernel = functools.partial(_score_select_kernel, chunk=chunk, group=group,
                             g_pad=_pow2(group), head_dim=d, d_pad=_pow2(d),
                             score_splits=splits, chunks_per_split=per_split,
                             split_stride=int(_split_stride), **sel)
  args = [summary_lengths.astype(jnp.int32), kv_lengths.astype(jnp.int32), q,
          sums.astype(jnp.float32)]
  out_shape = [jax.ShapeDtypeStruct((bsz, hk, nb), jnp.float32),
               jax.ShapeDtypeStruct((bsz, hk, max_selected), jnp.int32),
               jax.ShapeDtypeStruct((bsz, hk), jnp.int32)]
  aliases = {}
  if splits > 1 or return_arrivals:
    out_shape.append(jax.ShapeDtypeStruct((bsz, hk), jnp.int32))
  if splits > 1:
    aliases = {len(args): 3}
    args.append(jnp.zeros((bsz, hk), jnp.int32))
  res = pl.pallas_call(
      kernel, out_shape=out_shape, grid=(bsz, hk, splits), input_output_aliases=aliases,
      compiler_params=compat.triton_compiler_params(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="jattn_sparse_decode_score_select")(*args)
  out = (res[1], res[2])
  if return_arrivals:
    out += (res[3],)
  if return_scores:
    out += (res[0],)
  return out
