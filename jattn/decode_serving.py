"""Serving-grade decode: length-balanced work schedules and the unified-max softmax.

Both are described in docs/decode.md ("Continuous batching"). The unified-max merge is a plain
sum (out = sum acc / sum l, lse = m_hat + log sum l); partials or rows more than
``UNIFIED_MARGIN`` off the estimate are recomputed exactly."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jattn._validate import check_int, check_range
from pallas_kernels import compat
from pallas_kernels.common import merge as _merge, softmax as _softmax
from pallas_kernels.masks import normalize_window

__all__ = ["DecodeSchedule", "decode_schedule", "balance_units", "default_max_units",
           "newest_key_logits", "SOFTMAX_MODES", "UNIFIED_MARGIN"]

SOFTMAX_MODES = ("exact", "unified_max")
UNIFIED_MARGIN = 40.0     # |logit - m_hat| <= 40: exp stays in fp32's normal range
XLA_BLOCK = 64            # schedule granularity of the "xla" path


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeSchedule:
  """A length-balanced partition of a batch's visible keys into units (docs/decode.md).

  Attributes:
    unit_row, unit_first, unit_count: int32 [max_units]: each unit's sequence (batch if
      unused), first key block and number of blocks (0 if unused).
    row_units: int32 [batch + 1]: sequence b owns units row_units[b] .. row_units[b + 1] - 1.
    block: keys per block (static): the kernel's step.

  Example:
    >>> s = balance_units(jnp.array([1000, 64, 0]), capacity=1024, block=64, max_units=8)
    >>> s.unit_row.tolist(), s.unit_count.tolist()
    ([0, 0, 0, 0, 0, 0, 1, 3], [3, 3, 3, 3, 3, 1, 1, 0])
  """
  unit_row: jax.Array
  unit_first: jax.Array
  unit_count: jax.Array
  row_units: jax.Array
  block: int = dataclasses.field(metadata=dict(static=True))

  @property
  def max_units(self) -> int:
    return self.unit_row.shape[0]

  @property
  def units(self):
    """(unit_row, unit_first, unit_count): the kernels' ``units`` argument."""
    return self.unit_row, self.unit_first, self.unit_count


def balance_units(kv_lengths, *, capacity, block, max_units, window_left=None):
  """Split each sequence's visible key blocks into units of at most ``per`` blocks: the smaller
  of ceil(total / max_units) and ceil(total / (max_units - batch)) that keeps the unit count
  within ``max_units`` and each sequence's within ``MAX_ROW_PARTIALS`` (jnp; traceable).

  Args:
    kv_lengths: int [batch] (clamped to [0, capacity]); the query sits at length - 1.
    capacity, block: cache capacity in keys, and keys per block.
    max_units: the static number of units, >= batch.
    window_left: None or the left window size (keys >= length - 1 - window_left are seen).

  Returns:
    A :class:`DecodeSchedule`.

  Example:
    >>> balance_units(jnp.array([300, 20]), capacity=512, block=16, max_units=4).row_units.tolist()
    [0, 2, 3]
  """
  lens = jnp.clip(jnp.asarray(kv_lengths, jnp.int32), 0, capacity)
  b = lens.shape[0]
  lo = jnp.zeros_like(lens) if window_left is None else jnp.maximum(lens - 1 - window_left, 0)
  first = lo // block
  nblk = jnp.maximum((lens + block - 1) // block - first, 0)            # [b] visible blocks
  total = jnp.sum(nblk)
  per_even = jnp.maximum((total + max_units - 1) // max_units, 1)
  per_safe = jnp.maximum((total + max(max_units - b, 1) - 1) // max(max_units - b, 1), 1)
  fits = jnp.sum((nblk + per_even - 1) // per_even) <= max_units
  per = jnp.where(fits, per_even, per_safe)      # per_safe: sum ceil(n / per) <= max_units
  most = _merge.MAX_ROW_PARTIALS
  per = jnp.maximum(per, (jnp.max(nblk, initial=0) + most - 1) // most)
  row_units = jnp.concatenate([jnp.zeros(1, jnp.int32),
                               jnp.cumsum((nblk + per - 1) // per).astype(jnp.int32)])
  u = jnp.arange(max_units, dtype=jnp.int32)
  row = jnp.sum(row_units[None, 1:] <= u[:, None], axis=1, dtype=jnp.int32)  # b when unused
  rc = jnp.minimum(row, b - 1)
  j = u - row_units[rc]
  count = jnp.where(row < b, jnp.clip(nblk[rc] - j * per, 0, per), 0)
  return DecodeSchedule(unit_row=row, unit_first=(first[rc] + j * per).astype(jnp.int32),
                        unit_count=count.astype(jnp.int32), row_units=row_units, block=int(block))


def default_max_units(implementation, batch, kv_heads, *, core_count=None):
  """Units of a schedule when ``max_units=None``: for "triton" batch + ceil(4 x multiprocessors
  / kv_heads) (one short unit per sequence, then ~4 programs per multiprocessor), else 2 x batch.

  Args:
    implementation, batch, kv_heads: the plan's; batch counts sequences (x kv_heads for "hnd").
    core_count: multiprocessors (default: the GPU's).

  Returns:
    An int >= batch.

  Example:
    >>> default_max_units("triton", 8, 8, core_count=132)
    74
  """
  if implementation != "triton":
    return 2 * batch
  cores = compat.gpu_core_count() if core_count is None else int(core_count)
  return batch + -(-4 * cores // kv_heads)


def decode_schedule(q, k_cache, v_cache, kv_lengths, *, page_table=None, kv_layout="nhd",
                    local_window_size=None, implementation=None, block_sizes=None, max_units=None):
  """A length-balanced schedule for :func:`jattn.decode_attention` (or, with ``page_table``,
  :func:`jattn.paged_decode_attention`) called with the same arguments and ``schedule=``; once
  per batch composition (lengths may be traced). "mosaic_tpu" takes none.

  Args:
    q, k_cache, v_cache, kv_lengths, page_table, kv_layout, local_window_size, implementation,
      block_sizes: as in the decode call.
    max_units: static number of units (>= the number of sequences), default
      :func:`default_max_units`.

  Returns:
    A :class:`DecodeSchedule` in blocks of the kernel's ``block_k`` keys.

  Example:
    >>> import jattn
    >>> q = jnp.ones((2, 8, 64)); k = jnp.ones((2, 256, 2, 64)); lens = jnp.array([250, 9])
    >>> s = decode_schedule(q, k, k, lens, implementation="xla", max_units=4)
    >>> out = jattn.decode_attention(q, k, k, lens, implementation="xla", schedule=s)
    >>> s.row_units.tolist(), out.shape
    ([0, 2, 3], (2, 8, 64))
  """
  from jattn import decode as dec
  plan = dec.decode_plan(q, k_cache, v_cache, kv_lengths, page_table=page_table,
                         kv_layout=kv_layout, local_window_size=local_window_size,
                         implementation=implementation, block_sizes=block_sizes)
  lens, kv_heads = jnp.asarray(kv_lengths, jnp.int32), k_cache.shape[2]
  capacity = k_cache.shape[1] * (1 if page_table is None else page_table.shape[1])
  if kv_layout == "hnd":   # kv_heads one-head sequences per batch row
    kv_heads, capacity, lens = 1, k_cache.shape[2], jnp.repeat(lens, k_cache.shape[1])
  if max_units is None:
    max_units = default_max_units(plan.implementation, lens.shape[0], kv_heads)
  check_int("max_units", max_units, lo=lens.shape[0])   # at least one unit per sequence
  if plan.implementation == "mosaic_tpu":
    raise NotImplementedError("schedules run on 'xla' and 'triton', not 'mosaic_tpu'")
  window = normalize_window(local_window_size)
  block = XLA_BLOCK if plan.implementation == "xla" else plan.config.block_sizes.block_k
  return balance_units(lens, capacity=capacity, block=block, max_units=int(max_units),
                       window_left=None if window is None else window[0])


def check_serving_args(q, softmax, max_estimate, schedule, num_splits, sequences, block):
  """ValueError/TypeError for a bad ``softmax``, ``max_estimate`` or ``schedule`` (``sequences``
  and ``block``: those the call's schedule must have)."""
  if softmax not in SOFTMAX_MODES:
    raise ValueError(f"softmax must be one of {SOFTMAX_MODES}, got {softmax!r}")
  if max_estimate is not None:
    if softmax != "unified_max":
      raise ValueError("max_estimate applies to softmax='unified_max' only")
    if jnp.shape(max_estimate) != q.shape[:2]:
      raise ValueError(f"max_estimate must be [batch, q_heads] = {q.shape[:2]}, got "
                       f"{jnp.shape(max_estimate)}")
    if not jnp.issubdtype(jnp.result_type(max_estimate), jnp.floating):
      raise TypeError(f"max_estimate must be a float array, got {jnp.result_type(max_estimate)}")
  if schedule is None:
    return
  if not isinstance(schedule, DecodeSchedule):
    raise TypeError(f"schedule must be a DecodeSchedule (jattn.decode_schedule), got "
                    f"{type(schedule).__name__}")
  if num_splits is not None:
    raise ValueError("give num_splits or schedule, not both (a schedule fixes the partition)")
  if schedule.row_units.shape != (sequences + 1,) or schedule.block != block:
    raise ValueError(f"schedule does not match this call: it has {schedule.row_units.shape[0] - 1}"
                     f" sequences in blocks of {schedule.block} keys, the call {sequences} in "
                     f"blocks of {block}; make it with decode_schedule(...) and the call's "
                     f"arguments")


def check_schedule_covers(schedule, kv_lengths, window_left):
  """ValueError unless each sequence's units cover its visible key blocks (a schedule made for
  shorter lengths or another window); traced values: under ``debug_checks``."""
  lens, b = kv_lengths, schedule.block
  lo = jnp.zeros_like(lens) if window_left is None else jnp.maximum(lens - 1 - window_left, 0) // b
  hi = (lens + b - 1) // b
  n, seen = lens.shape[0], lambda: hi > lo
  covered = jax.ops.segment_sum(schedule.unit_count, schedule.unit_row, num_segments=n + 1)[:n]
  first = schedule.unit_first[jnp.minimum(schedule.row_units[:-1], schedule.max_units - 1)]
  check_range("schedule (first key block of sequence)", first, 0, lo, valid=seen)
  check_range("schedule (key blocks up to, per sequence)", first + covered, hi, 2**31 - 1,
              valid=seen)


def newest_key_logits(q, k_cache, kv_lengths, *, page_table=None, scale, logits_soft_cap=None):
  """Each query head's logit (after scale and soft cap) of its sequence's newest key: the default
  ``max_estimate``, a lower bound of the row max (length-0 rows read key 0, never used).

  Args:
    q, k_cache, kv_lengths, page_table, scale, logits_soft_cap: as in the decode call
      (contiguous cache or page pool; resolved options).

  Returns:
    fp32 [batch, q_heads].

  Example:
    >>> newest_key_logits(jnp.ones((1, 2, 4)), jnp.ones((1, 8, 1, 4)), jnp.array([3]),
    ...                   scale=0.5).tolist()
    [[2.0, 2.0]]
  """
  (b, hq, d), hk, ps = q.shape, k_cache.shape[2], k_cache.shape[1]
  table = jnp.arange(b)[:, None] if page_table is None else page_table   # contiguous: one page
  pos = jnp.clip(kv_lengths - 1, 0, table.shape[1] * ps - 1)
  page = jnp.clip(table[jnp.arange(b), pos // ps], 0, k_cache.shape[0] - 1)
  k_new = k_cache[page, pos % ps]                                        # [b, hk, d]
  s = jnp.einsum("bhgd,bhd->bhg", q.astype(jnp.float32).reshape(b, hk, hq // hk, d),
                 k_new.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST) * scale
  if logits_soft_cap is not None:
    s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
  return s.reshape(b, hq)


def run_decode(partials, q, kv_heads, m_hat, schedule, *, softmax, merge, interpret):
  """(out [batch, q_heads, dv] in q.dtype, lse fp32) from ``partials(m_hat=None, active=None)``
  (the kernel's, leading [batch, splits] or, with a ``schedule``, [1, U]), inside the jit."""
  b, hq, _ = q.shape
  if schedule is None:
    rowsum = lambda x: jnp.sum(x, axis=1)
    per_partial = lambda x: x[:, None]                                   # [b, 1, ...]
    row_max = lambda x: jnp.max(x, axis=1)
  else:
    rows = schedule.unit_row
    rowsum = lambda x: jax.ops.segment_sum(x[0], rows, b)
    per_partial = lambda x: x[jnp.minimum(rows, b - 1)][None]            # [1, U, ...]
    row_max = lambda x: jax.ops.segment_max(x[0], rows, b)

  def merge_fn(o, lse):   # a row's units are contiguous: one Pallas program per (row, head)
    if merge == "pallas":
      out, lse = _merge.merge_partials_pallas(
          o, lse, out_dtype=q.dtype, interpret=interpret,
          row_units=None if schedule is None else schedule.row_units)
    elif schedule is None:
      out, lse = _merge.merge_partials(o, lse, axis=1)
    else:
      out, lse = _merge.merge_partials_by_row(o[0], lse[0], rows, b)
    return out.astype(q.dtype), lse
  if softmax == "exact":
    return merge_fn(*partials())
  acc, l, mx = partials(m_hat=m_hat)
  m_p, top = per_partial(m_hat), per_partial(row_max(mx))
  # NaN estimates fail both comparisons and are flagged with every non-empty partial.
  bad = ((jnp.isfinite(mx) & ~(mx <= m_p + UNIFIED_MARGIN))
         | (jnp.isfinite(top) & ~(top >= m_p - UNIFIED_MARGIN)))          # [P0, P1, hq]

  def normalized(acc, l, m):   # (acc / l, m + log l); (acc, -inf) where l == 0
    safe, lse = _softmax.safe_lse(m, l)
    return acc / safe[..., None], lse

  def plain_sum():
    out, lse = normalized(rowsum(acc), rowsum(l), m_hat)
    return out.astype(q.dtype), lse

  def recompute():
    active = jnp.any(bad.reshape(*bad.shape[:2], kv_heads, hq // kv_heads), axis=-1)
    o_x, lse_x = partials(active=active.astype(jnp.int32))
    use = jnp.repeat(active, hq // kv_heads, axis=-1)                    # [P0, P1, hq]
    o, lse = normalized(acc, l, m_p)
    return merge_fn(jnp.where(use[..., None], o_x, o), jnp.where(use, lse_x, lse))
  return jax.lax.cond(jnp.any(bad), recompute, plain_sum)
