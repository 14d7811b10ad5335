"""``flash_attention``: one public entry point, explicit dispatch over implementations.

Implementations:
  * ``"xla"``: pure jnp (materialises the logits; the reference semantics, any platform).
  * ``"triton"``: portable Pallas GPU kernel (Triton lowering); forward and backward walk the
    mask's block schedule, so masked tiles are skipped.
  * ``"mosaic_tpu"``: Pallas Mosaic TPU kernel with the same schedule.
  * ``"mosaic_gpu"``: Hopper (sm90) path: the Pallas Mosaic GPU forward of
    ``pallas_kernels.flash.mosaic_gpu`` (FA3-style: TMA, wgmma, warp specialisation, ping-pong)
    and, by default, the Mosaic GPU backward (``mosaic_gpu_bwd``) where it supports the call
    (head_dim 64/128, any mask: dense or causal, local windows, soft cap, segment ids);
    otherwise (head_dim 256) the Triton backward kernels fed the forward's out and LSE. Dense
    or causal, local windows, segment ids, soft cap, GQA, bf16/fp16, head_dim 64/128/256; other dtypes or head dims and
    ``interpret=True`` raise NotImplementedError naming the option (no fallback).
    GPU-verified on an H200 (runs 17-22, 2026-11-30: every case of tests/test_flash_mosaic_gpu.py
    passed). Run 21 (B2 S16K H16 D128 bf16, one process): forward 586 / 604 TFLOP/s non-causal /
    causal (cuDNN 617 / 573, jattn triton 418 / 409); forward+backward 30.5 / 15.5 ms (cuDNN
    27.6 / 14.3, jattn triton 46.9 / 22.6).
  * ``"cudnn"``: pass-through to ``jax.nn.dot_product_attention(implementation="cudnn")`` for
    the masks it supports (causal, local window); anything else raises ValueError.
  * ``None``: on a Hopper GPU (compute capability 9.0) "mosaic_gpu" for the calls of the Hopper
    default (bf16/fp16, head_dim 128 = head_dim_v, not interpret), "triton" for other GPU calls,
    "mosaic_tpu" on TPU, "xla" on CPU. ``flash_attention_plan`` reports the forward and backward
    kernels a call runs; ``resolve_implementation`` the platform default.

``interpret=True`` runs a Pallas implementation on the CPU (tests); it is ignored by "xla".
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jattn import _validate
from pallas_kernels import compat
from pallas_kernels.block_schedule import make_schedule
from pallas_kernels.flash.reference import attention_reference
from pallas_kernels.masks import normalize_window


def resolve_implementation(implementation=None, *, platform=None, interpret=False):
  """The platform's implementation for ``implementation=None`` (or the name given).

  Args:
    implementation: None or an implementation name.
    platform: "cpu", "gpu" or "tpu"; default: jax's default backend.
    interpret: whether a Pallas kernel would run in interpret mode.

  ``None`` gives "triton" on GPU, "mosaic_tpu" on TPU and "xla" on CPU. This is the answer for
  every op except ``flash_attention`` on a Hopper GPU, which refines a GPU ``None`` per call (the
  Mosaic GPU path for the calls it is measured and tested on): ask ``flash_attention_plan`` for
  the kernels a given call runs.

  Returns:
    The implementation name (no silent fallback: a named implementation is returned unchanged).

  Example:
    >>> resolve_implementation("xla")
    'xla'
    >>> resolve_implementation(None, platform="gpu")
    'triton'
  """
  _validate.check_implementation(implementation)
  if implementation is not None:
    return implementation
  platform = platform or compat.default_backend()
  if platform == "gpu":
    return "triton"
  if platform == "tpu":
    return "mosaic_tpu"
  return "xla"


# Head dims for which ``implementation=None`` picks the Hopper path on sm90: measured faster than
# the Triton kernels there (H200, B2 S16K H16 bf16, non-causal / causal). D128 (run 21): forward
# 1.40x / 1.47x, forward+backward 1.54x / 1.46x. D64 (run 26): forward 1.16x / 1.19x,
# forward+backward (Mosaic backward) 1.20x / 1.20x. D256 (run 26): forward 2.84x / 2.65x,
# forward+backward 1.11x / 1.11x (the Triton backward on both paths: the Mosaic one does not fit
# D256's registers). Results: experiments/results/h200_flash_anchors_d64_128_256_run26_20261130.json.
_HOPPER_DEFAULT_HEAD_DIMS = (64, 128, 256)
_MOSAIC_GPU_BWD_HEAD_DIMS = (64, 128)   # mosaic_gpu_bwd: D256 does not fit its registers


def _shape_dtype(x):
  return tuple(x.shape), jnp.dtype(x.dtype)


def _hopper_default_covers(q, k, v):
  (qs, qd), (ks, kd), (vs, vd) = map(_shape_dtype, (q, k, v))
  return (qd == kd == vd and qd in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
          and qs[-1] in _HOPPER_DEFAULT_HEAD_DIMS and vs[-1] == qs[-1])


def _mosaic_backward(q, *, window, segment_ids, logits_soft_cap, block_sizes):
  """"mosaic" or "triton": the backward of the mosaic_gpu path for a call."""
  if block_sizes is not None:
    return getattr(block_sizes, "backward", "triton")
  # Windows, soft cap and segment ids since session 26 (run 109, B2 S16K H16 D128 bf16 causal:
  # window 512 fwd+bwd 1.583 ms against 2.080 with the Triton backward and cuDNN's 1.712; soft
  # cap 30 18.61 against 28.27 ms; segment ids: see docs/kernels.md, session 26).
  return "mosaic" if q.shape[-1] in _MOSAIC_GPU_BWD_HEAD_DIMS else "triton"


def flash_attention_plan(q, k, v, *, local_window_size=None, segment_ids=None,
                         logits_soft_cap=None, implementation=None, interpret=False,
                         block_sizes=None, platform=None, compute_capability=None):
  """The kernels ``flash_attention`` runs for a call: which implementation, which backward.

  Args:
    q, k, v: the call's arrays, or ``jax.ShapeDtypeStruct`` of them.
    local_window_size, segment_ids, logits_soft_cap, implementation, interpret, block_sizes:
      as for ``flash_attention`` (only whether a mask is present matters here).
    platform: "cpu", "gpu" or "tpu"; default: jax's default backend.
    compute_capability: (major, minor) of the GPU; default: that of the first GPU.

  ``implementation=None`` on a GPU of compute capability 9.0 (H100/H200) picks "mosaic_gpu"
  when q, k and v are all bf16 or all fp16 with head_dim 64, 128 or 256 (= head_dim_v) and
  interpret is off (and ``block_sizes`` is None or a Mosaic GPU ``BlockSizes``); any other GPU
  call picks "triton" (a Triton ``BlockSizes`` keeps it there). On the "mosaic_gpu" path the
  backward is the Mosaic GPU one for head_dim 64/128
  (unless ``block_sizes`` says otherwise), the Triton one otherwise (head_dim 256 included).

  Returns:
    A dict: ``implementation`` (the name ``flash_attention`` dispatches on) and ``backward``
    ("mosaic_gpu", "triton", "mosaic_tpu", "cudnn" or "xla": the kernels of the VJP).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> x = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16)
    >>> flash_attention_plan(x, x, x, platform="gpu", compute_capability=(9, 0))
    {'implementation': 'mosaic_gpu', 'backward': 'mosaic_gpu'}
    >>> flash_attention_plan(x, x, x, platform="gpu", compute_capability=(8, 0))
    {'implementation': 'triton', 'backward': 'triton'}
  """
  impl = resolve_implementation(implementation, platform=platform, interpret=interpret)
  if implementation is None and impl == "triton" and not interpret:
    cc = compute_capability if compute_capability is not None else compat.gpu_compute_capability()
    hopper_sizes = block_sizes is None or (type(block_sizes).__module__
                                           == "pallas_kernels.flash.mosaic_gpu")
    if (cc is not None and tuple(cc) == (9, 0) and hopper_sizes
        and _hopper_default_covers(q, k, v)):
      impl = "mosaic_gpu"
  backward = impl
  if impl == "mosaic_gpu":
    bwd = _mosaic_backward(q, window=normalize_window(local_window_size), segment_ids=segment_ids,
                           logits_soft_cap=logits_soft_cap, block_sizes=block_sizes)
    backward = "mosaic_gpu" if bwd == "mosaic" else "triton"
  return {"implementation": impl, "backward": backward}


def kernel_module(implementation):
  """The pallas_kernels module behind a Pallas implementation name.

  Args:
    implementation: "triton", "mosaic_tpu" or "mosaic_gpu".

  Returns:
    The module (``flash_attention``, ``default_block_sizes``, ``BlockSizes``).

  Raises:
    ValueError: for a name that is not a Pallas implementation.

  Example:
    >>> kernel_module("triton").__name__
    'pallas_kernels.flash.triton'
  """
  if implementation == "triton":
    from pallas_kernels.flash import triton as mod
  elif implementation == "mosaic_tpu":
    from pallas_kernels.flash import mosaic_tpu as mod
  elif implementation == "mosaic_gpu":
    from pallas_kernels.flash import mosaic_gpu as mod
  else:
    raise ValueError(f"{implementation!r} is not a Pallas implementation")
  return mod


def _cudnn(q, k, v, *, causal, window, segment_ids, scale, logits_soft_cap, return_lse):
  problems = []
  if segment_ids is not None:
    problems.append("segment ids (jax.nn's cuDNN path has none)")
  if logits_soft_cap is not None:
    problems.append("logits_soft_cap")
  if return_lse:
    problems.append("return_lse")
  if window is not None and (window[0] is None or window[1] is None):
    problems.append("a window unbounded on one side")
  if causal and q.shape[1] != k.shape[1]:
    problems.append("causal with q_len != kv_len (jax.nn aligns top-left)")
  if problems:
    raise ValueError("implementation='cudnn' does not support: " + ", ".join(problems))
  return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                      local_window_size=window, implementation="cudnn")


_MOSAIC_GPU_HEAD_DIMS = (64, 128, 256)


def _mosaic_gpu_default_block_sizes(q, *, causal, window, segment_ids=None, logits_soft_cap=None,
                                    k_shape=None):
  """The Mosaic GPU ``BlockSizes`` of ``implementation="mosaic_gpu"`` with ``block_sizes=None``:
  the device table's tiles for the call's mask kind (``tuning.mask_kind``: causal, window,
  segment ids), fitted to the call by ``fit_block_sizes`` (``tail_kv_splits`` only where it
  pays for these shapes, ``k_shape``: default q's; one query tile per program with segment
  ids), and the backward ``_mosaic_backward`` picks (window:
  normalized (left, right) or None)."""
  from pallas_kernels.tuning import mask_kind   # tiles tuned per mask kind where measured
  bwd = _mosaic_backward(q, window=window, segment_ids=segment_ids,
                         logits_soft_cap=logits_soft_cap, block_sizes=None)
  kind = mask_kind(causal, window, segments=segment_ids is not None)
  mod = kernel_module("mosaic_gpu")
  bs = mod.default_block_sizes(q.shape[-1], q.dtype, mask=kind)
  bs = mod.fit_block_sizes(bs, q.shape, q.shape if k_shape is None else k_shape,
                           causal=causal, window=window, segments=segment_ids is not None)
  return dataclasses.replace(bs, backward=bwd)


def _mosaic_gpu(q, k, v, *, causal, window, segment_ids, kv_segment_ids, scale, logits_soft_cap,
                interpret, block_sizes):
  """The Hopper path: Mosaic GPU forward; backward by ``_mosaic_backward`` (Mosaic GPU for
  head_dim 64/128, Triton otherwise, or as ``block_sizes.backward`` says: the
  kernel module raises for masks the Mosaic backward lacks). Local windows, segment ids and soft
  cap are supported; rejects, naming them, the options it does not support (no fallback to
  another implementation)."""
  problems = []
  if q.shape[-1] not in _MOSAIC_GPU_HEAD_DIMS:
    problems.append(f"head_dim {q.shape[-1]} (supported: 64, 128, 256)")
  if v.shape[-1] != q.shape[-1]:
    problems.append(f"head_dim_v {v.shape[-1]} != head_dim {q.shape[-1]}")
  dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
  if not dtypes <= {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)} or len(dtypes) > 1:
    problems.append(f"dtype {'/'.join(sorted(d.name for d in dtypes))} (supported: one of "
                    f"bfloat16, float16 for q, k and v)")
  if problems:
    raise NotImplementedError("implementation='mosaic_gpu' does not support: "
                              + ", ".join(problems) + "; use implementation='triton'")
  mod = kernel_module("mosaic_gpu")
  if block_sizes is not None and not isinstance(block_sizes, mod.BlockSizes):
    raise TypeError(f"implementation='mosaic_gpu' takes block_sizes of type "
                    f"pallas_kernels.flash.mosaic_gpu.BlockSizes, got {type(block_sizes)}")
  if block_sizes is None:
    block_sizes = _mosaic_gpu_default_block_sizes(q, causal=causal, window=window,
                                                  segment_ids=segment_ids,
                                                  logits_soft_cap=logits_soft_cap,
                                                  k_shape=k.shape)
  # interpret=True: the forward raises NotImplementedError (it cannot be interpreted); tests that
  # substitute the forward run the Triton backward in interpret mode.
  return mod.flash_attention(q, k, v, segment_ids, kv_segment_ids, causal=causal,
                             local_window_size=window, scale=scale,
                             logits_soft_cap=logits_soft_cap, block_sizes=block_sizes,
                             interpret=interpret)


def flash_attention(q, k, v, *, causal=False, local_window_size=None, segment_ids=None,
                    kv_segment_ids=None, scale=None, logits_soft_cap=None, return_lse=False,
                    implementation=None, interpret=False, block_sizes=None):
  """IO-aware multi-head attention (flash attention) with masks as block schedules.

  Args:
    q: [batch, q_len, q_heads, head_dim], fp32/bf16/fp16.
    k: [batch, kv_len, kv_heads, head_dim]; q_heads % kv_heads == 0 (GQA/MQA).
    v: [batch, kv_len, kv_heads, head_dim_v].
    causal: causal mask, aligned bottom-right when q_len != kv_len.
    local_window_size: None, int w (= (w, w)) or (left, right): query i sees key j iff
      i - left <= j <= i + right (jax.nn convention). A causal "window of 512" is (511, 0).
    segment_ids: None or int [batch, q_len]; query i sees key j only if the ids are equal and
      nonzero (0 = padding).
    kv_segment_ids: None or int [batch, kv_len]; defaults to segment_ids when q_len == kv_len.
    scale: logit scale, default 1/sqrt(head_dim).
    logits_soft_cap: None or cap > 0: logits = cap * tanh(logits / cap).
    return_lse: also return the log-sum-exp [batch, q_heads, q_len] (fp32, natural log, -inf for
      rows that see no key); differentiable.
    implementation: None, "xla", "triton", "mosaic_gpu", "mosaic_tpu" or "cudnn" (see the
      module docstring; ``flash_attention_plan`` says which kernels a call runs: None picks
      "mosaic_gpu" on Hopper for bf16/fp16 head_dim 128, "triton" on other GPU calls).
      "mosaic_gpu" (Hopper): Mosaic GPU forward, Mosaic GPU backward for head_dim 64/128,
      Triton backward for head_dim 256; any of the masks
      above, bf16/fp16, head_dim 64/128/256, head_dim_v == head_dim.
    interpret: run a Pallas kernel in interpret mode (CPU). "mosaic_gpu" raises
      NotImplementedError: its forward cannot be interpreted.
    block_sizes: optional kernel-specific ``BlockSizes`` override (Pallas implementations; for
      "mosaic_gpu" a ``pallas_kernels.flash.mosaic_gpu.BlockSizes``, whose ``backward`` field
      picks the backward kernels: "triton" or "mosaic").

  Returns:
    out [batch, q_len, q_heads, head_dim_v] in q.dtype, or (out, lse) if return_lse.

  Raises:
    NotImplementedError: an option the chosen implementation does not support (named in the
      message; there is no silent fallback to another implementation).

  Example:
    >>> import jax, jattn
    >>> q = jax.random.normal(jax.random.key(0), (2, 100, 4, 64))
    >>> k = jax.random.normal(jax.random.key(1), (2, 100, 2, 64))
    >>> out = jattn.flash_attention(q, k, k, causal=True, implementation="xla")
    >>> out.shape
    (2, 100, 4, 64)
  """
  batch, q_len, kv_len, _, _ = _validate.check_qkv(q, k, v)
  _validate.check_implementation(implementation)
  window = normalize_window(local_window_size)
  segment_ids, kv_segment_ids = _validate.check_segments(segment_ids, kv_segment_ids, batch,
                                                         q_len, kv_len)
  if logits_soft_cap is not None and not logits_soft_cap > 0:
    raise ValueError(f"logits_soft_cap must be > 0, got {logits_soft_cap}")
  if scale is None:
    scale = 1.0 / (q.shape[-1] ** 0.5)
  impl = flash_attention_plan(q, k, v, local_window_size=window, segment_ids=segment_ids,
                              logits_soft_cap=logits_soft_cap, implementation=implementation,
                              interpret=interpret, block_sizes=block_sizes)["implementation"]
  if impl == "cudnn":
    return _cudnn(q, k, v, causal=causal, window=window, segment_ids=segment_ids, scale=scale,
                  logits_soft_cap=logits_soft_cap, return_lse=return_lse)
  if impl == "mosaic_gpu":
    out, lse = _mosaic_gpu(q, k, v, causal=causal, window=window, segment_ids=segment_ids,
                           kv_segment_ids=kv_segment_ids, scale=scale,
                           logits_soft_cap=logits_soft_cap, interpret=interpret,
                           block_sizes=block_sizes)
  elif impl == "xla":
    out, lse = attention_reference(q, k, v, causal=causal, local_window_size=window,
                                   q_segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                                   scale=scale, logits_soft_cap=logits_soft_cap)
  else:
    mod = kernel_module(impl)
    bs = block_sizes or mod.default_block_sizes(q.shape[-1], q.dtype)
    mask = dict(causal=causal, local_window_size=window, q_segment_ids=segment_ids,
                kv_segment_ids=kv_segment_ids)
    schedule = make_schedule(q_len, kv_len, bs.block_q, bs.block_k, **mask)
    kwargs = {}
    if impl == "triton":
      # The Triton forward and backward may use different tiles: the backward walks its own
      # schedule of the same mask.
      kwargs["block_sizes"] = bs
      if bs.bwd_tiles != (bs.block_q, bs.block_k):
        kwargs["bwd_schedule"] = make_schedule(q_len, kv_len, *bs.bwd_tiles, **mask)
      if bs.dkv_tiles != bs.bwd_tiles:  # dK/dV walks its own (finer) q tiles
        kwargs["dkv_schedule"] = make_schedule(q_len, kv_len, *bs.dkv_tiles, **mask)
    out, lse = mod.flash_attention(q, k, v, segment_ids, kv_segment_ids, schedule, causal=causal,
                                   local_window_size=window, scale=scale,
                                   logits_soft_cap=logits_soft_cap, interpret=interpret, **kwargs)
  return (out, lse) if return_lse else out
