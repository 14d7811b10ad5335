"""Selection rules and metrics of the co-adaptation experiment, per query token.

Every rule keeps, for each query token t and kv head (shared by its GQA group of query heads),
the initial block, the query's own block and ``top_k`` more of its causally visible key blocks
(``jattn.sparse`` rules with ``q_block_size=1``; with packed documents the initial block is the
document's first). The rules differ only in how the ``top_k`` are ranked:

* **proxy**: the mean-pooled block score (``jattn.sparse.block_scores``: q_t . mean(k block),
  summed over the group's heads), the rule sparse layers train with;
* **oracle**: the true attention mass of the layer's dense softmax on each block
  (``jattn.sparse.block_attention_mass``, summed over the group's heads).

``top_k`` is the float ``keep_fraction`` (19%): each query t with V visible blocks keeps
round(0.19 V) of them (half up; at least its forced ones), the rule the sparse layers train
with (``jattn.sparse.select_blocks``); ``selection_sparsity`` reports the measured sparsity
overall and at the answers. ``per_query_top_k`` gives the count that keeps 19% at the last
query, for CSA two-stage (whose ``top_k`` is a count).

Metrics on a layer's q/k (``block_mass``: true mass [b, kv_heads, seq, key blocks], rows sum to 1):

* ``concentration``: for each query t with V visible blocks, the top ``k_t`` blocks by true mass
  among the visible blocks that are not always kept, ``k_t = round(keep_fraction * V) - forced``
  (half up; forced = always-kept blocks of t), hold this share of the mass outside the always-kept blocks;
  averaged over queries where 0 < k_t < (candidates), i.e. excluding queries that keep
  everything or nothing by rank.
* ``proxy_recall``: over the same queries, the true mass in the proxy's top ``k_t`` candidates
  divided by the true mass in the oracle's top ``k_t`` (1 = the proxy finds the oracle's mass).
* ``needle_recall``: share of answer queries whose needle's block a selection keeps.

``masked_forward`` runs a ``jattn.nn.Transformer`` of global layers with each layer's attention
restricted to the proxy's or the oracle's selection on that layer's own q/k (post-hoc pruning).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

RULES = ("proxy", "oracle")


def per_query_top_k(seq_len, block_size, keep_fraction=0.19, num_forced=2):
  """``top_k`` such that the last query keeps ``round(keep_fraction * visible)`` blocks in all.

  Args:
    seq_len: tokens per row.
    block_size: keys per block.
    keep_fraction: share of the last query's visible blocks to keep (forced ones included).
    num_forced: always-kept blocks (initial + local).

  Returns:
    int >= 1.

  Example:
    >>> per_query_top_k(512, 16)   # 32 visible blocks: 6 kept = 2 forced + 4 by rank
    4
  """
  nb = -(-seq_len // block_size)
  return int(max(1, round(keep_fraction * nb) - num_forced))


def segment_parts(segment_ids, block_size):
  """(seg_ok, doc_start) of ``jattn.sparse.selection`` for per-token selection (None, None
  without segment ids)."""
  from jattn.sparse.selection import segment_rules
  return segment_rules(segment_ids, segment_ids, 1, block_size)


def block_mass(q, k, *, block_size, segment_ids=None):
  """True attention mass of each key block for each query token, per GQA group.

  Args:
    q: [b, s, hq, d]; k: [b, s, hk, d] (as the layer's attention sees them).
    block_size: keys per block.
    segment_ids: None or int [b, s].

  Returns:
    fp32 [b, hk, s, num_blocks]: the dense softmax mass, averaged over the group's query heads
    (each visible row sums to 1).
  """
  from jattn.sparse import block_attention_mass
  g = q.shape[2] // k.shape[2]
  return block_attention_mass(q, k, block_size=block_size, q_block_size=1, causal=True,
                              segment_ids=segment_ids) / g


def select(rule, q, k, *, block_size, top_k, segment_ids=None):
  """Per-token block selection by ``rule`` ("proxy" or "oracle"; see the module docstring).

  Returns:
    ``jattn.sparse.BlockSelection`` with ``q_block_size=1``.
  """
  from jattn.sparse import block_scores
  from jattn.sparse.selection import select_lists
  if rule not in RULES:
    raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
  s = q.shape[1]
  if rule == "proxy":
    rank = block_scores(q, k, block_size=block_size, q_block_size=1, segment_ids=segment_ids,
                        kv_segment_ids=segment_ids)
  else:
    rank = block_mass(q, k, block_size=block_size, segment_ids=segment_ids)
  seg_ok, doc_start = segment_parts(segment_ids, block_size)
  return select_lists(rank, q_len=s, kv_len=s, q_block_size=1, block_size=block_size,
                      causal=True, num_init=1, num_local=1, top_k=top_k, seg_ok=seg_ok,
                      scores=jax.lax.stop_gradient(rank), doc_start=doc_start)


def masked_forward(model, tokens, *, rule, block_size, top_k, segment_ids=None, positions=None):
  """Forward pass of a ``jattn.nn.Transformer`` of global layers with post-hoc selection.

  Each layer computes its q/k/v as the model does, selects per token by ``rule`` on them and
  attends only to the kept blocks (``jattn.sparse.block_sparse_attention`` through its XLA path:
  the kernels select per tile of at least 16 queries, not per token).

  Args:
    model: ``jattn.nn.Transformer`` whose layers are all "global" (the full model).
    tokens: int [b, s].
    rule: "proxy" or "oracle".
    block_size, top_k: the selection.
    segment_ids, positions: as for the model's call.

  Returns:
    (logits [b, s, vocab], per-layer list of {"q", "k", "selection"}).
  """
  from jattn.sparse import block_sparse_attention
  if any(spec.kind != "global" for spec in model.config.layers):
    raise ValueError("masked_forward prunes a model of 'global' layers (the full model)")
  b, s = tokens.shape
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  x = model.embed(tokens)
  layers = []
  for blk in model.blocks:
    attn = blk.attn
    h = blk.attn_norm(x)
    # the layer's own projections (norms, RoPE) so the pruned attention sees exactly its q/k/v
    q, ent = attn._project(h, positions)
    k, v = attn._expand(ent)
    sel = select(rule, q, k, block_size=block_size, top_k=top_k, segment_ids=segment_ids)
    o = block_sparse_attention(q, k, v, sel, causal=True, segment_ids=segment_ids,
                               scale=attn.scale, implementation="xla")
    x = x + attn.wo(o.astype(h.dtype).reshape(b, s, -1))
    x = x + blk.mlp(blk.mlp_norm(x))
    layers.append({"q": q, "k": k, "selection": sel})
  return model._logits(x), layers


# ------------------------------------------------------------------------------------ metrics

def forced_and_visible(seq_len, block_size):
  """bool [s, nb] masks: always-kept (block 0 and the query's own) and causally visible."""
  t = np.arange(seq_len)[:, None]
  j = np.arange(-(-seq_len // block_size))[None, :]
  visible = j <= t // block_size
  forced = visible & ((j == 0) | (j == t // block_size))
  return forced, visible


def top_count_mask(x, cand, k):
  """bool mask of each row's ``k`` (per row, broadcast) largest entries of ``x`` among ``cand``,
  ties to the lower index.

  Args:
    x: [..., n] values; cand: bool [..., n]; k: int [...] (rows may differ).
  """
  x = jnp.where(cand, x, -jnp.inf)
  order = jnp.argsort(-x, axis=-1, stable=True)
  pos = jnp.argsort(order, axis=-1, stable=True)                 # rank position of each entry
  return (pos < k[..., None]) & cand


def rank_counts(seq_len, block_size, keep_fraction):
  """(k_t [s], included [s]) of the concentration metric (module docstring): k_t is what the
  selection with ``top_k=keep_fraction`` ranks for query t (``row_budget``)."""
  from jattn.sparse.selection import row_budget
  forced, visible = forced_and_visible(seq_len, block_size)
  n_vis, n_forced = visible.sum(-1), forced.sum(-1)
  k = row_budget(float(keep_fraction), visible.shape[1])[n_vis].astype(np.int64) - n_forced
  n_cand = n_vis - n_forced
  return np.maximum(k, 0), (k > 0) & (k < n_cand)


@functools.partial(jax.jit, static_argnames=("block_size", "keep_fraction"))
def concentration_and_recall(mass, proxy_rank, *, block_size, keep_fraction=0.19):
  """Concentration of the true mass and the proxy's recall of it (module docstring).

  Args:
    mass: fp32 [b, hk, s, nb] true block mass (``block_mass``).
    proxy_rank: [b, hk, s, nb] the proxy's block scores (``jattn.sparse.block_scores`` with
      ``q_block_size=1``).
    block_size: keys per block; keep_fraction: the kept share.

  Returns:
    (concentration, proxy_recall): fp32 scalars, means over included queries, heads and rows
    (NaN when no query is included: too few visible blocks for the kept fraction).
  """
  s = mass.shape[2]
  forced, visible = forced_and_visible(s, block_size)
  k, inc = rank_counts(s, block_size, keep_fraction)
  cand = jnp.asarray(visible & ~forced)[None, None]
  kk = jnp.broadcast_to(jnp.asarray(k), mass.shape[:3])
  oracle = top_count_mask(mass, cand, kk)
  proxy = top_count_mask(proxy_rank, cand, kk)
  rest = jnp.sum(jnp.where(cand, mass, 0.0), -1)
  top = jnp.sum(jnp.where(oracle, mass, 0.0), -1)
  got = jnp.sum(jnp.where(proxy, mass, 0.0), -1)
  w = jnp.broadcast_to(jnp.asarray(inc)[None, None], top.shape) & (rest > 0)
  cnt = jnp.sum(w)
  n = jnp.where(cnt > 0, cnt, jnp.nan)                    # no included query: NaN, not 0
  conc = jnp.sum(jnp.where(w, top / jnp.where(w, rest, 1.0), 0.0)) / n
  rec = jnp.sum(jnp.where(w, got / jnp.where(w, top, 1.0), 0.0)) / n
  return conc, rec


def selection_sparsity(selection, answer_pos=None):
  """Measured block sparsity of a per-token selection: 1 - kept / visible blocks.

  Args:
    selection: ``BlockSelection`` with ``q_block_size=1``.
    answer_pos: None or int [b, a] query positions of the answers.

  Returns:
    (overall, at_answers or None): floats (means over rows, kv heads and the queries).
  """
  counts = np.asarray(selection.counts, np.float64)                 # [b, hk, s]
  vis = np.broadcast_to(np.asarray(selection.num_visible, np.float64), counts.shape)
  overall = float(1.0 - counts.sum() / vis.sum())
  if answer_pos is None:
    return overall, None
  r = np.arange(counts.shape[0])[:, None]
  c, v = counts[r, :, answer_pos], vis[r, :, answer_pos]           # [b, a, hk]
  return overall, float(1.0 - c.sum() / v.sum())


def needle_recall(selections, answer_pos, needle_pos, block_size):
  """Share of answer queries whose needle's block is kept, per layer (any kv head).

  Args:
    selections: per-layer ``BlockSelection`` (``q_block_size=1``).
    answer_pos, needle_pos: int [b, a] positions (``coadaptation.needle_targets``).

  Returns:
    list of floats, one per layer.
  """
  out = []
  r = np.arange(answer_pos.shape[0])[:, None]
  for sel in selections:
    t = np.asarray(sel.tile_mask())                                 # [b, hk, s, nb]
    hit = t[r, :, answer_pos, needle_pos // block_size]             # [b, a, hk]
    out.append(float(hit.any(-1).mean()))
  return out


def paired_bootstrap(a, b, *, num_resamples=10_000, seed=0, level=0.95):
  """Mean paired difference ``a - b`` over seeds with a percentile bootstrap interval.

  Args:
    a, b: per-seed values of two variants (same seeds, same order).
    num_resamples: bootstrap resamples of the seeds.
    seed: resampling seed.
    level: interval coverage.

  Returns:
    dict "diff" (mean of a - b), "lo", "hi" (interval), "n" (seeds).

  Example:
    >>> d = paired_bootstrap([0.9, 0.8, 0.85], [0.5, 0.45, 0.4])
    >>> round(d["diff"], 3), d["lo"] > 0
    (0.4, True)
  """
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if a.ndim != 1 or a.shape != b.shape or a.size == 0:
    raise ValueError(f"a and b must be equal-length 1-D sequences, got shapes {a.shape} and "
                     f"{b.shape}")
  d = a - b
  rng = np.random.default_rng(seed)
  means = d[rng.integers(0, d.size, (num_resamples, d.size))].mean(1)
  lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
  return {"diff": float(d.mean()), "lo": float(lo), "hi": float(hi), "n": int(d.size)}
