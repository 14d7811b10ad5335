"""What a block selection keeps: captured attention mass, true block mass and score distillation."""

import jax
import jax.numpy as jnp

from jattn._validate import check_qkv, check_scale_and_cap, check_segments
from pallas_kernels.common.util import pad_axis
from pallas_kernels.masks import element_mask
from jattn.sparse.selection import (_HIGHEST, block_scores, candidates, cdiv, check_selection,
                                    check_selection_args, segment_rules)

__all__ = ["captured_mass", "block_attention_mass", "block_score_kl", "add_aux_loss"]

_QUERY_POOLS = ("sum", "max")


def _chunk_logits(q, k, segment_ids, kv_segment_ids, unit, max_chunk_elems, dt, *, causal, scale):
  """(logits, c, nc): nc chunks of c * unit query rows (about max_chunk_elems logits each);
  logits(ci): chunk ci's scaled fp32 logits [b, hk, g, rows, kv_len] (products in ``dt``; -inf where
  hidden) and their visibility (``element_mask``, broadcastable; padding rows see nothing)."""
  (b, q_len, hq, d), (kv_len, hk) = q.shape, k.shape[1:3]
  n = cdiv(q_len, unit)
  c = int(max(1, min(n, max_chunk_elems // max(1, b * hq * unit * kv_len))))
  rows, nc = c * unit, cdiv(n, c)
  qf, kf = pad_axis(q.astype(dt), 1, nc * rows), k.astype(dt)
  qsg = None if segment_ids is None else pad_axis(segment_ids, 1, nc * rows)
  prec = _HIGHEST if dt == jnp.float32 else None

  def logits(ci):
    start = ci * rows
    qc = jax.lax.dynamic_slice_in_dim(qf, start, rows, 1).reshape(b, rows, hk, hq // hk, d)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qc, kf, precision=prec, preferred_element_type=jnp.float32)
    t = start + jnp.arange(rows)                                           # query index
    seg = {} if qsg is None else dict(
        q_seg=jax.lax.dynamic_slice_in_dim(qsg, start, rows, 1)[:, None, None, :],
        kv_seg=kv_segment_ids[:, None, None, :])
    vis = element_mask(t + kv_len - q_len, jnp.arange(kv_len), causal=causal, window=None, **seg)
    vis = vis & (t < q_len)[:, None]
    return jnp.where(vis, s * scale, -jnp.inf), vis
  return logits, c, nc


def captured_mass(q, k, selection, *, causal=True, segment_ids=None, kv_segment_ids=None,
                  scale=None, reduce=True, max_chunk_elems=1 << 25):
  """Fraction of the full-softmax attention probability that falls inside the kept blocks.

  Args:
    q, k: [batch, q_len, q_heads, head_dim] and [batch, kv_len, kv_heads, head_dim].
    selection: a :class:`BlockSelection` for (q_len, kv_len).
    causal, segment_ids, kv_segment_ids, scale: the full softmax's mask and scale, as in
      :func:`~jattn.sparse.block_sparse_attention`.
    reduce: True: one scalar mean over valid queries; False: fp32 [batch, q_heads] means.
    max_chunk_elems: bound on the fp32 logits materialised per chunk of queries.

  Returns:
    fp32 scalar or [batch, q_heads].

  Example:
    >>> from jattn.sparse import select_blocks
    >>> q = jax.random.normal(jax.random.key(0), (1, 256, 2, 32))
    >>> sel = select_blocks(q, q, block_size=64, top_k=4)
    >>> float(captured_mass(q, q, sel))
    1.0
  """
  batch, q_len, kv_len, hq, hk = check_qkv(q, k, k)
  segment_ids, kv_segment_ids = check_segments(segment_ids, kv_segment_ids, batch, q_len, kv_len)
  check_selection(selection, batch, q_len, kv_len, hk)
  scale, _ = check_scale_and_cap(scale, head_dim=q.shape[-1])
  logits, cq, nc = _chunk_logits(q, k, segment_ids, kv_segment_ids, 1, max_chunk_elems,
                                 jnp.float32, causal=causal, scale=scale)
  tiles = selection.tile_mask()                                            # [b, hk, nq, nk]
  kblock = jnp.arange(kv_len) // selection.block_size                      # [sk]

  def chunk(ci):
    s_all, _ = logits(ci)
    t = ci * cq + jnp.arange(cq)                                           # query index
    rows = jnp.take(tiles, jnp.minimum(t // selection.q_block_size, selection.num_q_blocks - 1),
                    axis=2)
    kept = jnp.take(rows, kblock, axis=3)[:, :, None]                      # [b, hk, 1, cq, sk]
    lse_all = jax.nn.logsumexp(s_all, axis=-1)
    lse_sel = jax.nn.logsumexp(jnp.where(kept, s_all, -jnp.inf), axis=-1)
    ok = jnp.isfinite(lse_all)
    mass = jnp.where(ok, jnp.exp(lse_sel - jnp.where(ok, lse_all, 0.0)), 0.0)  # [b, hk, g, cq]
    return (mass.sum(-1).reshape(batch, hq), ok.sum(-1).reshape(batch, hq).astype(jnp.float32))
  mass, cnt = jax.lax.map(chunk, jnp.arange(nc))
  mass, cnt = mass.sum(0), cnt.sum(0)                                      # [b, hq]
  if reduce:
    return jnp.sum(mass) / jnp.maximum(jnp.sum(cnt), 1.0)
  return jnp.where(cnt > 0, mass / jnp.maximum(cnt, 1.0), 0.0)


def block_attention_mass(q, k, *, block_size=64, q_block_size=64, causal=True, segment_ids=None,
                         kv_segment_ids=None, scale=None, query_pool="sum",
                         max_chunk_elems=1 << 25):
  """Dense attention probability pooled onto (query block, key block) tiles, per GQA group.

  Query t's mass on key block j, summed over the group's query heads and pooled over the queries
  of block i by ``query_pool``: the target of :func:`block_score_kl`; not differentiable.

  Args:
    q, k, causal, segment_ids, kv_segment_ids, scale: as in :func:`captured_mass`.
    block_size, q_block_size: key / query block sizes.
    query_pool: "sum", or "max" (SeerAttention's ground truth).
    max_chunk_elems: bound on the logits materialised per chunk of query blocks.

  Returns:
    fp32 [batch, kv_heads, num_q_blocks, num_kv_blocks].

  Example:
    >>> q = jax.random.normal(jax.random.key(0), (1, 96, 4, 16))
    >>> m = block_attention_mass(q, q[:, :, :2], block_size=32, q_block_size=32)
    >>> m.shape, float(m[0, 0, 1].sum())   # 2 query heads per group x 32 queries
    ((1, 2, 3, 3), 64.0)
  """
  if query_pool not in _QUERY_POOLS:
    raise ValueError(f"query_pool must be one of {_QUERY_POOLS}, got {query_pool!r}")
  batch, q_len, kv_len, _, hk = check_qkv(q, k, k)
  segment_ids, kv_segment_ids = check_segments(segment_ids, kv_segment_ids, batch, q_len, kv_len)
  q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
  scale, _ = check_scale_and_cap(scale, head_dim=q.shape[-1])
  qbs, bs = int(q_block_size), int(block_size)
  nq, nk = cdiv(q_len, qbs), cdiv(kv_len, bs)
  logits, c, nc = _chunk_logits(q, k, segment_ids, kv_segment_ids, qbs, max_chunk_elems,
                                jnp.promote_types(q.dtype, k.dtype), causal=causal, scale=scale)

  def chunk(ci):
    s, vis = logits(ci)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(vis, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)         # [b, hk, g, cq, sk]
    p = jnp.sum(pad_axis(p, 4, nk * bs).reshape(batch, hk, -1, c, qbs, nk, bs), axis=6)
    p = jnp.max(p, axis=4) if query_pool == "max" else jnp.sum(p, axis=4)
    return jnp.sum(p, axis=2)                                              # [b, hk, c, nk]
  res = jax.lax.map(chunk, jnp.arange(nc))                                 # [nc, b, hk, c, nk]
  return jnp.moveaxis(res, 0, 2).reshape(batch, hk, nc * c, nk)[:, :, :nq]


def score_kl(z, mass, cand):
  """Mean over rows of KL(p || softmax(z)) over the candidates ``cand`` (bool, broadcastable to
  z, mass [b, hk, nq, nk]); p = mass renormalised over them. Rows with fewer than two candidates
  or no candidate mass are skipped."""
  cand = jnp.broadcast_to(cand, z.shape)
  tgt = jnp.where(cand, jax.lax.stop_gradient(mass).astype(jnp.float32), 0.0)
  tot = jnp.sum(tgt, axis=-1, keepdims=True)
  ok = (jnp.sum(cand, axis=-1) >= 2) & (tot[..., 0] > 0)                  # [b, hk, nq]
  p = tgt / jnp.where(tot > 0, tot, 1.0)
  use = cand & ok[..., None]
  logq = jax.nn.log_softmax(jnp.where(use, z.astype(jnp.float32), -jnp.inf), axis=-1)
  logq = jnp.where(use, logq, 0.0)
  pos = use & (p > 0)
  kl = jnp.sum(jnp.where(pos, p * (jnp.log(jnp.where(pos, p, 1.0)) - logq), 0.0), axis=-1)
  return jnp.sum(kl) / jnp.maximum(jnp.sum(ok), 1).astype(jnp.float32)


def block_score_kl(q, k, *, block_size=64, q_block_size=64, causal=True, num_init_blocks=1,
                   num_local_blocks=1, segment_ids=None, kv_segment_ids=None, scale=None,
                   temperature=1.0, query_pool="sum", max_chunk_elems=1 << 25):
  """Score-distillation loss: how far the block scorer's distribution is from the dense
  attention's block mass (``sparse_attention(score_aux_weight=...)`` trains on it).

  Over the candidate blocks C(i) (selectable, not always kept), KL(p || softmax(z)) with
  p = :func:`block_attention_mass` normalised over C(i) (stop-gradient) and
  z = scale * score / T, averaged over query blocks with |C(i)| >= 2 and some target mass.

  Args:
    q, k: as in :func:`select_blocks` (differentiable through the scores only).
    block_size, q_block_size, causal, num_init_blocks, num_local_blocks, segment_ids,
      kv_segment_ids: the selection rules (:func:`select_blocks`).
    scale, temperature: c (default 1/sqrt(head_dim)) and T > 0.
    query_pool, max_chunk_elems: the target's pooling and chunking (:func:`block_attention_mass`).

  Returns:
    fp32 scalar (nats).

  Example:
    >>> q = jax.random.normal(jax.random.key(0), (1, 256, 2, 16))
    >>> kl = block_score_kl(q, q, block_size=32, q_block_size=32)
    >>> bool(kl >= 0), jax.grad(lambda q: block_score_kl(q, q, block_size=32,
    ...                                                   q_block_size=32))(q).shape
    (True, (1, 256, 2, 16))
  """
  check_selection_args(block_size, q_block_size, 1, num_init_blocks, num_local_blocks)
  if not temperature > 0:
    raise ValueError(f"temperature must be > 0, got {temperature}")
  batch, q_len, kv_len, _, _ = check_qkv(q, k, k)
  segment_ids, kv_segment_ids = check_segments(segment_ids, kv_segment_ids, batch, q_len, kv_len)
  scale, _ = check_scale_and_cap(scale, head_dim=q.shape[-1])
  scores = block_scores(q, k, block_size=block_size, q_block_size=q_block_size,
                        segment_ids=segment_ids, kv_segment_ids=kv_segment_ids)
  rules = segment_rules(segment_ids, kv_segment_ids, q_block_size, block_size)
  return _score_kl_of(scores, rules, q, k, block_size=block_size, q_block_size=q_block_size,
                      causal=causal, num_init_blocks=num_init_blocks,
                      num_local_blocks=num_local_blocks, segment_ids=segment_ids,
                      kv_segment_ids=kv_segment_ids, scale=scale, temperature=temperature,
                      query_pool=query_pool, max_chunk_elems=max_chunk_elems)


def _score_kl_of(scores, rules, q, k, *, num_init_blocks, num_local_blocks, temperature, **kw):
  """:func:`block_score_kl` of checked arguments, given ``scores`` (with their gradient) and
  ``segment_rules`` ``rules`` (``sparse_attention`` reuses its own); ``kw``: the keywords of
  :func:`block_attention_mass`."""
  seg_ok, doc_start = rules
  cand, _, _ = candidates(q.shape[0], k.shape[2], q_len=q.shape[1], kv_len=k.shape[1],
                           q_block_size=int(kw["q_block_size"]), block_size=int(kw["block_size"]),
                           causal=kw["causal"], num_init=int(num_init_blocks),
                           num_local=int(num_local_blocks), seg_ok=seg_ok, doc_start=doc_start)
  return score_kl(kw["scale"] * scores / temperature, block_attention_mass(q, k, **kw), cand)


@jax.custom_vjp
def add_aux_loss(x, loss):
  """Identity on ``x``; in the backward pass ``loss`` receives cotangent 1 (DeepSeek-V2/V3's
  ``AddAuxiliaryLoss``).

  Args:
    x: any array.
    loss: a scalar whose gradient joins the caller's.

  Returns:
    ``x``; the gradient of the caller's scalar loss L becomes that of L + loss.

  Example:
    >>> w = jnp.float32(2.0)
    >>> float(jax.grad(lambda w: add_aux_loss(jnp.ones(3), w ** 2).sum())(w))
    4.0
  """
  del loss
  return x


add_aux_loss.defvjp(lambda x, loss: (x, jnp.zeros_like(loss)),
                    lambda zero, g: (g, jnp.ones_like(zero)))
