"""Attention restricted to a :class:`~jattn.sparse.selection.BlockSelection`, and selection plus
attention with gate gradients in one call (:func:`sparse_attention`)."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jattn._validate import (check_flags, check_number, check_qkv, check_scale_and_cap,
                             check_segments)
from jattn._plan import Plan
from jattn.attention import kernel_module, resolve
from pallas_kernels.block_schedule import make_schedule
from pallas_kernels.common.util import pad_axis
from pallas_kernels.flash.reference import attention_reference
from jattn.sparse.metrics import _QUERY_POOLS, _score_kl_of, add_aux_loss
from jattn.sparse.selection import (_HIGHEST, block_scores, cdiv, check_selection,
                                    check_selection_args, segment_rules, select_lists)

__all__ = ["block_sparse_plan", "block_sparse_attention", "sparse_attention"]


_GATE_MODES = ("none", "ste", "gumbel")


def block_sparse_plan(q, k, v, selection=None, *, q_block_size=None, block_size=None, causal=True,
                      segment_ids=None, kv_segment_ids=None, scale=None, return_lse=False,
                      implementation=None, interpret=False, platform=None,
                      device_kind=None) -> Plan:
  """What ``block_sparse_attention`` (and ``sparse_attention``) runs for a call.

  ``implementation=None`` picks "mosaic_gpu" on Hopper where it applies (bf16/fp16, head_dim
  64/128/256, tiles powers of two >= 64), else "triton" on GPU, "mosaic_tpu" on TPU, "xla".

  Args:
    q, k, v: the call's arrays, or ``jax.ShapeDtypeStruct`` of them.
    selection, q_block_size, block_size: the call's :class:`BlockSelection`, or None and its
      two block sizes.
    causal, segment_ids, kv_segment_ids, scale, return_lse, implementation, interpret: as for
      :func:`block_sparse_attention` (``scale`` and ``return_lse`` change no choice).
    platform, device_kind: plan for another device (as for ``jattn.flash_attention_plan``).

  Returns:
    A :class:`jattn._plan.Plan` with ``op="block_sparse"``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> x = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16)
    >>> p = block_sparse_plan(x, x, x, q_block_size=128, block_size=64, device_kind="NVIDIA H200")
    >>> p.implementation, p.backward, p.config.block_k
    ('mosaic_gpu', 'mosaic_gpu', 64)
  """
  batch, q_len, kv_len, _, hk = check_qkv(q, k, v)
  check_segments(segment_ids, kv_segment_ids, batch, q_len, kv_len)
  check_scale_and_cap(scale)
  check_flags(causal=causal, return_lse=return_lse, interpret=interpret)
  if selection is not None:
    check_selection(selection, batch, q_len, kv_len, hk)
    q_block_size, block_size = selection.q_block_size, selection.block_size
  if q_block_size is None or block_size is None:
    raise ValueError("block_sparse_plan needs a selection or q_block_size and block_size")
  check_selection_args(block_size, q_block_size, 1, 0, 0)
  return resolve("block_sparse", q, k, v, causal=causal, segments=segment_ids is not None,
                 tiles=(int(q_block_size), int(block_size)), implementation=implementation,
                 interpret=interpret, platform=platform, device_kind=device_kind)


def _run_block_sparse(plan, q, k, v, selection, *, causal, segment_ids, kv_segment_ids, scale,
                      interpret):
  """(out, lse) of ``plan`` for validated inputs."""
  impl, q_len, kv_len = plan.implementation, q.shape[1], k.shape[1]
  if impl == "xla":
    return attention_reference(q, k, v, causal=causal, q_segment_ids=segment_ids,
                               kv_segment_ids=kv_segment_ids, scale=scale,
                               block_mask=selection.to_mask())
  if impl not in ("triton", "mosaic_tpu", "mosaic_gpu"):
    raise ValueError(f"block_sparse_attention does not support implementation={impl!r}; use "
                     f"'xla', 'triton', 'mosaic_gpu' or 'mosaic_tpu'")
  # The selection's schedule at its own tiles: the Triton and Mosaic TPU kernels walk it with
  # those tiles, the Mosaic GPU kernels with theirs, which lie inside its blocks.
  schedule = make_schedule(q_len, kv_len, selection.q_block_size, selection.block_size,
                           causal=causal, q_segment_ids=segment_ids,
                           kv_segment_ids=kv_segment_ids, block_mask=selection.tile_mask(),
                           max_kv_blocks=selection.max_selected)
  if impl == "mosaic_gpu":
    kw = dict(block_sizes=plan.config, bwd_block_sizes=plan.backward_config)
  else:
    kw = dict(local_window_size=None, logits_soft_cap=None)
    if impl == "triton":
      kw["block_sizes"] = plan.config
  return kernel_module(impl).flash_attention(q, k, v, segment_ids, kv_segment_ids, schedule,
                                             causal=causal, scale=scale, interpret=interpret, **kw)


def block_sparse_attention(q, k, v, selection, *, causal=True, segment_ids=None,
                           kv_segment_ids=None, scale=None, return_lse=False, implementation=None,
                           interpret=False):
  """Attention restricted to a block selection, forward and backward.

  Query i attends to key j iff j's block is kept for i's block (and kv head) and the causal /
  segment mask allows it. Rows that see no key return 0 and -inf log-sum-exp; NaN or inf at a
  hidden key (an unselected block included) changes nothing, as in ``jattn.flash_attention``.
  "xla" runs ``attention_reference`` with ``block_mask=selection.to_mask()``; the kernels walk a
  ``make_schedule`` of the kept tiles (ValueError for tiles a kernel cannot run; "mosaic_gpu"
  needs powers of two >= 64, bf16/fp16 and head_dim 64/128/256 == head_dim_v).

  Args:
    q, k, v: [batch, q_len, q_heads, head_dim], [batch, kv_len, kv_heads, head_dim] and
      [batch, kv_len, kv_heads, head_dim_v]; q_heads % kv_heads == 0.
    selection: a :class:`BlockSelection` for (q_len, kv_len) with [batch, kv_heads] leading axes.
    causal: bottom-right aligned causal mask.
    segment_ids, kv_segment_ids: None or int [batch, q_len] / [batch, kv_len] (0 = padding); the
      latter defaults to segment_ids when q_len == kv_len.
    scale: logit scale, default 1/sqrt(head_dim).
    return_lse: also return the log-sum-exp [batch, q_heads, q_len] (fp32, natural log).
    implementation: None (:func:`block_sparse_plan`), "xla", "triton", "mosaic_gpu", "mosaic_tpu".
    interpret: run a Pallas kernel in interpret mode (not "mosaic_gpu").

  Returns:
    out [batch, q_len, q_heads, head_dim_v] in q.dtype, or (out, lse) if return_lse.

  Example:
    >>> from jattn.sparse import select_blocks
    >>> q = jax.random.normal(jax.random.key(0), (1, 256, 2, 32))
    >>> sel = select_blocks(q, q, block_size=64, q_block_size=64, top_k=1)
    >>> block_sparse_attention(q, q, q, sel, implementation="xla").shape
    (1, 256, 2, 32)
  """
  plan = block_sparse_plan(q, k, v, selection, causal=causal, segment_ids=segment_ids,
                           kv_segment_ids=kv_segment_ids, scale=scale, return_lse=return_lse,
                           implementation=implementation, interpret=interpret)   # validates
  segment_ids, kv_segment_ids = check_segments(segment_ids, kv_segment_ids, q.shape[0],
                                               q.shape[1], k.shape[1])
  scale, _ = check_scale_and_cap(scale, head_dim=q.shape[-1])
  out, lse = _run_block_sparse(plan, q, k, v, selection, causal=causal, segment_ids=segment_ids,
                               kv_segment_ids=kv_segment_ids, scale=scale, interpret=interpret)
  return (out, lse) if return_lse else out


def _tile_logit_grads(q, k, v, out, lse, dout, dlse, selection, q_seg, kv_seg, *, causal, scale,
                      max_chunk_elems=1 << 25):
  """``pallas_kernels.sparse.gate_grad.tile_logit_grads`` in XLA, chunked over query blocks
  (~max_chunk_elems floats per chunk): fp32 [b, kv_heads, nq, max_selected], 0 in unused slots."""
  b, sq, hq, d = q.shape
  _, sk, hk, dv = v.shape
  g = hq // hk
  qbs, bs = selection.q_block_size, selection.block_size
  nq, nk, ms = selection.num_q_blocks, selection.num_kv_blocks, selection.max_selected
  c = int(max(1, min(nq, max_chunk_elems // max(1, b * hq * qbs * ms * bs))))
  nc = cdiv(nq, c)
  f32 = jnp.float32
  dt = jnp.promote_types(q.dtype, k.dtype)
  prec = _HIGHEST if dt == f32 else None
  pad_q = lambda x, val=0: pad_axis(x, 1, nc * c * qbs, val)
  qf, dof = pad_q(q.astype(dt)), pad_q(dout.astype(dt))
  delta = pad_q(jnp.sum(dout.astype(f32) * out.astype(f32), -1)
                - jnp.swapaxes(dlse.astype(f32), 1, 2))                    # [b, sq_pad, hq]
  lse_p = pad_q(jnp.swapaxes(lse.astype(f32), 1, 2), -jnp.inf)             # [b, sq_pad, hq]
  blocks = lambda x: jnp.transpose(pad_axis(x.astype(dt), 1, nk * bs).reshape(
      b, nk, bs, hk, x.shape[-1]), (0, 3, 1, 2, 4))                        # [b, hk, nk, bs, d]
  kb, vb = blocks(k), blocks(v)
  idx = pad_axis(selection.indices, 2, nc * c, -1)                         # [b, hk, nc*c, ms]
  if q_seg is not None:
    qsg = pad_q(q_seg.astype(jnp.int32))
    ksg = pad_axis(kv_seg.astype(jnp.int32), 1, nk * bs).reshape(b, nk, bs)

  def chunk(ci):
    start = ci * c * qbs
    rows = lambda x, *shape: jax.lax.dynamic_slice_in_dim(x, start, c * qbs, 1).reshape(
        b, c, qbs, *shape)                                                  # the chunk's queries
    qc, dc = rows(qf, hk, g, d), rows(dof, hk, g, dv)
    lc, tc = rows(lse_p, hk, g), rows(delta, hk, g)
    ic = jax.lax.dynamic_slice_in_dim(idx, ci * c, c, 2)                    # [b, hk, c, ms]
    safe = jnp.maximum(ic, 0).reshape(b, hk, c * ms)
    kg, vg = (jnp.take_along_axis(x, safe[:, :, :, None, None], axis=2).reshape(
        b, hk, c, ms, bs, x.shape[-1]) for x in (kb, vb))
    s = jnp.einsum("bcqhgd,bhcmkd->bhgcqmk", qc, kg, precision=prec,
                   preferred_element_type=f32) * scale
    dp = jnp.einsum("bcqhgd,bhcmkd->bhgcqmk", dc, vg, precision=prec, preferred_element_type=f32)
    q_pos = start + jnp.arange(c * qbs).reshape(c, qbs) + sk - sq           # [c, qbs]
    k_pos = ic[..., None] * bs + jnp.arange(bs)                             # [b, hk, c, ms, bs]
    mask = ((ic[..., None] >= 0) & (k_pos < sk))[:, :, None, :, None]       # [b,hk,1,c,1,ms,bs]
    if causal:
      mask = mask & (k_pos[:, :, None, :, None] <= q_pos[None, None, None, :, :, None, None])
    if q_seg is not None:
      qs = rows(qsg)
      ks = jnp.take_along_axis(jnp.broadcast_to(ksg[:, None], (b, hk, nk, bs)),
                               safe[..., None], axis=2).reshape(b, hk, c, ms, bs)
      same = (qs[:, None, :, :, None, None] == ks[:, :, :, None]) & (ks[:, :, :, None] != 0)
      mask = mask & same[:, :, None]
    # [b, hk, g, c, qbs, 1, 1]
    lt, tt = (jnp.transpose(x, (0, 3, 4, 1, 2))[..., None, None] for x in (lc, tc))
    mask = mask & ~jnp.isneginf(lt)   # a NaN lse (a row that sees a NaN key) stays NaN
    p = jnp.where(mask, jnp.exp(jnp.where(mask, s - lt, 0.0)), 0.0)
    ds = jnp.where(mask, p * (dp - tt), 0.0)   # NaN values or delta at hidden keys: 0
    return jnp.sum(ds, axis=(2, 4, 6))                                      # [b, hk, c, ms]

  res = jax.lax.map(chunk, jnp.arange(nc))                                  # [nc, b, hk, c, ms]
  return jnp.moveaxis(res, 0, 2).reshape(b, hk, nc * c, ms)[:, :, :nq]


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _gated_attention(q, k, v, gate_logits, selection, q_seg, kv_seg, causal, scale, plan,
                     interpret):
  """Block-sparse attention whose logits carry the per-kept-tile bias ``gate_logits - itself``
  (0 in the forward); gate_logits [b, hk, nq, max_selected] gets ``_tile_logit_grads``."""
  del gate_logits
  return _run_block_sparse(plan, q, k, v, selection, causal=causal, segment_ids=q_seg,
                           kv_segment_ids=kv_seg, scale=scale, interpret=interpret)


def _gated_fwd(q, k, v, gate_logits, selection, q_seg, kv_seg, causal, scale, plan, interpret):
  del gate_logits
  (out, lse), vjp_fn = jax.vjp(lambda *qkv: _run_block_sparse(
      plan, *qkv, selection, causal=causal, segment_ids=q_seg, kv_segment_ids=kv_seg, scale=scale,
      interpret=interpret), q, k, v)
  return (out, lse), (q, k, v, out, lse, vjp_fn, selection, q_seg, kv_seg)


def _gated_bwd(causal, scale, plan, interpret, res, cts):
  q, k, v, out, lse, vjp_fn, selection, q_seg, kv_seg = res
  dout, dlse = cts
  dq, dk, dv = vjp_fn((dout, dlse))
  if plan.implementation in ("triton", "mosaic_gpu"):   # the Triton gate-gradient kernel (GPU)
    from pallas_kernels.sparse.gate_grad import tile_logit_grads
    dgate = tile_logit_grads(q, k, v, out, lse, dout, dlse, selection.indices, selection.counts,
                             q_seg, kv_seg, block_q=selection.q_block_size,
                             block_k=selection.block_size, causal=causal, scale=scale,
                             interpret=interpret)
  else:
    dgate = _tile_logit_grads(q, k, v, out, lse, dout, dlse, selection, q_seg, kv_seg,
                              causal=causal, scale=scale)
  return dq, dk, dv, dgate, None, None, None


_gated_attention.defvjp(_gated_fwd, _gated_bwd)


def sparse_attention(q, k, v, *, block_size, top_k, q_block_size=64, gate_grad="none",
                     gate_temperature=1.0, rng=None, causal=True, num_init_blocks=1,
                     num_local_blocks=1, segment_ids=None, kv_segment_ids=None, scale=None,
                     implementation=None, interpret=False, return_selection=False,
                     score_aux_weight=0.0, score_aux_pool="sum", aux_max_chunk_elems=1 << 25,
                     return_lse=False, mesh=None, axis_name=None, layout="zigzag"):
  """Top-K block selection plus block-sparse attention in one call, for training.

  Blocks are kept by the rules of :func:`select_blocks` on a ranking r, then attended with
  :func:`block_sparse_attention`. With c = scale and T = gate_temperature:

    * "none": r = ``block_scores``; no gradient reaches the selection (hard top-k).
    * "ste": r = score (forward equal to "none"); every logit of a kept tile (i, j) gets the bias
      z - stop_gradient(z), z = c * score[i, j] / T, so gradients flow to q and k through the
      mean-pooled score.
    * "gumbel": r = (c * score + G) / T with G iid Gumbel(0, 1) from ``rng`` (Gumbel-top-k);
      the backward is straight-through like "ste".

  The gate gradient costs one extra pass over the kept tiles. ``score_aux_weight`` = w > 0 adds
  w * :func:`block_score_kl` to the backward only (``add_aux_loss``).

  With ``mesh`` and ``axis_name`` the call is context-parallel (``docs/context_parallel.md``) on
  arrays in ``layout``'s order (``jattn.context_parallel_permute``), equal to the single-device
  call, permuted. It needs q_len == kv_len, block sizes dividing the chunk length
  ``ceil(len / (m P))`` (m = 2 for "zigzag", 1 for "contiguous"), gate_grad "none",
  score_aux_weight 0, no return_selection.

  Args:
    q, k, v, segment_ids, kv_segment_ids, scale, implementation, interpret: as in
      :func:`block_sparse_attention`.
    block_size, top_k, q_block_size, causal, num_init_blocks, num_local_blocks: as in
      :func:`select_blocks`.
    gate_grad, gate_temperature: "none", "ste" or "gumbel" (above), and T > 0.
    rng: a jax PRNG key; required for "gumbel", ignored otherwise.
    return_selection: also return the :class:`BlockSelection`.
    score_aux_weight, score_aux_pool, aux_max_chunk_elems: w >= 0 (0: off), and the target's
      ``query_pool`` and ``max_chunk_elems`` (:func:`block_score_kl`).
    return_lse: also return the log-sum-exp [batch, q_heads, q_len] (fp32).
    mesh, axis_name, layout: None, or a ``jax.sharding.Mesh``, the axis the sequence is split
      over and its layout ("zigzag", the default, or "contiguous").

  Returns:
    out [batch, q_len, q_heads, head_dim_v] in q.dtype; with return_lse and/or
    return_selection, the tuple (out, lse?, selection?) in that order.

  Example:
    >>> q = jax.random.normal(jax.random.key(0), (1, 256, 2, 32))
    >>> loss = lambda q: sparse_attention(q, q, q, block_size=64, top_k=1, gate_grad="ste",
    ...                                   implementation="xla").sum()
    >>> jax.grad(loss)(q).shape
    (1, 256, 2, 32)
  """
  if gate_grad not in _GATE_MODES:
    raise ValueError(f"gate_grad must be one of {_GATE_MODES}, got {gate_grad!r}")
  check_number("gate_temperature", gate_temperature, 0, open_lo=True)
  check_flags(causal=causal, interpret=interpret, return_selection=return_selection,
              return_lse=return_lse)
  if gate_grad == "gumbel" and rng is None:
    raise ValueError("gate_grad='gumbel' needs rng (a jax PRNG key)")
  check_number("score_aux_weight", score_aux_weight, 0)
  if score_aux_pool not in _QUERY_POOLS:
    raise ValueError(f"score_aux_pool must be one of {_QUERY_POOLS}, got {score_aux_pool!r}")
  top_k = check_selection_args(block_size, q_block_size, top_k, num_init_blocks, num_local_blocks)
  batch, q_len, kv_len, _, _ = check_qkv(q, k, v)
  segment_ids, kv_segment_ids = check_segments(segment_ids, kv_segment_ids, batch, q_len, kv_len)
  scale, _ = check_scale_and_cap(scale, head_dim=q.shape[-1])
  if mesh is not None or axis_name is not None:
    from jattn.context_parallel import _sparse_ring
    for name, bad in (("mesh", mesh is None), ("axis_name", axis_name is None),
                      ("gate_grad", gate_grad != "none"), ("score_aux_weight", score_aux_weight),
                      ("return_selection", return_selection)):
      if bad:
        raise ValueError(f"{name}={locals()[name]!r} is not supported by the context-parallel "
                         "sparse_attention (mesh=, axis_name=)")
    out, lse = _sparse_ring(
        q, k, v, mesh=mesh, axis_name=axis_name, layout=layout, block_size=int(block_size),
        q_block_size=int(q_block_size), top_k=top_k, causal=bool(causal),
        num_init_blocks=int(num_init_blocks), num_local_blocks=int(num_local_blocks),
        segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, scale=scale,
        implementation=implementation, interpret=interpret)
    return (out, lse) if return_lse else out
  plan = block_sparse_plan(q, k, v, q_block_size=q_block_size, block_size=block_size,
                           causal=causal, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                           implementation=implementation, interpret=interpret)
  # with their gradient: for the gates and the score distillation (select_lists stops it)
  scores = block_scores(q, k, block_size=block_size, q_block_size=q_block_size,
                        segment_ids=segment_ids, kv_segment_ids=kv_segment_ids)
  if gate_grad == "gumbel":
    noise = jax.random.gumbel(rng, scores.shape, jnp.float32)
    gate = rank = (scale * scores + noise) / gate_temperature
  else:
    gate, rank = scale * scores / gate_temperature, scores
  seg_ok, doc_start = segment_rules(segment_ids, kv_segment_ids, q_block_size, block_size)
  sel = select_lists(rank, q_len=q_len, kv_len=kv_len, q_block_size=int(q_block_size),
                     block_size=int(block_size), causal=causal, num_init=int(num_init_blocks),
                     num_local=int(num_local_blocks), top_k=top_k, seg_ok=seg_ok,
                     scores=jax.lax.stop_gradient(scores), doc_start=doc_start)
  if gate_grad == "none":
    out, lse = _run_block_sparse(plan, q, k, v, sel, causal=causal, segment_ids=segment_ids,
                                 kv_segment_ids=kv_segment_ids, scale=scale, interpret=interpret)
  else:
    gate_sel = jnp.take_along_axis(gate, jnp.maximum(sel.indices, 0), axis=-1)
    gate_sel = jnp.where(sel.indices >= 0, gate_sel, 0.0)        # [b, hk, nq, max_selected]
    out, lse = _gated_attention(q, k, v, gate_sel, dataclasses.replace(sel, scores=None),
                                segment_ids, kv_segment_ids, bool(causal), float(scale), plan,
                                bool(interpret))
  if score_aux_weight > 0:
    kl = _score_kl_of(scores, (seg_ok, doc_start), q, k, block_size=block_size,
                      q_block_size=q_block_size, causal=causal, num_init_blocks=num_init_blocks,
                      num_local_blocks=num_local_blocks, segment_ids=segment_ids,
                      kv_segment_ids=kv_segment_ids, scale=scale, temperature=gate_temperature,
                      query_pool=score_aux_pool, max_chunk_elems=aux_max_chunk_elems)
    out = add_aux_loss(out, float(score_aux_weight) * kl)
  res = (out,) + ((lse,) if return_lse else ()) + ((sel,) if return_selection else ())
  return res if len(res) > 1 else out
