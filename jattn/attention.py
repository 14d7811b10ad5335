"""``flash_attention``: one public entry point, explicit dispatch over implementations.

Implementations:
  * ``"xla"``: pure jnp (materialises the logits; the reference semantics, any platform).
  * ``"triton"``: portable Pallas GPU kernel (Triton lowering); forward and backward walk the
    mask's block schedule, so masked tiles are skipped.
  * ``"mosaic_tpu"``: Pallas Mosaic TPU kernel with the same schedule.
  * ``"mosaic_gpu"``: Hopper path, not available yet (raises NotImplementedError): a forward-only
    kernel exists in ``pallas_kernels.flash.mosaic_gpu`` but has not run on a GPU.
  * ``"cudnn"``: pass-through to ``jax.nn.dot_product_attention(implementation="cudnn")`` for
    the masks it supports (causal, local window); anything else raises ValueError.
  * ``None``: "triton" on GPU, "mosaic_tpu" on TPU, "xla" on CPU (see ``resolve_implementation``).

``interpret=True`` runs a Pallas implementation on the CPU (tests); it is ignored by "xla".
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jattn import _validate
from pallas_kernels import compat
from pallas_kernels.block_schedule import make_schedule
from pallas_kernels.flash.reference import attention_reference
from pallas_kernels.masks import normalize_window


def resolve_implementation(implementation=None, *, platform=None, interpret=False):
  """The implementation ``flash_attention`` runs for a given request.

  Args:
    implementation: None or an implementation name.
    platform: "cpu", "gpu" or "tpu"; default: jax's default backend.
    interpret: whether a Pallas kernel would run in interpret mode.

  Returns:
    The implementation name that will run (no silent fallback: a named implementation is
    returned unchanged).

  Example:
    >>> resolve_implementation("xla")
    'xla'
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


def kernel_module(implementation):
  """The pallas_kernels module behind a Pallas implementation name.

  Args:
    implementation: "triton", "mosaic_tpu" or "mosaic_gpu".

  Returns:
    The module (``flash_attention``, ``default_block_sizes``, ``BlockSizes``).

  Raises:
    NotImplementedError: for "mosaic_gpu" (its forward exists but is not yet verified on a GPU).
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
    raise NotImplementedError(
        "implementation='mosaic_gpu' (the Hopper path) is not available yet: a forward-only "
        "kernel (pallas_kernels.flash.mosaic_gpu, no schedules or backward) has not been "
        "verified on a GPU; use 'triton' or 'cudnn' on GPU")
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
    implementation: None, "xla", "triton", "mosaic_gpu", "mosaic_tpu" or "cudnn".
    interpret: run a Pallas kernel in interpret mode (CPU).
    block_sizes: optional kernel-specific ``BlockSizes`` override (Pallas implementations).

  Returns:
    out [batch, q_len, q_heads, head_dim_v] in q.dtype, or (out, lse) if return_lse.

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
  impl = resolve_implementation(implementation, interpret=interpret)
  if impl == "cudnn":
    return _cudnn(q, k, v, causal=causal, window=window, segment_ids=segment_ids, scale=scale,
                  logits_soft_cap=logits_soft_cap, return_lse=return_lse)
  if impl == "xla":
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
    out, lse = mod.flash_attention(q, k, v, segment_ids, kv_segment_ids, schedule, causal=causal,
                                   local_window_size=window, scale=scale,
                                   logits_soft_cap=logits_soft_cap, interpret=interpret, **kwargs)
  return (out, lse) if return_lse else out
