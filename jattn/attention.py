"""``flash_attention``: one public entry point, explicit dispatch over the implementations
"xla", "triton", "mosaic_tpu", "mosaic_gpu" and "cudnn" (docs/flash.md).

:func:`resolve` resolves flash and block-sparse calls to a :class:`jattn._plan.Plan`;
:func:`flash_attention_plan` returns it and :func:`flash_attention` runs exactly it.
"""
from __future__ import annotations

import dataclasses
import importlib
import types

import jax
import jax.numpy as jnp

from jattn._validate import (as_array, check_flags, check_implementation, check_qkv,
                             check_scale_and_cap, check_segments)
from jattn._plan import Plan
from pallas_kernels import tuning
from pallas_kernels.block_schedule import make_schedule, mask_tile_classes
from pallas_kernels.flash.reference import attention_reference
from pallas_kernels.masks import normalize_window

# The Hopper default covers the Mosaic GPU forward's head dims; its backward covers 64 and 128
# (at 256 the dK/dV accumulators exceed a thread's registers: the Triton backward runs).
MOSAIC_GPU_HEAD_DIMS = (64, 128, 256)
MOSAIC_GPU_BWD_HEAD_DIMS = (64, 128)
MASK_TILE = 128   # a mask uniform on tiles of this size runs on the Mosaic GPU kernels
_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def kernel_module(implementation):
  """The pallas_kernels module behind a Pallas implementation name.

  Args:
    implementation: "triton", "mosaic_tpu" or "mosaic_gpu" (else ValueError).

  Returns:
    The module (``flash_attention``, ``default_block_sizes``, ``BlockSizes``).

  Example:
    >>> kernel_module("triton").__name__
    'pallas_kernels.flash.triton'
  """
  if implementation not in ("triton", "mosaic_tpu", "mosaic_gpu"):
    raise ValueError(f"{implementation!r} is not a Pallas implementation")
  return importlib.import_module(f"pallas_kernels.flash.{implementation}")


def _mosaic_gpu_problems(q, k, v):
  """What of a call the Mosaic GPU forward does not support: a list of strings (empty: none)."""
  d, dtypes = q.shape[-1], {jnp.dtype(x.dtype) for x in (q, k, v)}
  return [msg for bad, msg in (
      (d not in MOSAIC_GPU_HEAD_DIMS, f"head_dim {d} (supported: 64, 128, 256)"),
      (v.shape[-1] != d, f"head_dim_v {v.shape[-1]} != head_dim {d}"),
      (len(dtypes) > 1 or not dtypes <= set(_HALF),
       f"dtype {'/'.join(sorted(t.name for t in dtypes))} (supported: bfloat16 or float16 for q, "
       f"k and v)"),
  ) if bad]


def _default_implementation(dev, q, k, v, *, interpret, block_sizes, tiles, arrays):
  if dev.platform != "gpu":
    return "mosaic_tpu" if dev.platform == "tpu" and not arrays else "xla"
  hopper = (not arrays   # mask / bias arrays: the Triton kernels read them
            and dev.sm90 and not interpret and not _mosaic_gpu_problems(q, k, v)
            and (block_sizes is None
                 or isinstance(block_sizes, kernel_module("mosaic_gpu").BlockSizes))
            and (tiles is None or all(t >= 64 and not t & (t - 1) for t in tiles)))
  return "mosaic_gpu" if hopper else "triton"


def _fit_to_tiles(impl, base, tiles):
  """``base`` with the selection's tiles (q_block_size, block_size), or a ValueError."""
  qbs, bs = tiles
  if impl == "triton":
    if bad := [f"{n}={x}" for n, x in (("q_block_size", qbs), ("block_size", bs))
               if x < 16 or x & (x - 1)]:
      raise ValueError(f"implementation='triton' needs powers of two >= 16 for the tiles, got "
                       f"{', '.join(bad)}; select blocks with such sizes (the kernel's default "
                       f"is q_block_size={base.block_q}, block_size={base.block_k}) or use "
                       f"implementation='xla'")
    # One tiling, the selection's blocks, for both passes; warps None: the launch heuristic for
    # these tiles. A longer key tile than the table's gets a shorter pipeline (shared memory).
    extra = dict(num_stages=2) if bs > base.block_k else {}
    return dataclasses.replace(base, block_q=qbs, block_k=bs, num_warps=None, bwd_num_warps=None,
                               bwd_block_q=None, bwd_block_k=None, dkv_block_q=None, **extra)
  if (base.block_q, base.block_k) == (qbs, bs):
    return base
  try:
    return dataclasses.replace(base, block_q=qbs, block_k=bs)
  except (ValueError, TypeError) as e:
    raise ValueError(
        f"implementation={impl!r} cannot run tiles of q_block_size={qbs}, block_size={bs} ({e}); "
        f"select blocks with sizes the kernel supports (its default is "
        f"q_block_size={base.block_q}, block_size={base.block_k}) or use "
        f"implementation='xla'") from None


def _resolve_mosaic_gpu(op, q, k, v, dev, *, causal, window, segments, tiles, block_sizes):
  from pallas_kernels.flash import mosaic_gpu_bwd as mgb
  from pallas_kernels.flash import triton as ft
  mod, d, dtype = kernel_module("mosaic_gpu"), q.shape[-1], q.dtype
  kind = tuning.mask_kind(causal, window, segments=segments)
  fwd = block_sizes
  if block_sizes is None:
    fwd = mod.default_block_sizes(d, dtype, device_kind=dev.kind, mask=kind)
    if tiles is not None:
      if bad := [f"{n}={x}" for n, x in zip(("q_block_size", "block_size"), tiles)
                 if x < 64 or x & (x - 1)]:
        raise ValueError(
            f"implementation='mosaic_gpu' needs q_block_size and block_size powers of two >= 64 "
            f"(its tiles are {fwd.block_q} query rows per warpgroup and up to {fwd.block_k} "
            f"keys), got {', '.join(bad)}; select blocks with such sizes (e.g. "
            f"q_block_size=128, block_size=64) or use implementation='triton' or 'xla'")
    fwd = mod.fit_block_sizes(fwd, q.shape, k.shape, causal=causal, window=window,
                              segments=segments, schedule=tiles is not None,
                              core_count=dev.core_count)
    if tiles is not None:   # every kernel tile inside one selection block
      fwd = dataclasses.replace(fwd, block_k=min(fwd.block_k, 128, tiles[1]))
    fwd = dataclasses.replace(fwd, backward="mosaic" if d in MOSAIC_GPU_BWD_HEAD_DIMS else "triton")
  bwd = "mosaic_gpu" if getattr(fwd, "backward", "triton") == "mosaic" else "triton"
  if bwd == "mosaic_gpu":
    bwd_cfg = mgb.default_block_sizes(d, dtype, device_kind=dev.kind,
                                      mask=kind if tiles is None else "block_sparse")
    if tiles is not None:   # the fit reads the schedule's tiles only
      bwd_cfg = mgb.fit_block_sizes(bwd_cfg, types.SimpleNamespace(block_q=tiles[0],
                                                                    block_k=tiles[1]))
  else:
    bwd_cfg = ft.default_block_sizes(max(d, v.shape[-1]), dtype, device_kind=dev.kind)
    if tiles is not None:
      bwd_cfg = _fit_to_tiles("triton", bwd_cfg, tiles)
  return Plan(op, "mosaic_gpu", fwd, bwd, bwd_cfg, dev.table, dev.kind)


def resolve(op, q, k, v, *, causal=False, window=None, segments=False, tiles=None,
            implementation=None, block_sizes=None, interpret=False, platform=None,
            device_kind=None, arrays=None) -> Plan:
  """The plan of one call (behind :func:`flash_attention_plan` and ``jattn.block_sparse_plan``):
  implementation, then configs (explicit, table, heuristic, fit).

  Args:
    op: "flash" or "block_sparse".
    q, k, v: the call's arrays or ``jax.ShapeDtypeStruct`` of them.
    causal, window, segments: the causal flag, normalized window, whether it has segment ids.
    tiles: None, or a block-sparse call's (q_block_size, block_size), fitted to by the configs.
    implementation, block_sizes: None, or a name and the kernel's ``BlockSizes`` (used as given).
    interpret: whether a Pallas kernel runs in interpret mode (keeps ``None`` off Mosaic GPU).
    platform, device_kind: another device than the current one (``tuning.device``).
    arrays: None, "mask" or "bias": only "xla" and "triton" take them (a mask on Hopper: a
      "mosaic_gpu" plan whose ``fallback`` is "triton").

  Returns:
    A :class:`jattn._plan.Plan`.

  Example:
    >>> x = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.float32)
    >>> p = resolve("flash", x, x, x, causal=True, platform="cpu")
    >>> p.implementation, p.config, p.backward
    ('xla', None, 'xla')
  """
  check_implementation(implementation)
  if platform not in (None, "cpu", "gpu", "tpu"):
    raise ValueError(f"platform must be None, 'cpu', 'gpu' or 'tpu', got {platform!r}")
  if device_kind is not None and not isinstance(device_kind, str):
    raise TypeError(f"device_kind must be None or a jax device_kind string such as "
                    f"'NVIDIA H200', got {device_kind!r}")
  dev = tuning.device(platform, device_kind)
  impl = implementation or _default_implementation(dev, q, k, v, interpret=interpret,
                                                   block_sizes=block_sizes, tiles=tiles,
                                                   arrays=arrays)
  if arrays and impl not in ("xla", "triton"):
    raise ValueError(f"implementation={impl!r} does not support mask or bias arrays; use "
                     f"implementation='triton' (GPU) or 'xla'")
  if impl in ("xla", "cudnn"):
    return Plan(op, impl, backward=impl, device_kind=dev.kind)
  mod = kernel_module(impl)
  if impl == "mosaic_gpu" and (problems := _mosaic_gpu_problems(q, k, v)):
    raise NotImplementedError("implementation='mosaic_gpu' does not support: "
                              + ", ".join(problems) + "; use implementation='triton'")
  if block_sizes is not None and not isinstance(block_sizes, mod.BlockSizes):
    raise TypeError(f"implementation={impl!r} takes block_sizes of type {mod.__name__}"
                    f".BlockSizes, got {type(block_sizes)}")
  mask_only = (arrays == "mask" and implementation is None and block_sizes is None
               and tiles is None and q.shape[-1] in MOSAIC_GPU_BWD_HEAD_DIMS)
  if mask_only and _default_implementation(dev, q, k, v, interpret=interpret, block_sizes=None,
                                           tiles=None, arrays=False) == "mosaic_gpu":
    # decided on device: Mosaic GPU where the mask is uniform on every tile, else this plan
    return dataclasses.replace(
        _resolve_mosaic_gpu(op, q, k, v, dev, causal=causal, window=window, segments=segments,
                            tiles=(MASK_TILE, MASK_TILE), block_sizes=None),
        fallback=resolve(op, q, k, v, causal=causal, window=window, segments=segments,
                         implementation="triton", interpret=interpret, platform=platform,
                         device_kind=device_kind, arrays=arrays))
  if impl == "mosaic_gpu":
    return _resolve_mosaic_gpu(op, q, k, v, dev, causal=causal, window=window,
                               segments=segments, tiles=tiles, block_sizes=block_sizes)
  cfg, table = block_sizes, None
  if block_sizes is None and impl == "triton":
    cfg, table = mod.default_block_sizes(q.shape[-1], q.dtype, device_kind=dev.kind), dev.table
  elif block_sizes is None:   # mosaic_tpu: a heuristic, no table
    cfg = mod.default_block_sizes(q.shape[-1], q.dtype)
  if tiles is not None:
    cfg = _fit_to_tiles(impl, cfg, tiles)
  return Plan(op, impl, cfg, impl, cfg, table, dev.kind)   # one BlockSizes: both passes


def flash_attention_plan(q, k, v, *, causal=False, local_window_size=None, segment_ids=None,
                         kv_segment_ids=None, scale=None, logits_soft_cap=None, return_lse=False,
                         implementation=None, interpret=False, block_sizes=None, mask=None,
                         bias=None, platform=None, device_kind=None) -> Plan:
  """What ``flash_attention`` runs for a call: implementation and forward/backward configs.

  Args:
    q, k, v: the call's arrays, or ``jax.ShapeDtypeStruct`` of them.
    causal, local_window_size, segment_ids, kv_segment_ids, scale, logits_soft_cap, return_lse,
      implementation, interpret, block_sizes, mask, bias: as for :func:`flash_attention`
      (``scale``, ``logits_soft_cap`` and ``return_lse`` are validated, change no choice).
    platform: "cpu", "gpu" or "tpu"; default: jax's default backend (or ``device_kind``'s).
    device_kind: a jax ``device_kind`` to plan for, e.g. "NVIDIA H200"; default: the current.

  Returns:
    A :class:`jattn._plan.Plan` (implementation, configs, backward, table, device kind).

  Example:
    >>> x = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16)
    >>> p = flash_attention_plan(x, x, x, causal=True, device_kind="NVIDIA H200")
    >>> p.implementation, p.backward, p.table
    ('mosaic_gpu', 'mosaic_gpu', 'nvidia_h200.json')
  """
  batch, q_len, kv_len, _, _ = check_qkv(q, k, v)
  check_segments(segment_ids, kv_segment_ids, batch, q_len, kv_len)
  check_scale_and_cap(scale, logits_soft_cap)
  check_flags(causal=causal, return_lse=return_lse, interpret=interpret)
  for name, x in (("mask", mask), ("bias", bias)):
    broadcast_mask_or_bias(name, x, (batch, q.shape[2], q_len, kv_len))
  return resolve("flash", q, k, v, causal=causal, window=normalize_window(local_window_size),
                 segments=segment_ids is not None, implementation=implementation,
                 block_sizes=block_sizes, interpret=interpret, platform=platform,
                 device_kind=device_kind,
                 arrays="bias" if bias is not None else "mask" if mask is not None else None)


def _cudnn(q, k, v, *, causal, window, segment_ids, scale, logits_soft_cap, return_lse):
  problems = [msg for bad, msg in (
      (q.dtype not in _HALF, f"dtype {q.dtype} (cuDNN runs bfloat16 and float16)"),
      (segment_ids is not None, "segment ids (jax.nn's cuDNN path has none)"),
      (logits_soft_cap is not None, "logits_soft_cap"),
      (return_lse, "return_lse"),
      (window is not None and None in window, "a window unbounded on one side"),
      (causal and q.shape[1] != k.shape[1], "causal with q_len != kv_len (jax.nn aligns top-left)"),
  ) if bad]
  if problems:
    raise ValueError("implementation='cudnn' does not support: " + ", ".join(problems))
  return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                      local_window_size=window, implementation="cudnn")


def flash_attention(q, k, v, *, causal=False, local_window_size=None, segment_ids=None,
                    kv_segment_ids=None, scale=None, logits_soft_cap=None, return_lse=False,
                    implementation=None, interpret=False, block_sizes=None, mask=None,
                    bias=None):
  """IO-aware multi-head attention (flash attention) with masks as block schedules.

  Masked keys never leak: NaN or inf at a key a row cannot see changes nothing in it (the
  "mosaic_gpu" exception: docs/flash.md).

  Args:
    q: [batch, q_len, q_heads, head_dim], fp32/bf16/fp16.
    k, v: [batch, kv_len, kv_heads, head_dim(_v)]; q_heads % kv_heads == 0 (GQA/MQA).
    causal: causal mask, aligned bottom-right when q_len != kv_len.
    local_window_size: None, int w or (left, right): i - left <= j <= i + right (jax.nn).
    segment_ids: None or int [batch, q_len]; equal nonzero ids attend (0 = padding).
    kv_segment_ids: None or int [batch, kv_len]; defaults to segment_ids when q_len == kv_len.
    scale: logit scale, default 1/sqrt(head_dim).
    logits_soft_cap: None or cap > 0: logits = cap * tanh(logits / cap).
    return_lse: also return the log-sum-exp [batch, q_heads, q_len] (fp32, natural log).
    implementation: None (:func:`flash_attention_plan`) or a name of the module doc.
    interpret: run a Pallas kernel in interpret mode (CPU; not "mosaic_gpu").
    block_sizes: optional ``BlockSizes`` of the implementation's kernel module.
    mask: None or bool, 4-D, broadcastable to [batch, q_heads, q_len, kv_len] (each axis 1 or
      full), True where a query may see a key, combined with the masks above; "xla" and
      "triton" only (on Hopper, masks uniform on 128 x 128 tiles run "mosaic_gpu": docs/flash.md).
    bias: None or float, 4-D, broadcastable like ``mask``: added to the (soft-capped) logits
      before the softmax; differentiable; "xla" and "triton" only.

  Returns:
    out [batch, q_len, q_heads, head_dim_v] in q.dtype, or (out, lse) if return_lse.

  Example:
    >>> q, k = jnp.ones((2, 100, 4, 64)), jnp.ones((2, 100, 2, 64))
    >>> flash_attention(q, k, k, causal=True, implementation="xla").shape
    (2, 100, 4, 64)
  """
  batch, q_len, kv_len, _, _ = check_qkv(q, k, v)
  window = normalize_window(local_window_size)
  segment_ids, kv_segment_ids = check_segments(segment_ids, kv_segment_ids, batch, q_len, kv_len)
  scale, logits_soft_cap = check_scale_and_cap(scale, logits_soft_cap, head_dim=q.shape[-1])
  mask = broadcast_mask_or_bias("mask", mask, (batch, q.shape[2], q_len, kv_len))
  bias = broadcast_mask_or_bias("bias", bias, (batch, q.shape[2], q_len, kv_len))
  plan = flash_attention_plan(q, k, v, causal=causal, local_window_size=window,
                              segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                              return_lse=return_lse, implementation=implementation,
                              interpret=interpret, block_sizes=block_sizes, mask=mask, bias=bias)
  kw = dict(causal=causal, window=window, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
            scale=scale, logits_soft_cap=logits_soft_cap, interpret=interpret)
  out, lse = (_run(plan, q, k, v, mask, bias, return_lse=return_lse, **kw) if plan.fallback is None
              else _run_mask_tiles(plan, q, k, v, mask, **kw))
  return (out, lse) if return_lse else out


def _per_kv_head(mask, k):
  """``mask`` as the schedules read it: [B|1, Hk, G, Sq, Sk] if G > 1 heads share a kv head."""
  g = mask.shape[1] // k.shape[2]   # 0 for a mask shared by every head
  return mask.reshape(mask.shape[0], k.shape[2], g, *mask.shape[2:]) if g > 1 else mask


def _run_mask_tiles(plan, q, k, v, mask, **kw):
  """(out, lse) of a Hopper mask plan: Mosaic GPU on the mask's visible tiles if it is uniform
  on every tile (checked on device), else its fallback (``kw``: :func:`_run`'s)."""
  any_, all_ = mask_tile_classes(_per_kv_head(mask, k), MASK_TILE, MASK_TILE)
  seg, kv_seg, window = kw["segment_ids"], kw["kv_segment_ids"], kw["window"]

  def tiles(q, k, v):
    schedule = make_schedule(q.shape[1], k.shape[1], MASK_TILE, MASK_TILE, causal=kw["causal"],
                             local_window_size=window, q_segment_ids=seg, kv_segment_ids=kv_seg,
                             block_mask=any_)
    return kernel_module("mosaic_gpu").flash_attention(
        q, k, v, seg, kv_seg, schedule, causal=kw["causal"], local_window_size=window,
        scale=kw["scale"], logits_soft_cap=kw["logits_soft_cap"], block_sizes=plan.config,
        bwd_block_sizes=plan.backward_config)

  elements = lambda q, k, v: _run(plan.fallback, q, k, v, mask, None, return_lse=True, **kw)
  return jax.lax.cond(jnp.all(any_ == all_), tiles, elements, q, k, v)


def _run(plan, q, k, v, mask_arr, bias, *, causal, window, segment_ids, kv_segment_ids, scale,
         logits_soft_cap, interpret, return_lse):
  """(out, lse) of ``plan`` for validated inputs (lse None where cuDNN returns none)."""
  impl, bs, q_len, kv_len = plan.implementation, plan.config, q.shape[1], k.shape[1]
  mask = dict(causal=causal, local_window_size=window)
  if impl == "cudnn":
    return _cudnn(q, k, v, causal=causal, window=window, segment_ids=segment_ids, scale=scale,
                  logits_soft_cap=logits_soft_cap, return_lse=return_lse), None
  if impl == "xla":
    return attention_reference(q, k, v, q_segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                               scale=scale, logits_soft_cap=logits_soft_cap, block_mask=mask_arr,
                               bias=bias, **mask)
  if impl == "mosaic_gpu":
    # interpret=True: the forward raises NotImplementedError (it cannot be interpreted)
    return kernel_module(impl).flash_attention(
        q, k, v, segment_ids, kv_segment_ids, scale=scale, logits_soft_cap=logits_soft_cap,
        block_sizes=bs, bwd_block_sizes=plan.backward_config, interpret=interpret, **mask)
  mask.update(q_segment_ids=segment_ids, kv_segment_ids=kv_segment_ids)
  kwargs = {} if bias is None else {"bias": bias}
  if mask_arr is not None:
    mask["mask"], kwargs["mask"] = _per_kv_head(mask_arr, k), mask_arr
  schedule = make_schedule(q_len, kv_len, bs.block_q, bs.block_k, **mask)
  if impl == "triton":   # the backward walks its own schedules of the same mask
    kwargs["block_sizes"] = bs
    if bs.bwd_tiles != (bs.block_q, bs.block_k):
      kwargs["bwd_schedule"] = make_schedule(q_len, kv_len, *bs.bwd_tiles, **mask)
    if bs.dkv_tiles != bs.bwd_tiles:
      kwargs["dkv_schedule"] = make_schedule(q_len, kv_len, *bs.dkv_tiles, **mask)
  return kernel_module(impl).flash_attention(
      q, k, v, segment_ids, kv_segment_ids, schedule, causal=causal, local_window_size=window,
      scale=scale, logits_soft_cap=logits_soft_cap, interpret=interpret, **kwargs)


def broadcast_mask_or_bias(name, x, full):
  """Check a ``mask`` or ``bias`` array and broadcast its sequence axes.

  Args:
    name: "mask" (bool) or "bias" (float).
    x, full: None or a 4-D array whose axes are each 1 or the matching entry of ``full`` =
      (batch, q_heads, q_len, kv_len).

  Returns:
    None, or ``x`` broadcast to [1 | batch, 1 | q_heads, q_len, kv_len].

  Raises:
    TypeError: for a mask that is not bool or a bias that is not float.
    ValueError: for another shape.

  Example:
    >>> broadcast_mask_or_bias("mask", jnp.ones((2, 1, 1, 8), bool), (2, 4, 6, 8)).shape
    (2, 1, 6, 8)
  """
  if x is None:
    return None
  x = as_array(name, x)
  if name == "mask" and x.dtype != jnp.bool_:
    raise TypeError(f"mask must be a bool array (True: visible), got {x.dtype}")
  if name == "bias" and not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"bias must be a float array, got {x.dtype}")
  if x.ndim != 4 or any(n not in (1, f) for n, f in zip(x.shape, full)):
    raise ValueError(f"{name} must be 4-D and broadcastable to [batch, q_heads, q_len, kv_len] "
                     f"= {full} (each axis 1 or full), got shape {x.shape}")
  if isinstance(x, jax.ShapeDtypeStruct):   # a plan's check: shapes only
    return x
  return jnp.broadcast_to(x, x.shape[:2] + tuple(full[2:]))
