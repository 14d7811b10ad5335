"""Flash decoding: one query token per sequence over a contiguous or paged KV cache.

Sequence b's query sits at ``kv_lengths[b] - 1``; keys it cannot see never leak. Forward only
("xla" is differentiable by autodiff). Implementations and options: docs/decode.md.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from typing import Any

import jax
import jax.numpy as jnp

from jattn import _layout
from jattn import decode_serving as _serve
from jattn._plan import Plan
from jattn._validate import (as_array, as_int32, check_flags, check_float, check_implementation,
                             check_int, check_lengths, check_nonempty, check_range,
                             check_same_dtype, check_scale_and_cap)
from pallas_kernels import compat
from pallas_kernels.decode import reference as _ref
from pallas_kernels.masks import normalize_window

__all__ = ["DecodeConfig", "append_kv", "append_kv_paged", "check_decode_call", "decode_attention",
           "decode_plan", "default_num_splits", "paged_decode_attention",
           "resolve_decode_implementation"]

IMPLEMENTATIONS = ("xla", "triton", "mosaic_tpu")
MIN_PAGE_SIZE = 16


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """The resolved configuration of a decode call (``Plan.config`` of :func:`decode_plan`).

  Attributes:
    num_splits: parts each sequence's visible keys are split into (None with a schedule).
    block_sizes: the kernel's ``DecodeBlockSizes``, None for "xla".
    merge: how splits (or a schedule's units, by row) are merged: "pallas" (triton) or "xla".
    softmax: "exact" or "unified_max" (``jattn.decode_serving``).
    max_units: the schedule's unit count, None for splits.

  Example:
    >>> DecodeConfig(num_splits=1).merge
    'xla'
  """
  num_splits: int | None
  block_sizes: Any = None
  merge: str = "xla"
  softmax: str = "exact"
  max_units: int | None = None


def resolve_decode_implementation(implementation=None, *, platform=None):
  """The implementation the decode ops run for a request.

  Args:
    implementation: None, one of ``IMPLEMENTATIONS``, or "mosaic_gpu" (the Hopper flash kernel,
      e.g. a layer's implementation; it decodes with "triton").
    platform: "cpu", "gpu" or "tpu"; default: jax's default backend.

  Returns:
    The implementation name (any other named implementation is returned unchanged).

  Example:
    >>> resolve_decode_implementation("xla"), resolve_decode_implementation("mosaic_gpu")
    ('xla', 'triton')
  """
  if implementation == "mosaic_gpu":
    return "triton"
  check_implementation(implementation, IMPLEMENTATIONS)
  return implementation or {"gpu": "triton", "tpu": "mosaic_tpu"}.get(
      platform or compat.default_backend(), "xla")


def default_num_splits(implementation, batch, kv_heads, max_len, block_sizes=None, *,
                       head_dim=128, dtype=jnp.bfloat16):
  """The split count used when ``num_splits=None``: for "triton" its kernel module's
  ``default_num_splits`` (about two programs per multiprocessor), else 1.

  Args:
    implementation: a resolved implementation name.
    batch, kv_heads, max_len: the call's batch size, kv heads and cache capacity in tokens.
    block_sizes: the kernel's block sizes (for block_k), or None for its defaults.
    head_dim, dtype: the head dimension and cache dtype (select the default block sizes).

  Returns:
    An int >= 1.

  Example:
    >>> default_num_splits("xla", 1, 8, 131072)
    1
  """
  if implementation != "triton":
    return 1
  kt = _kernel_module("triton")
  bs = block_sizes or kt.default_block_sizes(head_dim, dtype)
  return kt.default_num_splits(batch, kv_heads, max_len, core_count=compat.gpu_core_count(),
                               block_k=bs.block_k)


# ----------------------------------------------------------------------------- validation
def _check_options(local_window_size, logits_soft_cap, num_splits, scale):
  window = normalize_window(local_window_size)
  scale, logits_soft_cap = check_scale_and_cap(scale, logits_soft_cap)
  if num_splits is not None:
    check_int("num_splits", num_splits)
  return window, logits_soft_cap, scale


def check_decode_call(q, k, v, kv_lengths, page_table=None, kv_layout="nhd", *,
                      min_page_size=MIN_PAGE_SIZE):
  """Validates a decode call (contiguous, or paged with ``page_table``): concrete bad lengths and
  used page ids raise ValueError naming the entry; traced ones are clamped (docs/decode.md).

  Args:
    q, k, v, kv_lengths, page_table, kv_layout: the call's (caches or page pools).
    min_page_size: the smallest page size the op runs.

  Returns:
    (kv_lengths int32, page_table int32 or None, batch, kv_heads, capacity).

  Example:
    >>> q = jnp.zeros((1, 4, 8)); k = jnp.zeros((1, 32, 2, 8))
    >>> check_decode_call(q, k, k, [40])
    Traceback (most recent call last):
    ValueError: kv_lengths[0] = 40, expected a value in [0, 32]
  """
  _layout.check_kv_layout(kv_layout)
  name = "cache" if page_table is None else "pages"
  if kv_layout == "hnd":   # validate as the "nhd" cache of the same sizes (same messages)
    if k.ndim != 4 or v.ndim != 4 or v.shape[:3] != k.shape[:3]:
      raise ValueError(f"with kv_layout='hnd', k/v must be "
                       f"[{'batch' if name == 'cache' else 'pages'}, kv_heads, len, d] and agree "
                       f"in all but the last dim (v's head_dim may differ), got {k.shape} / "
                       f"{v.shape}")
    if name == "cache" and q.ndim == 3 and (q.shape[-1] != k.shape[-1] or q.shape[1] % k.shape[1]):
      raise ValueError(f"q {q.shape} does not match the head-major cache {k.shape} "
                       f"([batch, kv_heads, len, head_dim])")
    k, v = (jax.ShapeDtypeStruct((x.shape[0], x.shape[2], x.shape[1], x.shape[3]), x.dtype)
            for x in (k, v))
  kn, vn = f"k_{name}", f"v_{name}"
  for n, x in (("q", q), (kn, k), (vn, v)):
    check_float(n, x)
  check_same_dtype(**{kn: k, vn: v})   # the query may be wider (fp32 over a bf16 cache)
  if q.ndim != 3:
    raise ValueError(f"q must be [batch, q_heads, head_dim], got shape {q.shape}")
  if k.ndim != 4 or v.ndim != 4 or k.shape[:3] != v.shape[:3]:
    raise ValueError(f"{kn} and {vn} must be 4-D and have the same shape except the last dim (v's "
                     f"head_dim may differ), got {k.shape} and {v.shape}")
  if k.dtype != v.dtype:
    raise TypeError(f"{kn} and {vn} dtypes differ: {k.dtype} vs {v.dtype}")
  check_nonempty(q=q, **{kn: k, vn: v})
  if q.shape[-1] != k.shape[-1]:
    raise ValueError(f"q and {kn} head_dim differ: q {q.shape}, k {k.shape}")
  if q.shape[1] % k.shape[2]:
    raise ValueError(f"q_heads ({q.shape[1]}) must be a multiple of kv_heads ({k.shape[2]}) for "
                     f"GQA/MQA")
  batch = q.shape[0]
  if page_table is not None:
    if k.shape[1] < min_page_size:
      raise ValueError(f"page_size must be >= {min_page_size}, got {k.shape[1]}")
    page_table, kv_lengths = check_page_table(page_table, kv_lengths, k.shape[0], k.shape[1],
                                              batch)
    return kv_lengths, page_table, batch, k.shape[2], page_table.shape[1] * k.shape[1]
  if k.shape[0] != batch:
    raise ValueError(f"k_cache batch {k.shape[0]} != q batch {batch}")
  kv_lengths = check_lengths("kv_lengths", kv_lengths, batch, k.shape[1])
  return kv_lengths, None, batch, k.shape[2], k.shape[1]


def check_page_table(page_table, kv_lengths, num_pages, page_size, batch=None):
  """(page_table int32 [batch, max_pages], kv_lengths int32) of a paged call: shapes and dtypes
  checked; a page id that a sequence uses outside [0, num_pages) raises ValueError naming it
  when concrete (traced: under ``debug_checks``)."""
  page_table = as_array("page_table", page_table)
  if page_table.ndim != 2 or page_table.shape[0] != (batch or page_table.shape[0]) or (
      page_table.shape[1] < 1):
    raise ValueError("page_table must be [batch, max_pages] with max_pages >= 1"
                     + ("" if batch is None else f" and batch = {batch}")
                     + f", got shape {page_table.shape}")
  page_table = as_int32("page_table", page_table)
  kv_lengths = check_lengths("kv_lengths", kv_lengths, page_table.shape[0],
                             page_table.shape[1] * page_size)
  used = lambda: jnp.arange(page_table.shape[1]) * page_size < kv_lengths[:, None]
  check_range("page_table", page_table, 0, num_pages - 1, valid=used)
  return page_table, kv_lengths


# ----------------------------------------------------------------------------- plan
def decode_plan(q, k_cache, v_cache, kv_lengths, *, page_table=None, kv_layout="nhd", scale=None,
                local_window_size=None, logits_soft_cap=None, num_splits=None, return_lse=False,
                implementation=None, interpret=False, block_sizes=None, softmax="exact",
                max_estimate=None, schedule=None):
  """What :func:`decode_attention` (or, with ``page_table``, :func:`paged_decode_attention`)
  runs: explicit arguments, else the kernel's defaults and :func:`default_num_splits`.

  Args:
    q, k_cache, v_cache, kv_lengths, page_table, kv_layout: the call's (arrays or
      ShapeDtypeStructs; ``page_table`` None for a contiguous cache).
    scale, local_window_size, logits_soft_cap, return_lse, interpret, max_estimate: validated
      as in the call (they do not change the plan).
    implementation, num_splits, block_sizes, softmax, schedule: as in
      :func:`decode_attention` (``schedule``: only its unit count enters the plan).

  Returns:
    A ``jattn._plan.Plan`` with op "decode" or "paged_decode", the implementation, a
    :class:`DecodeConfig`, no backward, table None and the device kind.

  Example:
    >>> q = jnp.zeros((1, 8, 64)); k = jnp.zeros((1, 256, 2, 64))
    >>> p = decode_plan(q, k, k, jnp.array([100]), implementation="xla")
    >>> p.op, p.implementation, p.config.num_splits
    ('decode', 'xla', 1)
  """
  kv_lengths, page_table = (jnp.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct)
                            else x for x in (kv_lengths, page_table))   # shapes: check on zeros
  _, _, batch, kv_heads, capacity = check_decode_call(q, k_cache, v_cache, kv_lengths,
                                                      page_table, kv_layout)
  _check_options(local_window_size, logits_soft_cap, num_splits, scale)
  check_flags(return_lse=return_lse, interpret=interpret)
  impl = resolve_decode_implementation(implementation)
  d, dv, dtype = q.shape[-1], v_cache.shape[-1], k_cache.dtype
  kern = None if impl == "xla" else _kernel_module(impl)
  bs = None if kern is None else block_sizes or (
      kern.default_block_sizes(max(d, dv), dtype) if impl == "triton" else kern.DecodeBlockSizes())
  if softmax != "exact" or schedule is not None:
    if impl == "mosaic_tpu" and softmax in _serve.SOFTMAX_MODES:
      raise NotImplementedError("softmax='unified_max' and schedules run on 'xla' and "
                                "'triton'; the Mosaic TPU kernel runs exact splits")
    _serve.check_serving_args(q, softmax, max_estimate, schedule, num_splits,
                              batch * kv_heads if kv_layout == "hnd" else batch,
                              _serve.XLA_BLOCK if impl == "xla" else bs.block_k)
  if num_splits is None and schedule is None:
    num_splits = default_num_splits(impl, batch, kv_heads, capacity, bs, head_dim=d, dtype=dtype)
  config = DecodeConfig(num_splits=None if schedule is not None else int(num_splits),
                        block_sizes=bs, merge="pallas" if impl == "triton" else "xla",
                        softmax=softmax, max_units=None if schedule is None else schedule.max_units)
  return Plan(op="decode" if page_table is None else "paged_decode", implementation=impl,
              config=config, device_kind=jax.devices()[0].device_kind)


def _kernel_module(impl):
  return importlib.import_module(f"pallas_kernels.decode.{impl}")   # "triton" or "mosaic_tpu"


# ----------------------------------------------------------------------------- public ops
def decode_attention(q, k_cache, v_cache, kv_lengths, *, scale=None, local_window_size=None,
                     logits_soft_cap=None, num_splits=None, return_lse=False, implementation=None,
                     interpret=False, block_sizes=None, kv_layout="nhd", softmax="exact",
                     max_estimate=None, schedule=None):
  """Attention of one new query token per sequence over a contiguous KV cache (flash decoding).

  Args:
    q: [batch, q_heads, head_dim], fp32/bf16/fp16.
    k_cache, v_cache: [batch, max_len, kv_heads, head_dim(_v)] ("nhd") or [batch, kv_heads, max_len,
      head_dim(_v)] ("hnd": a free reshape to batch * kv_heads sequences); kv_heads divides q_heads.
    kv_lengths: int32 [batch] in [0, max_len]: valid entries per sequence, query at
      ``kv_lengths - 1`` (ValueError outside; traced values: :func:`check_decode_call`).
    scale: logit scale, default 1/sqrt(head_dim).
    local_window_size: None, int w or (left, right) (jax.nn convention; only left matters).
    logits_soft_cap: None or cap > 0: logits = cap * tanh(logits / cap).
    num_splits: None (:func:`default_num_splits`) or an int >= 1: key splits per sequence.
    return_lse: also return the log-sum-exp [batch, q_heads] (fp32, natural log).
    implementation: None, "xla", "triton" or "mosaic_tpu" (:func:`resolve_decode_implementation`).
    interpret: run a Pallas kernel in interpret mode (CPU).
    block_sizes, kv_layout: optional kernel-specific ``DecodeBlockSizes``; "nhd" or "hnd".
    softmax: "exact" or "unified_max" (one shared max estimate per (row, head) and a plain-sum
      merge: ``jattn.decode_serving``); "xla" and "triton".
    max_estimate: None (each row's newest-key logit) or fp32 [batch, q_heads] in logit units
      (after scale and soft cap), for "unified_max".
    schedule: None (``num_splits`` equal splits per sequence) or a ``DecodeSchedule`` from
      ``jattn.decode_schedule`` with this call's arguments: length-balanced units.

  Returns:
    out [batch, q_heads, head_dim_v] in q.dtype, or (out, lse) if return_lse (either layout).

  Example:
    >>> q, k = jnp.ones((2, 8, 64)), jnp.ones((2, 256, 2, 64))
    >>> decode_attention(q, k, k, jnp.array([17, 256], jnp.int32), implementation="xla").shape
    (2, 8, 64)
  """
  return _run(q, k_cache, v_cache, kv_lengths, None, scale=scale,
              local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
              num_splits=num_splits, return_lse=return_lse, implementation=implementation,
              interpret=interpret, block_sizes=block_sizes, kv_layout=kv_layout, softmax=softmax,
              max_estimate=max_estimate, schedule=schedule)


def paged_decode_attention(q, k_pages, v_pages, page_table, kv_lengths, *, scale=None,
                           local_window_size=None, logits_soft_cap=None, num_splits=None,
                           return_lse=False, implementation=None, interpret=False,
                           block_sizes=None, kv_layout="nhd", softmax="exact",
                           max_estimate=None, schedule=None):
  """Decode attention over a paged KV cache (continuous batching, vLLM-style page table).

  Args:
    q: [batch, q_heads, head_dim].
    k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim(_v)] ("nhd") or [num_pages,
      kv_heads, page_size, head_dim(_v)] ("hnd": page p of kv head h becomes page
      p * kv_heads + h of one-head sequences), one dtype; page_size >= 16.
    page_table: int32 [batch, max_pages]: token t of sequence b is in page
      ``page_table[b, t // page_size]`` at slot ``t % page_size``.
    kv_lengths: int32 [batch] in [0, max_pages * page_size] (traced lengths and page ids out
      of range are clamped: :func:`check_decode_call`).
    scale, local_window_size, logits_soft_cap, num_splits, return_lse, implementation,
      interpret, block_sizes, kv_layout, softmax, max_estimate, schedule: as in
      :func:`decode_attention` (a schedule from ``jattn.decode_schedule(...,
      page_table=page_table)``; head-major pages take no schedule).

  Returns:
    out [batch, q_heads, head_dim_v] in q.dtype, or (out, lse) if return_lse.

  Example:
    >>> q, pages = jnp.ones((2, 4, 32)), jnp.ones((6, 16, 2, 32))
    >>> table = jnp.array([[3, 1, 0], [5, 2, 4]], jnp.int32)
    >>> paged_decode_attention(q, pages, pages, table, jnp.array([40, 7], jnp.int32),
    ...                        implementation="xla").shape
    (2, 4, 32)
  """
  return _run(q, k_pages, v_pages, kv_lengths, as_array("page_table", page_table), scale=scale,
              local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
              num_splits=num_splits, return_lse=return_lse, implementation=implementation,
              interpret=interpret, block_sizes=block_sizes, kv_layout=kv_layout, softmax=softmax,
              max_estimate=max_estimate, schedule=schedule)


def _run(q, k, v, kv_lengths, page_table, *, scale, local_window_size, logits_soft_cap,
         num_splits, return_lse, implementation, interpret, block_sizes, kv_layout, softmax,
         max_estimate, schedule):
  kv_lengths, page_table, _, _, _ = check_decode_call(q, k, v, kv_lengths, page_table, kv_layout)
  window, cap, scale = _check_options(local_window_size, logits_soft_cap, num_splits, scale)
  if page_table is not None and kv_layout == "hnd" and schedule is not None:
    raise NotImplementedError("schedule= runs on 'nhd' pages and on contiguous caches of both "
                              "layouts; head-major ('hnd') pages take no schedule")
  plan = decode_plan(q, k, v, kv_lengths, page_table=page_table, kv_layout=kv_layout,
                     implementation=implementation, num_splits=num_splits,
                     block_sizes=block_sizes, softmax=softmax, schedule=schedule,
                     return_lse=return_lse, interpret=interpret)
  _serve.check_serving_args(q, softmax, max_estimate, None, None, None, None)
  if schedule is not None:
    _serve.check_schedule_covers(schedule, jnp.repeat(kv_lengths, k.shape[1]) if (
        kv_layout == "hnd") else kv_lengths, None if window is None else window[0])
  out, lse = _decode_jit(q, k, v, kv_lengths, page_table, max_estimate, schedule,
                         impl=plan.implementation, config=plan.config, scale=scale,
                         window=window, cap=cap, interpret=interpret, kv_layout=kv_layout)
  return (out, lse) if return_lse else out


@functools.partial(jax.jit, static_argnames=("impl", "config", "scale", "window", "cap",
                                             "interpret", "kv_layout"))
def _decode_jit(q, k, v, kv_lengths, page_table=None, max_estimate=None, schedule=None, *, impl,
                config, scale, window, cap, interpret, kv_layout="nhd"):
  """Both public ops inside the jit: a contiguous cache, or page pools with ``page_table``."""
  if kv_layout == "hnd":   # inside the jit: the reshapes are free (no eager copy of the cache)
    if page_table is None:
      q2, k2, v2, lens2 = _layout.hnd_as_sequences(q, k, v, kv_lengths)
    else:
      q2, k2, v2, page_table, lens2 = _layout.hnd_pages_as_sequences(q, k, v, page_table,
                                                                     kv_lengths)
    est = None if max_estimate is None else max_estimate.reshape(q2.shape[:2])
    return _layout.sequences_as_hnd(q.shape[0], *_decode_jit(
        q2, k2, v2, lens2, page_table, est, schedule, impl=impl, config=config, scale=scale,
        window=window, cap=cap, interpret=interpret))
  window_left = None if window is None else window[0]
  exact = config.softmax == "exact" and schedule is None
  if exact and impl == "xla":
    if page_table is not None:
      k, v = _ref.gather_pages(k, page_table), _ref.gather_pages(v, page_table)
    out, lse = _ref.decode_reference(q, k, v, kv_lengths, scale=scale, local_window_size=window,
                                     logits_soft_cap=cap, num_splits=config.num_splits,
                                     upcast=False)
    return out.astype(q.dtype), lse
  # the kernels' partials ([B, S, Hq, D], [B, S, Hq]), merged by jattn.decode_serving
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
  kw = dict(scale=scale, window_left=window_left, logits_soft_cap=cap)
  kw.update({"num_splits": config.num_splits} if schedule is None else {"units": schedule.units})
  if impl == "xla":
    kw.update(page_table=page_table, upcast=False,
              block=None if schedule is None else schedule.block)
    partials = functools.partial(_ref.decode_partials, q, k, v, kv_lengths, **kw)
  else:
    kern, pt = _kernel_module(impl), () if page_table is None else (page_table,)
    fn = kern.decode_partials if page_table is None else kern.paged_decode_partials
    partials = functools.partial(fn, q, k, v, *pt, kv_lengths, block_sizes=config.block_sizes,
                                 interpret=interpret, **kw)
  if exact and config.num_splits == 1:   # one split: its partial is the result
    out, lse = partials()
    return out[:, 0].astype(q.dtype), lse[:, 0]
  m_hat = None
  if config.softmax == "unified_max":
    m_hat = (_serve.newest_key_logits(q, k, kv_lengths, page_table=page_table, scale=scale,
                                      logits_soft_cap=cap)
             if max_estimate is None else max_estimate.astype(jnp.float32))
  return _serve.run_decode(partials, q, k.shape[2], m_hat, schedule, softmax=config.softmax,
                           merge=config.merge, interpret=interpret)


# ----------------------------------------------------------------------------- cache appends
def _check_append(k, v, k_new, v_new, kind, lead, batch=None):
  """Checks an append's caches (``[lead, kv_heads, dim]``) and new token (batch: k's first dim)."""
  names = (f"k_{kind}", f"v_{kind}")
  for name, x in zip(names, (k, v)):
    check_float(name, x)
  if k.ndim != 4 or v.ndim != 4 or v.shape[:3] != k.shape[:3]:
    raise ValueError(f"{names[0]} and {names[1]} must be [{lead}, kv_heads, dim] with the same "
                     f"first three dims, got {k.shape} and {v.shape}")
  check_nonempty(**dict(zip(names, (k, v))))
  for name, x, dim in (("k_new", k_new, k.shape[-1]), ("v_new", v_new, v.shape[-1])):
    check_float(name, x)
    if x.shape != (want := (batch or k.shape[0], k.shape[2], dim)):
      raise ValueError(f"{name} must be [batch, kv_heads, dim] = {want} (from k_{kind} "
                       f"and v_{kind}), got {x.shape}")


def append_kv(k_cache, v_cache, kv_lengths, k_new, v_new):
  """Write one new token per sequence at position ``kv_lengths[b]`` (functional update).

  Jit with ``donate_argnums=(0, 1)`` to update in place. A write at a full cache or a traced
  length outside [0, max_len) is dropped (the length still grows); concrete ones raise.

  Args:
    k_cache, v_cache: [batch, max_len, kv_heads, head_dim(_v)] (head_dim_v may differ, e.g. MLA).
    kv_lengths: int32 [batch], current lengths.
    k_new, v_new: [batch, kv_heads, head_dim(_v)] (cast to the cache dtype).

  Returns:
    (k_cache, v_cache, kv_lengths + 1).

  Example:
    >>> k = jnp.zeros((2, 8, 1, 4)); lens = jnp.array([0, 3], jnp.int32)
    >>> k2, v2, lens2 = append_kv(k, k, lens, jnp.ones((2, 1, 4)), jnp.ones((2, 1, 4)))
    >>> float(k2[1, 3, 0, 0]), lens2.tolist()
    (1.0, [1, 4])
  """
  _check_append(k_cache, v_cache, k_new, v_new, "cache", "batch, max_len")
  b, max_len = k_cache.shape[:2]
  lens = check_lengths("kv_lengths", kv_lengths, b, max_len)
  rows, slot = jnp.arange(b), jnp.where(lens < 0, max_len, lens)   # negative: dropped too
  return (k_cache.at[rows, slot].set(k_new.astype(k_cache.dtype), mode="drop"),
          v_cache.at[rows, slot].set(v_new.astype(v_cache.dtype), mode="drop"), lens + 1)


def append_kv_paged(k_pages, v_pages, page_table, kv_lengths, k_new, v_new):
  """Write one new token per sequence into its page (functional update of the page pool).

  Token ``t = kv_lengths[b]`` goes to page ``page_table[b, t // page_size]`` (allocated by the
  caller), slot ``t % page_size``. Writes past the table, or a traced bad length or page id,
  are dropped; concrete bad ones raise, as in :func:`append_kv`.

  Args:
    k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim(_v)] (head_dim_v may differ).
    page_table, kv_lengths: int32 [batch, max_pages] and [batch].
    k_new, v_new: as :func:`append_kv`.

  Returns:
    (k_pages, v_pages, kv_lengths + 1).

  Example:
    >>> pages = jnp.zeros((4, 16, 1, 2)); table = jnp.array([[2, 3]], jnp.int32)
    >>> kp, vp, lens = append_kv_paged(pages, pages, table, jnp.array([17], jnp.int32),
    ...                                jnp.ones((1, 1, 2)), jnp.ones((1, 1, 2)))
    >>> float(kp[3, 1, 0, 0]), lens.tolist()
    (1.0, [18])
  """
  page_table = as_array("page_table", page_table)
  if page_table.ndim != 2 or 0 in page_table.shape:
    raise ValueError(f"page_table must be [batch, max_pages], both >= 1, got shape "
                     f"{page_table.shape}")
  page_table = as_int32("page_table", page_table)
  b, max_pages = page_table.shape
  _check_append(k_pages, v_pages, k_new, v_new, "pages", "num_pages, page_size", b)
  num_pages, page_size = k_pages.shape[:2]
  lens = check_lengths("kv_lengths", kv_lengths, b, max_pages * page_size)
  slot_page = lens // page_size
  in_table = (lens >= 0) & (slot_page < max_pages)
  check_range("page_table", page_table, 0, num_pages - 1,
              valid=lambda: in_table[:, None] & (jnp.arange(max_pages) == slot_page[:, None]))
  page = page_table[jnp.arange(b), jnp.clip(slot_page, 0, max_pages - 1)]
  page = jnp.where(in_table & (page >= 0) & (page < num_pages), page, num_pages)  # else dropped
  slot = lens % page_size
  return (k_pages.at[page, slot].set(k_new.astype(k_pages.dtype), mode="drop"),
          v_pages.at[page, slot].set(v_new.astype(v_pages.dtype), mode="drop"), lens + 1)
