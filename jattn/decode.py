"""Flash decoding: one query token per sequence over a contiguous or paged KV cache.

Implementations:
  * ``"xla"``: pure jnp (``pallas_kernels.decode.reference``; materialises the logits).
  * ``"triton"``: portable Pallas GPU split-KV kernel; each program handles all query heads of
    one kv head over one split of the sequence's visible keys, writes a partial (out, lse), and
    the splits are merged by one Triton kernel (``merge="pallas"``, the GPU default since
    session 25) or by XLA (``jattn.merge.merge_partials``, ``merge="xla"``).
  * ``"mosaic_tpu"``: Pallas Mosaic TPU kernel with the same split-KV structure (scalar-prefetched
    lengths and page table drive the K/V index maps).
  * ``"mosaic_gpu"``: Pallas Mosaic GPU kernel for Hopper (``pallas_kernels.decode.mosaic_gpu``:
    TMA ring, wgmma, warp specialisation; same split-KV partials; paged: one TMA per page). bf16
    or fp16, head_dim 64/128/256, no window or soft cap, page sizes dividing its block_k (64) or
    multiples of it (NotImplementedError otherwise); cache rows past a length inside its last
    64-key tile must be finite. GPU tests pass (run 23); 3.92-4.00 TB/s at B1 S128K against
    Triton's 4.06 (run 24), so never picked by ``None``.
  * ``None``: "triton" on GPU, "mosaic_tpu" on TPU, "xla" on CPU.

Semantics: sequence b holds ``kv_lengths[b]`` valid keys at cache positions
``0 .. kv_lengths[b] - 1``; its query sits at position ``kv_lengths[b] - 1``; a window
``(left, right)`` keeps keys ``j >= kv_lengths[b] - 1 - left`` (no key lies right of the query).
Lengths above the cache capacity are clamped to it. A length-0 sequence returns zeros and lse
-inf. Values may be narrower (or wider) than keys (MLA: keys carry extra rope dims); the output
has the values' head dim on every implementation. The decode paths compute forward only (the "xla" path is differentiable by autodiff).

``decode_attention(..., kv_layout="hnd")`` takes a head-major contiguous cache [batch, kv_heads,
max_len, head_dim] (run as batch x kv_heads sequences of one kv head, ``jattn._layout``).

``interpret=True`` runs a Pallas implementation on the CPU (tests); it is ignored by "xla".
"""
from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp

from jattn import _layout
from jattn.merge import merge_partials
from pallas_kernels import compat
from pallas_kernels.decode import reference as _ref
from pallas_kernels.masks import normalize_window

__all__ = ["decode_attention", "paged_decode_attention", "append_kv", "append_kv_paged",
           "resolve_decode_implementation", "default_num_splits", "bench_decode_cases"]

IMPLEMENTATIONS = ("xla", "triton", "mosaic_tpu", "mosaic_gpu")
MIN_PAGE_SIZE = 16


def resolve_decode_implementation(implementation=None, *, platform=None):
  """The implementation the decode ops run for a request.

  Args:
    implementation: None or one of ``IMPLEMENTATIONS``.
    platform: "cpu", "gpu" or "tpu"; default: jax's default backend.

  Returns:
    The implementation name (a named implementation is returned unchanged; never a fallback).

  Example:
    >>> resolve_decode_implementation("xla")
    'xla'
  """
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise ValueError(f"unknown implementation {implementation!r}; expected None or one of "
                     f"{IMPLEMENTATIONS}")
  if implementation is not None:
    return implementation
  platform = platform or compat.default_backend()
  return {"gpu": "triton", "tpu": "mosaic_tpu"}.get(platform, "xla")


def default_num_splits(implementation, batch, kv_heads, max_len, block_sizes=None, *,
                       head_dim=128, dtype=jnp.bfloat16):
  """The split count used when ``num_splits=None``.

  GPU ("triton", "mosaic_gpu"): at least two programs per multiprocessor (``compat.gpu_core_count()``) over
  the batch x kv_heads pairs and splits of at most about 1K keys (at most 32 splits), at least
  four key blocks per split, rounded down to a power of two (``pallas_kernels.decode.triton.default_num_splits``).
  "xla" and "mosaic_tpu": 1 (one pass; a TPU core walks the grid sequentially).

  Args:
    implementation: a resolved implementation name.
    batch: batch size.
    kv_heads: number of kv heads.
    max_len: cache capacity in tokens.
    block_sizes: the kernel's block sizes (for block_k), or None for its defaults.
    head_dim: head dimension (selects the default block sizes).
    dtype: cache dtype (selects the default block sizes).

  Returns:
    An int >= 1.

  Example:
    >>> default_num_splits("xla", 1, 8, 131072)
    1
  """
  if implementation not in ("triton", "mosaic_gpu"):
    return 1
  from pallas_kernels.decode import triton as kt
  if implementation == "mosaic_gpu":   # the Triton rule at the Mosaic GPU kernel's block_k
    from pallas_kernels.decode import mosaic_gpu as km
    bs = block_sizes or km.default_block_sizes(head_dim)
  else:
    bs = block_sizes or kt.default_block_sizes(head_dim, dtype)
  return kt.default_num_splits(batch, kv_heads, max_len, core_count=compat.gpu_core_count(),
                               block_k=bs.block_k)


# ----------------------------------------------------------------------------- validation
def _check_common(q, k, v, kv_lengths, *, cache_name):
  if q.ndim != 3:
    raise ValueError(f"q must be [batch, q_heads, head_dim], got shape {q.shape}")
  for name, x in (("q", q), ("k", k), ("v", v)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must have a floating dtype (fp32, bf16, fp16), got {x.dtype}")
  if k.ndim != 4:
    raise ValueError(f"k_{cache_name} must be 4-D, got shape {k.shape}")
  if v.ndim != 4 or k.shape[:3] != v.shape[:3]:
    raise ValueError(f"k_{cache_name} and v_{cache_name} must have the same shape except the "
                     f"last dim (v's head_dim may differ), got {k.shape} and {v.shape}")
  if k.dtype != v.dtype:
    raise TypeError(f"k_{cache_name} and v_{cache_name} dtypes differ: {k.dtype} vs {v.dtype}")
  if q.shape[-1] != k.shape[-1]:
    raise ValueError(f"q and k head_dim differ: q {q.shape}, k {k.shape}")
  hq, hk = q.shape[1], k.shape[2]
  if hq % hk:
    raise ValueError(f"q_heads ({hq}) must be a multiple of kv_heads ({hk}) for GQA/MQA")
  kv_lengths = jnp.asarray(kv_lengths)
  if kv_lengths.shape != (q.shape[0],):
    raise ValueError(f"kv_lengths must have shape (batch,) = ({q.shape[0]},), got "
                     f"{kv_lengths.shape}")
  if not jnp.issubdtype(kv_lengths.dtype, jnp.integer):
    raise TypeError(f"kv_lengths must be an integer array, got {kv_lengths.dtype}")
  return kv_lengths.astype(jnp.int32)


def _check_options(implementation, local_window_size, logits_soft_cap, num_splits, scale):
  impl = resolve_decode_implementation(implementation)
  window = normalize_window(local_window_size)
  if logits_soft_cap is not None:
    logits_soft_cap = float(logits_soft_cap)
    if not logits_soft_cap > 0:
      raise ValueError(f"logits_soft_cap must be > 0, got {logits_soft_cap}")
  if num_splits is not None:
    if isinstance(num_splits, bool) or int(num_splits) != num_splits or num_splits < 1:
      raise ValueError(f"num_splits must be None or an int >= 1, got {num_splits!r}")
    num_splits = int(num_splits)
  scale = None if scale is None else float(scale)
  return impl, window, logits_soft_cap, num_splits, scale


MERGES = ("xla", "pallas")


def _check_merge(merge, impl):
  """The split merge of a decode call: "xla" or "pallas"; None: "pallas" for the GPU
  implementations ("triton", "mosaic_gpu"; faster on the H200: 126.8 against 129.8-130.1 us
  per call by device kernel time, run 99), "xla" otherwise."""
  if merge is None:
    merge = "pallas" if impl in ("triton", "mosaic_gpu") else "xla"
  if merge not in MERGES:
    raise ValueError(f"merge must be None, 'xla' or 'pallas', got {merge!r}")
  if merge == "pallas" and impl not in ("triton", "mosaic_gpu"):
    raise ValueError(f"merge='pallas' (a Triton kernel) is for the GPU implementations "
                     f"'triton' and 'mosaic_gpu', got implementation {impl!r}")
  return merge


def _merge(o_parts, lse_parts, merge="xla", interpret=False, out_dtype=None):
  """[B, S, Hq, D], [B, S, Hq] partials -> ([B, Hq, D], [B, Hq]) fp32: XLA's reductions
  (``jattn.merge.merge_partials``) or one Pallas kernel (``merge="pallas"``, which writes the
  output in ``out_dtype`` itself, so no XLA convert follows)."""
  if o_parts.shape[1] == 1:
    return o_parts[:, 0], lse_parts[:, 0]
  if merge == "pallas":
    from pallas_kernels.sparse.decode import merge_decode_partials
    return merge_decode_partials(o_parts, lse_parts, out_dtype=out_dtype, interpret=interpret)
  return merge_partials(o_parts, lse_parts, axis=1)


# ----------------------------------------------------------------------------- public ops
def decode_attention(q, k_cache, v_cache, kv_lengths, *, scale=None, local_window_size=None,
                     logits_soft_cap=None, num_splits=None, return_lse=False, implementation=None,
                     interpret=False, block_sizes=None, kv_layout="nhd", merge=None):
  """Attention of one new query token per sequence over a contiguous KV cache (flash decoding).

  Cache layouts (``kv_layout``): "nhd" (default) is ``[batch, max_len, kv_heads, head_dim]``;
  "hnd" (head-major) is ``[batch, kv_heads, max_len, head_dim]``, where each kv head's keys are
  one contiguous run. Every implementation runs "hnd" as a free reshape of the cache to
  ``[batch * kv_heads, max_len, 1, head_dim]`` (batch x kv_heads sequences of one kv head; query
  head ``h * G + g`` becomes query head g of sequence ``b * kv_heads + h``, lengths repeated per
  kv head), with the same kernel programs and the same default ``num_splits`` as "nhd"; results
  come back as ``[batch, q_heads, ...]``. Paged caches (:func:`paged_decode_attention`) have no
  head-major option.

  Args:
    q: [batch, q_heads, head_dim], fp32/bf16/fp16.
    k_cache: [batch, max_len, kv_heads, head_dim] ("nhd") or [batch, kv_heads, max_len,
      head_dim] ("hnd"); q_heads % kv_heads == 0 (GQA: query head h reads kv head
      h // (q_heads // kv_heads)). bf16, fp16 or fp32.
    v_cache: like ``k_cache`` with head_dim_v, the dtype of ``k_cache``; head_dim_v may
      differ from head_dim (MLA: values narrower than the rope-extended keys).
    kv_lengths: int32 [batch]: valid entries per sequence; the query sits at position
      ``kv_lengths - 1``. 0 gives a zero output (and lse -inf).
    scale: logit scale, default 1/sqrt(head_dim).
    local_window_size: None, int w (= (w, w)) or (left, right) relative to the query position
      (jax.nn convention); only ``left`` matters for decoding. A "window of 512 tokens" is
      (511, 0).
    logits_soft_cap: None or cap > 0: logits = cap * tanh(logits / cap).
    num_splits: None (heuristic from batch, kv_heads, length and the GPU's multiprocessor count)
      or an int >= 1: how many parts each sequence's visible keys are split into. Every value
      gives the same result up to rounding.
    return_lse: also return the log-sum-exp [batch, q_heads] (fp32, natural log).
    implementation: None, "xla", "triton", "mosaic_tpu" or "mosaic_gpu" (Hopper; bf16/fp16,
      head_dim 64/128/256, no window or soft cap; never picked by None).
    interpret: run a Pallas kernel in interpret mode (CPU).
    block_sizes: optional kernel-specific block sizes (``pallas_kernels.decode.triton.
      DecodeBlockSizes``, ``pallas_kernels.decode.mosaic_tpu.DecodeBlockSizes`` or
      ``pallas_kernels.decode.mosaic_gpu.DecodeBlockSizes``).
    kv_layout: "nhd" (default) or "hnd": the layout of ``k_cache`` / ``v_cache``, see above.
      On an H200 (run 36) the "hnd" GPU tests pass (Triton, Mosaic GPU) and the Triton path
      ran 1.03x faster at B1 S128K GQA 32:8 D128 (140.2 vs 145.0 us).
    merge: how the splits' partials are merged: "xla" (XLA's reductions, about four small
      kernels and a convert) or "pallas" ("triton" and "mosaic_gpu" only: one Triton kernel,
      ``pallas_kernels.sparse.decode.merge_decode_partials``, writing the output dtype; the
      same log-sum-exp up to fp32 rounding). None (default): "pallas" for "triton" and
      "mosaic_gpu", else "xla". On the H200 the Triton decode with "pallas" took 126.81 us per
      call against 129.76 / 130.07 with "xla" by device kernel time (run 99, B1 S128K GQA 32:8
      D128; run 92: 123.15 against 126.92).

  Returns:
    out [batch, q_heads, head_dim_v] in q.dtype, or (out, lse) if return_lse (either layout).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> q = jax.random.normal(jax.random.key(0), (2, 8, 64))
    >>> k = jax.random.normal(jax.random.key(1), (2, 256, 2, 64))
    >>> out = decode_attention(q, k, k, jnp.array([17, 256], jnp.int32), implementation="xla")
    >>> out.shape
    (2, 8, 64)
    >>> decode_attention(q, k, k[..., :40], jnp.array([17, 256], jnp.int32),
    ...                  implementation="xla").shape
    (2, 8, 40)
    >>> kh = jnp.swapaxes(k, 1, 2)                  # head-major [batch, kv_heads, len, dim]
    >>> out_h = decode_attention(q, kh, kh, jnp.array([17, 256], jnp.int32),
    ...                          implementation="xla", kv_layout="hnd")
    >>> bool(jnp.allclose(out_h, out, atol=1e-5))
    True
  """
  _layout.check_kv_layout(kv_layout)
  if kv_layout == "hnd":   # validate as the "nhd" cache of the same sizes (same dtype messages)
    batch, kv_heads, max_len = _layout.check_hnd_shapes(q, k_cache, v_cache, kv_lengths)
    as_nhd = lambda x: jax.ShapeDtypeStruct((batch, max_len, kv_heads, x.shape[-1]), x.dtype)
    kv_lengths = _check_common(q, as_nhd(k_cache), as_nhd(v_cache), kv_lengths,
                               cache_name="cache")
  else:
    kv_lengths = _check_common(q, k_cache, v_cache, kv_lengths, cache_name="cache")
    batch, max_len, kv_heads, _ = k_cache.shape
  impl, window, cap, num_splits, scale = _check_options(implementation, local_window_size,
                                                        logits_soft_cap, num_splits, scale)
  merge = _check_merge(merge, impl)
  if impl == "mosaic_gpu":   # unsupported options raise now, not inside jit
    from pallas_kernels.decode import mosaic_gpu as km
    km.check_options(head_dim=q.shape[-1], head_dim_v=v_cache.shape[-1], dtype=k_cache.dtype,
                     window_left=None if window is None else window[0], logits_soft_cap=cap,
                     group=q.shape[1] // kv_heads, interpret=interpret)
  if num_splits is None:   # "hnd" too: the "nhd" choice at (batch, kv_heads), not (b * hk, 1)
    num_splits = default_num_splits(impl, batch, kv_heads, max_len, block_sizes,
                                    head_dim=q.shape[-1], dtype=k_cache.dtype)
  out, lse = _decode_jit(q, k_cache, v_cache, kv_lengths, impl=impl, scale=scale, window=window,
                         cap=cap, num_splits=num_splits, block_sizes=block_sizes,
                         interpret=interpret, kv_layout=kv_layout, merge=merge)
  return (out, lse) if return_lse else out


_STATICS = ("impl", "scale", "window", "cap", "num_splits", "block_sizes", "interpret",
            "merge")


@functools.partial(jax.jit, static_argnames=_STATICS + ("kv_layout",))
def _decode_jit(q, k_cache, v_cache, kv_lengths, *, impl, scale, window, cap, num_splits,
                block_sizes, interpret, kv_layout="nhd", merge="xla"):
  if kv_layout == "hnd":   # inside the jit: the reshapes are free (no eager copy of the cache)
    batch = q.shape[0]
    out, lse = _decode_jit(*_layout.hnd_as_sequences(q, k_cache, v_cache, kv_lengths), impl=impl,
                           scale=scale, window=window, cap=cap, num_splits=num_splits,
                           block_sizes=block_sizes, interpret=interpret, merge=merge)
    return _layout.sequences_as_hnd(batch, out, lse)
  if impl == "xla":
    out, lse = _ref.decode_reference(q, k_cache, v_cache, kv_lengths, scale=scale,
                                     local_window_size=window, logits_soft_cap=cap,
                                     num_splits=None if num_splits == 1 else num_splits,
                                     upcast=False)
  else:
    kern = _kernel_module(impl)
    o_parts, lse_parts = kern.decode_partials(
        q, k_cache, v_cache, kv_lengths, num_splits=num_splits, scale=scale,
        window_left=None if window is None else window[0], logits_soft_cap=cap,
        block_sizes=block_sizes, interpret=interpret)
    out, lse = _merge(o_parts, lse_parts, merge, interpret, q.dtype)
  return out.astype(q.dtype), lse


def _kernel_module(impl):
  if impl == "triton":
    from pallas_kernels.decode import triton as kern
  elif impl == "mosaic_tpu":
    from pallas_kernels.decode import mosaic_tpu as kern
  elif impl == "mosaic_gpu":
    from pallas_kernels.decode import mosaic_gpu as kern
  else:
    raise ValueError(f"{impl!r} is not a Pallas implementation")
  return kern


def _check_paged(q, k_pages, page_table):
  if k_pages.shape[1] < MIN_PAGE_SIZE:
    raise ValueError(f"page_size (k_pages.shape[1]) must be >= {MIN_PAGE_SIZE}, got "
                     f"{k_pages.shape[1]}")
  page_table = jnp.asarray(page_table)
  if page_table.ndim != 2 or page_table.shape[0] != q.shape[0]:
    raise ValueError(f"page_table must be [batch, max_pages] with batch = {q.shape[0]}, got "
                     f"shape {page_table.shape}")
  if page_table.shape[1] < 1:
    raise ValueError("page_table needs at least one column (max_pages >= 1)")
  if not jnp.issubdtype(page_table.dtype, jnp.integer):
    raise TypeError(f"page_table must be an integer array, got {page_table.dtype}")
  return page_table.astype(jnp.int32)


def paged_decode_attention(q, k_pages, v_pages, page_table, kv_lengths, *, scale=None,
                           local_window_size=None, logits_soft_cap=None, num_splits=None,
                           return_lse=False, implementation=None, interpret=False,
                           block_sizes=None, merge=None):
  """Decode attention over a paged KV cache (continuous batching, vLLM-style page table).

  Work is split by each sequence's actual length: a short sequence in a batch with a long one
  only reads its own pages, and splits past its end do nothing.

  Args:
    q: [batch, q_heads, head_dim].
    k_pages: [num_pages, page_size, kv_heads, head_dim], page_size >= 16.
    v_pages: [num_pages, page_size, kv_heads, head_dim_v], the dtype of ``k_pages``.
    page_table: int32 [batch, max_pages]: token t of sequence b is stored in page
      ``page_table[b, t // page_size]`` at slot ``t % page_size``. Entries past a sequence's
      length are never read (they may hold anything).
    kv_lengths: int32 [batch]; clamped to ``max_pages * page_size``.
    scale, local_window_size, logits_soft_cap, num_splits, return_lse, implementation,
      interpret, block_sizes, merge: as in :func:`decode_attention`.

  Returns:
    out [batch, q_heads, head_dim_v] in q.dtype, or (out, lse) if return_lse.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> q = jax.random.normal(jax.random.key(0), (2, 4, 32))
    >>> pages = jax.random.normal(jax.random.key(1), (6, 16, 2, 32))
    >>> table = jnp.array([[3, 1, 0], [5, 2, 4]], jnp.int32)
    >>> out = paged_decode_attention(q, pages, pages, table, jnp.array([40, 7], jnp.int32),
    ...                              implementation="xla")
    >>> out.shape
    (2, 4, 32)
  """
  kv_lengths = _check_common(q, k_pages, v_pages, kv_lengths, cache_name="pages")
  page_table = _check_paged(q, k_pages, page_table)
  impl, window, cap, num_splits, scale = _check_options(implementation, local_window_size,
                                                        logits_soft_cap, num_splits, scale)
  merge = _check_merge(merge, impl)
  if impl == "mosaic_gpu":
    from pallas_kernels.decode import mosaic_gpu as km
    km.check_options(head_dim=q.shape[-1], head_dim_v=v_pages.shape[-1], dtype=k_pages.dtype,
                     window_left=None if window is None else window[0], logits_soft_cap=cap,
                     group=q.shape[1] // k_pages.shape[2], interpret=interpret,
                     page_size=k_pages.shape[1],
                     block_k=None if block_sizes is None else getattr(block_sizes, "block_k",
                                                                      None))
  batch = q.shape[0]
  _, page_size, kv_heads, _ = k_pages.shape
  capacity = page_table.shape[1] * page_size
  if num_splits is None:
    num_splits = default_num_splits(impl, batch, kv_heads, capacity, block_sizes,
                                    head_dim=q.shape[-1], dtype=k_pages.dtype)
  out, lse = _paged_decode_jit(q, k_pages, v_pages, page_table, kv_lengths, impl=impl,
                               scale=scale, window=window, cap=cap, num_splits=num_splits,
                               block_sizes=block_sizes, interpret=interpret, merge=merge)
  return (out, lse) if return_lse else out


@functools.partial(jax.jit, static_argnames=_STATICS)
def _paged_decode_jit(q, k_pages, v_pages, page_table, kv_lengths, *, impl, scale, window, cap,
                      num_splits, block_sizes, interpret, merge="xla"):
  if impl == "xla":
    out, lse = _ref.paged_decode_reference(q, k_pages, v_pages, page_table, kv_lengths,
                                           scale=scale, local_window_size=window,
                                           logits_soft_cap=cap,
                                           num_splits=None if num_splits == 1 else num_splits,
                                           upcast=False)
  else:
    kern = _kernel_module(impl)
    o_parts, lse_parts = kern.paged_decode_partials(
        q, k_pages, v_pages, page_table, kv_lengths, num_splits=num_splits, scale=scale,
        window_left=None if window is None else window[0], logits_soft_cap=cap,
        block_sizes=block_sizes, interpret=interpret)
    out, lse = _merge(o_parts, lse_parts, merge, interpret, q.dtype)
  return out.astype(q.dtype), lse


# ----------------------------------------------------------------------------- cache appends
def _check_new_token(k_new, v_new, b, hk, d, d_v):
  for name, x, dim in (("k_new", k_new, d), ("v_new", v_new, d_v)):
    if x.shape != (b, hk, dim):
      raise ValueError(f"{name} must be [batch, kv_heads, dim] = {(b, hk, dim)}, got {x.shape}")


def append_kv(k_cache, v_cache, kv_lengths, k_new, v_new):
  """Write one new token per sequence at position ``kv_lengths[b]`` (functional update).

  Jit with ``donate_argnums=(0, 1)`` to update the caches in place. A sequence whose cache is
  full (kv_lengths[b] >= max_len) has its write dropped; its returned length still grows by
  one, and decoding clamps lengths to the capacity.

  Args:
    k_cache: [batch, max_len, kv_heads, head_dim].
    v_cache: [batch, max_len, kv_heads, head_dim_v] (head_dim_v may differ, e.g. MLA).
    kv_lengths: int32 [batch], current lengths.
    k_new: [batch, kv_heads, head_dim] (cast to the cache dtype).
    v_new: [batch, kv_heads, head_dim_v].

  Returns:
    (k_cache, v_cache, kv_lengths + 1).

  Example:
    >>> k = jnp.zeros((2, 8, 1, 4)); lens = jnp.array([0, 3], jnp.int32)
    >>> k2, v2, lens2 = append_kv(k, k, lens, jnp.ones((2, 1, 4)), jnp.ones((2, 1, 4)))
    >>> float(k2[1, 3, 0, 0]), lens2.tolist()
    (1.0, [1, 4])
  """
  if k_cache.ndim != 4 or v_cache.ndim != 4 or v_cache.shape[:3] != k_cache.shape[:3]:
    raise ValueError(f"k_cache and v_cache must be [batch, max_len, kv_heads, dim] with the same "
                     f"first three dims, got {k_cache.shape} and {v_cache.shape}")
  b, max_len, hk, d = k_cache.shape
  _check_new_token(k_new, v_new, b, hk, d, v_cache.shape[-1])
  kv_lengths = jnp.asarray(kv_lengths)
  if kv_lengths.shape != (b,):
    raise ValueError(f"kv_lengths must have shape (batch,) = ({b},), got {kv_lengths.shape}")
  lens = kv_lengths.astype(jnp.int32)
  rows = jnp.arange(b)
  k_cache = k_cache.at[rows, lens].set(k_new.astype(k_cache.dtype), mode="drop")
  v_cache = v_cache.at[rows, lens].set(v_new.astype(v_cache.dtype), mode="drop")
  return k_cache, v_cache, lens + 1


def append_kv_paged(k_pages, v_pages, page_table, kv_lengths, k_new, v_new):
  """Write one new token per sequence into its page (functional update of the page pool).

  Token ``t = kv_lengths[b]`` goes to page ``page_table[b, t // page_size]``, slot
  ``t % page_size``; the caller allocates pages in the table beforehand. Writes past the table
  (t >= max_pages * page_size) are dropped. Jit with ``donate_argnums=(0, 1)`` for in-place.

  Args:
    k_pages: [num_pages, page_size, kv_heads, head_dim].
    v_pages: [num_pages, page_size, kv_heads, head_dim_v] (head_dim_v may differ, e.g. MLA).
    page_table: int32 [batch, max_pages].
    kv_lengths: int32 [batch].
    k_new: [batch, kv_heads, head_dim].
    v_new: [batch, kv_heads, head_dim_v].

  Returns:
    (k_pages, v_pages, kv_lengths + 1).

  Example:
    >>> pages = jnp.zeros((4, 16, 1, 2)); table = jnp.array([[2, 3]], jnp.int32)
    >>> kp, vp, lens = append_kv_paged(pages, pages, table, jnp.array([17], jnp.int32),
    ...                                jnp.ones((1, 1, 2)), jnp.ones((1, 1, 2)))
    >>> float(kp[3, 1, 0, 0]), lens.tolist()
    (1.0, [18])
  """
  if k_pages.ndim != 4 or v_pages.ndim != 4 or v_pages.shape[:3] != k_pages.shape[:3]:
    raise ValueError(f"k_pages and v_pages must be [num_pages, page_size, kv_heads, dim] with the "
                     f"same first three dims, got {k_pages.shape} and {v_pages.shape}")
  num_pages, page_size, hk, d = k_pages.shape
  page_table = jnp.asarray(page_table)
  b = page_table.shape[0] if page_table.ndim == 2 else None
  if page_table.ndim != 2:
    raise ValueError(f"page_table must be [batch, max_pages], got shape {page_table.shape}")
  kv_lengths = jnp.asarray(kv_lengths)
  if kv_lengths.shape != (b,):
    raise ValueError(f"kv_lengths must have shape (batch,) = ({b},), got {kv_lengths.shape}")
  _check_new_token(k_new, v_new, b, hk, d, v_pages.shape[-1])
  lens = kv_lengths.astype(jnp.int32)
  slot_page = lens // page_size
  in_table = (lens >= 0) & (slot_page < page_table.shape[1])
  page = jnp.take_along_axis(page_table.astype(jnp.int32),
                             jnp.clip(slot_page, 0, page_table.shape[1] - 1)[:, None], axis=1)[:, 0]
  page = jnp.where(in_table, page, num_pages)          # out of range -> dropped
  slot = lens % page_size
  k_pages = k_pages.at[page, slot].set(k_new.astype(k_pages.dtype), mode="drop")
  v_pages = v_pages.at[page, slot].set(v_new.astype(v_pages.dtype), mode="drop")
  return k_pages, v_pages, lens + 1


# ----------------------------------------------------------------------------- benchmark cases
def _bench_inputs(key, batch, max_len, q_heads, kv_heads, head_dim, dtype):
  kq, kk, kv = jax.random.split(key, 3)
  q = jax.random.normal(kq, (batch, q_heads, head_dim), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (batch, max_len, kv_heads, head_dim), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (batch, max_len, kv_heads, head_dim), jnp.float32).astype(dtype)
  return q, k, v


def _bench_paginate(key, k, v, page_size):
  """A shuffled page pool holding the contiguous caches: (k_pages, v_pages, page_table)."""
  b, n, hk, d = k.shape
  max_pages = n // page_size
  perm = jax.random.permutation(key, b * max_pages).astype(jnp.int32)
  inv = jnp.argsort(perm)
  k_pages = k.reshape(b * max_pages, page_size, hk, d)[inv]
  v_pages = v.reshape(b * max_pages, page_size, hk, d)[inv]
  return k_pages, v_pages, perm.reshape(b, max_pages)


def bench_decode_cases(time_fn, rel_err, *, quick=False, sweep=True, num_input_sets=3, cases=None,
                       interpret=False):
  """Benchmark rows for flash decoding on the current GPU (the lead's bench_kernels calls this).

  Cases (q_heads 32, kv_heads 8, head_dim 128, bf16): "B1 S128K" and "B8 S32K" at full length
  (contiguous and paged, page size 16 and 64), and "B8 S32K mixed": a paged batch of very
  different lengths (sum about 29% of 8 x 32K). Implementations: jattn triton (heuristic splits,
  plus a block-size sweep at B1 S128K when ``sweep``), jattn mosaic_gpu (contiguous and paged; at B1
  S128K unless ``quick`` also block_k 128 x 2 stages and 33 / 16 splits; not with
  ``interpret``), jattn xla, jax.nn "cudnn" and "xla",
  and JAX's Pallas GPU decode (``jax.experimental.pallas.ops.gpu.decode_attention.gqa``) when it
  imports. Bandwidth counts the bytes of K and V each sequence must read (its length x kv_heads
  x head_dim x 2 x itemsize) over the time.

  Args:
    time_fn: ``time_fn(fn, arg_sets) -> (median_ms, spread_ms)``.
    rel_err: ``rel_err(x, ref) -> float``.
    quick: only the B1 S128K case, no sweep.
    sweep: include the block-size / split-count sweep at B1 S128K.
    num_input_sets: random input sets rotated by the timer (defeats the L2 cache).
    cases: override the case list: tuples (name, batch, max_len, lengths or None); for smoke
      tests on small sizes.
    interpret: run the jattn kernels in interpret mode (CPU smoke tests only).

  Returns:
    A generator of row dicts: op "decode", case, impl, ms, spread_ms, tbps, speedup (vs jax.nn
    cudnn in the same case, when it ran), rel_err (vs the fp32 reference), ok, config (jattn
    triton rows: block_k, num_stages, num_warps, num_splits), and error when a row failed.

  Example:
    >>> rows = bench_decode_cases(time_fn, rel_err, quick=True)   # doctest: +SKIP
    >>> next(rows)["op"]                                           # doctest: +SKIP
    'decode'
  """
  from pallas_kernels.decode import triton as kt
  hq, hk, d, dtype = 32, 8, 128, jnp.bfloat16
  if cases is None:
    cases = [("B1 S128K", 1, 131072, None), ("B8 S32K", 8, 32768, None)]
    if not quick:
      cases.append(("B8 S32K mixed", 8, 32768,
                    [32768, 1024, 8192, 300, 16384, 4096, 2000, 12000]))
  ref_fn = jax.jit(functools.partial(_ref.decode_reference, upcast=True))
  try:
    from jax.experimental.pallas.ops.gpu import decode_attention as jax_pallas_decode
  except Exception:  # pragma: no cover - optional anchor
    jax_pallas_decode = None

  def row(case, impl, fn, arg_sets, ref, nbytes, base_ms, config=None):
    try:
      out = fn(*arg_sets[0])
      err = rel_err(out, ref)
      ms, spread = time_fn(fn, arg_sets)
      r = dict(op="decode", case=case, impl=impl, ms=ms, spread_ms=spread,
               tbps=nbytes / (ms * 1e-3) / 1e12, rel_err=err, ok=bool(err < 2e-2))
      if base_ms:
        r["speedup"] = base_ms / ms
      if config:
        r["config"] = config
      return r
    except Exception as e:  # record the failure and keep going
      return dict(op="decode", case=case, impl=impl, ok=False, error=f"{type(e).__name__}: {e}")

  for case, b, n, lengths_list in cases:
    keys = jax.random.split(jax.random.key(zlib.crc32(case.encode())), num_input_sets)
    sets = [_bench_inputs(kk, b, n, hq, hk, d, dtype) for kk in keys]
    lengths = jnp.full((b,), n, jnp.int32) if lengths_list is None else jnp.array(lengths_list,
                                                                                 jnp.int32)
    nbytes = float(jnp.sum(lengths)) * hk * d * 2 * jnp.dtype(dtype).itemsize
    q0, k0, v0 = sets[0]
    ref, _ = ref_fn(q0, k0, v0, lengths)
    contiguous = [(q, k, v, lengths) for q, k, v in sets]
    base_ms = None

    # Anchors first, so that speedups can refer to cuDNN.
    kvl = None if lengths_list is None else lengths
    for name in ("cudnn", "xla"):
      f = jax.jit(lambda q, k, v, lens, name=name: jax.nn.dot_product_attention(
          q[:, None], k, v, implementation=name,
          key_value_seq_lengths=None if kvl is None else lens)[:, 0])
      r = row(case, f"jax_nn_{name}", f, contiguous, ref, nbytes, None)
      if name == "cudnn" and r.get("ok"):
        base_ms = r["ms"]
      yield r
    if jax_pallas_decode is not None:
      f = jax.jit(lambda q, k, v, lens: jax_pallas_decode.gqa(q, k, v, kv_seq_len=lens,
                                                              k_splits=16))
      yield row(case, "jax_pallas_gqa_decode_k16", f, contiguous, ref, nbytes, base_ms)

    bs0 = kt.default_block_sizes(d, dtype)
    config = (f"bk{bs0.block_k},st{bs0.num_stages},w{bs0.num_warps},"
              f"sp{default_num_splits('triton', b, hk, n)}")
    f = jax.jit(functools.partial(decode_attention, implementation="triton",
                                  interpret=interpret))
    yield row(case, "jattn_triton", f, contiguous, ref, nbytes, base_ms, config)
    if not interpret:   # Hopper kernel (contiguous caches; an error row elsewhere)
      from pallas_kernels.decode import mosaic_gpu as km
      variants = [("", {})]
      if not quick and case == cases[0][0]:
        variants += [("[bk128,st2]", dict(block_sizes=km.DecodeBlockSizes(128, 2))),
                     ("[sp33]", dict(num_splits=33)), ("[sp16]", dict(num_splits=16))]
      for suffix, kw in variants:
        f = jax.jit(functools.partial(decode_attention, implementation="mosaic_gpu", **kw))
        yield row(case, f"jattn_mosaic_gpu{suffix}", f, contiguous, ref, nbytes, base_ms)
    if lengths_list is not None or not quick:
      f = jax.jit(functools.partial(decode_attention, implementation="xla"))
      yield row(case, "jattn_xla", f, contiguous, ref, nbytes, base_ms)
    split_sweep = () if quick or case == cases[0][0] else tuple(
        s for s in (4, 16, 32) if s != default_num_splits("triton", b, hk, n))
    for s in split_sweep:
      f = jax.jit(functools.partial(decode_attention, implementation="triton", num_splits=s,
                                    interpret=interpret))
      yield row(case, f"jattn_triton[sp{s}]", f, contiguous, ref, nbytes, base_ms)
    for page_size in ((64,) if quick else (16, 64)):
      paged_sets = []
      for i, (q, k, v) in enumerate(sets):
        kp, vp, table = _bench_paginate(jax.random.key(100 + i), k, v, page_size)
        paged_sets.append((q, kp, vp, table, lengths))
      f = jax.jit(functools.partial(paged_decode_attention, implementation="triton",
                                  interpret=interpret))
      yield row(case, f"jattn_triton_paged_ps{page_size}", f, paged_sets, ref, nbytes, base_ms,
                config)
      if not interpret:
        f = jax.jit(functools.partial(paged_decode_attention, implementation="mosaic_gpu"))
        yield row(case, f"jattn_mosaic_gpu_paged_ps{page_size}", f, paged_sets, ref, nbytes,
                  base_ms)
      for s in (split_sweep if page_size == 16 else ()):
        f = jax.jit(functools.partial(paged_decode_attention, implementation="triton",
                                      num_splits=s, interpret=interpret))
        yield row(case, f"jattn_triton_paged_ps16[sp{s}]", f, paged_sets, ref, nbytes, base_ms)
      del paged_sets
    if sweep and not quick and case == cases[0][0]:
      default_splits = default_num_splits("triton", b, hk, n)
      default_bs = kt.default_block_sizes(d, dtype)
      configs = [(bk, st, w, default_splits) for bk, st, w in (
          (32, 3, 4), (32, 4, 4), (64, 2, 4), (64, 3, 4), (64, 4, 4), (64, 3, 8), (128, 2, 4),
          (128, 3, 4), (128, 2, 8), (128, 3, 8), (256, 2, 4), (256, 2, 8))
          if (bk, st, w) != (default_bs.block_k, default_bs.num_stages, default_bs.num_warps)]
      configs += [(default_bs.block_k, default_bs.num_stages, default_bs.num_warps, s)
                  for s in (16, 64, 128) if s != default_splits]
      for bk, st, w, s in configs:
        bs = kt.DecodeBlockSizes(block_k=bk, num_stages=st, num_warps=w)
        f = jax.jit(functools.partial(decode_attention, implementation="triton", num_splits=s,
                                      block_sizes=bs, interpret=interpret))
        yield row(case, f"jattn_triton[bk{bk},st{st},w{w},sp{s}]", f, contiguous, ref, nbytes,
                  base_ms)
    del sets, contiguous
